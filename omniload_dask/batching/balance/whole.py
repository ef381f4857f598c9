"""Pass 3's round of whole pieces: per pair, the move, swap or exchange that best evens it.

For every pair of a round at once (:mod:`.pairs`), it weighs a few pieces of each group spread
over its costs (the candidates) and finds the change whose cost shift is nearest half the
pair's gap: the move of one piece into the light group's roomiest micro-batch, the swap of two
pieces, or the exchange of one piece for a run of the shortest pieces of one of the light
group's micro-batches (when both are full of tokens, only an exchange moves attention cost)::

    both groups full (no room for a move or a one-for-one swap), cost grows faster than L
    heavy: pieces of cost 40 (16 tokens) and 10     light: 4 pieces of cost 5 (4 tokens each)
    gap = 50 - 20 = 30; exchange the 40 for the 4 short pieces: shift 40 - 20 = 20
    loads 30, 40 -> the step costs 40 instead of 50

Every change keeps each micro-batch within its tokens and leaves no more of them empty. With a
cost function given (cutting allowed), an exchange may cut the last piece of its run so that
the heavy micro-batch takes back just what it has room for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from omniload_dask.batching.balance.pairs import PROGRESS, Pairs, probed
from omniload_dask.batching.balance.pieces import Bins, Pieces
from omniload_dask.batching.balance.tables import RoundTables, Runs, rebin
from omniload_dask.plan.cost import CostFunction

__all__ = ["Round", "nothing", "whole_round"]

# Each pair's score (its larger cost after the change less the mean of the two before; inf:
# nothing helps) and the commit that makes the changes of the pairs of a mask.
Round = tuple[np.ndarray, Callable[[np.ndarray], None]]


def nothing(mask: np.ndarray) -> None:
    """The commit of a round that found nothing."""


@dataclass(frozen=True)
class Exchanges:
    """Per pair, the best exchange of a heavy piece for a run of a light micro-batch's
    shortest pieces: its score, the piece, the light bin, the run
    (``runs.order[run_lo:run_hi]``) and ``tail``, the tokens cut off the run's last piece
    (0: none)."""

    score: np.ndarray
    piece: np.ndarray
    target: np.ndarray
    run_lo: np.ndarray
    run_hi: np.ndarray
    tail: np.ndarray


def whole_round(
    p: Pieces, bins: Bins, load: np.ndarray, pairs: Pairs, cost: CostFunction | None = None,
    shared: RoundTables | None = None,
) -> Round:  # fmt: skip
    """One round of moves, swaps and exchanges (module doc), the best for each pair. With
    ``cost``, an exchange may cut the last piece of its run. ``shared`` holds what a cut
    round's weighing reads too (made here if not given); each step's probe judges its own
    pairs (:mod:`.pairs`)."""
    heavy, light = pairs.heavy, pairs.light
    none: Round = (np.full(len(heavy), np.inf), nothing)
    if pairs.probe_alone():
        tried, _ = whole_round(*probed(p, bins, load, pairs), cost)
        if not np.isfinite(tried).all():
            return none
    if shared is None:  # (made after the probe: a round the probe ends costs no tables)
        shared = RoundTables(p, bins, light, len(load))
    gap = load[heavy] - load[light]
    both = shared.candidates(np.concatenate([heavy, light]), pairs.candidates())
    hc, lc = both[: len(heavy)], both[len(heavy) :]  # (pairs, candidates) each, -1: none
    swaps = _swaps(p, bins, hc, lc, gap)
    dest, moves = _moves(p, bins, shared, light, hc, gap)
    ex = _exchanges(p, bins, shared.runs, light, shared.every, hc, load[heavy], load[light], cost)
    best = np.stack([swaps.min(axis=1), moves.min(axis=1), ex.score], axis=1)
    kind = np.argmin(best, axis=1)  # 0 swap, 1 move, 2 exchange (ties: in that order)
    score = best[np.arange(len(heavy)), kind]
    # A change must lower the heavy group by PROGRESS of its cost (the score is the new
    # larger cost less the pair's mean, which is half the gap below the heavy group).
    act = pairs.probed(score < (gap / 2) - PROGRESS * load[heavy])
    if not act.any():
        return none

    def commit(mask: np.ndarray) -> None:
        do = act & mask
        if not do.any():
            return
        new_bin = p.bin.copy()
        sel = do & (kind == 0)
        if sel.any():
            flat = np.argmin(swaps[sel], axis=1)
            a, c = np.divmod(flat, hc.shape[1])
            hp, qp = hc[sel, a], lc[sel, c]
            new_bin[hp], new_bin[qp] = p.bin[qp], p.bin[hp]
        sel = do & (kind == 1)
        if sel.any():
            a = np.argmin(moves[sel], axis=1)
            new_bin[hc[sel, a]] = dest[sel, a]
        _commit_exchanges(p, bins, new_bin, ex, do & (kind == 2), shared.runs, cost)

    return np.where(act, score, np.inf), commit


def _swaps(p: Pieces, bins: Bins, hc: np.ndarray, lc: np.ndarray, gap: np.ndarray) -> np.ndarray:
    """Per pair, the score of every swap of a heavy candidate for a light one, (P, K x K):
    same bucket, both micro-batches within their tokens, a shift below the gap."""
    h, q = np.maximum(hc, 0), np.maximum(lc, 0)
    h_len, q_len = p.length[h], p.length[q]
    ok = (hc >= 0)[:, :, None] & (lc >= 0)[:, None, :]
    ok &= p.bucket[h][:, :, None] == p.bucket[q][:, None, :]
    ok &= (bins.room[p.bin[h]] + h_len)[:, :, None] >= q_len[:, None, :]
    ok &= (bins.room[p.bin[q]] + q_len)[:, None, :] >= h_len[:, :, None]
    delta = p.cost[h][:, :, None] - p.cost[q][:, None, :]
    ok &= (delta > 0) & (delta < gap[:, None, None])
    return np.where(ok, np.abs(gap[:, None, None] / 2 - delta), np.inf).reshape(len(hc), -1)


def _moves(
    p: Pieces, bins: Bins, shared: RoundTables, light: np.ndarray, hc: np.ndarray,
    gap: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """Per pair, each heavy candidate's move into the light group's micro-batch of its bucket
    with the most room, and its score, (P, K) each. A move that empties its micro-batch goes
    only into an empty one (no more micro-batches stay empty)."""
    h = np.maximum(hc, 0)
    h_len, h_cost = p.length[h], p.cost[h]
    per_bin = np.bincount(p.bin, minlength=len(bins.room))
    dest = shared.roomiest[light[:, None], p.bucket[h]]
    fills = per_bin[np.maximum(dest, 0)] == 0
    ok = (hc >= 0) & (dest >= 0) & ((per_bin[p.bin[h]] > 1) | fills)
    ok &= bins.room[np.maximum(dest, 0)] >= h_len
    ok &= h_cost < gap[:, None]
    return dest, np.where(ok, np.abs(gap[:, None] / 2 - h_cost), np.inf)


def _exchanges(
    p: Pieces, bins: Bins, runs: Runs, light: np.ndarray, every: np.ndarray, hc: np.ndarray,
    load_heavy: np.ndarray, load_light: np.ndarray, cost: CostFunction | None,
) -> Exchanges:  # fmt: skip
    """Per pair, the best exchange of a heavy candidate for a run of the shortest pieces of
    one of the light group's micro-batches of its bucket (:class:`Exchanges`). With ``cost``,
    the run's last piece may be cut so that the heavy micro-batch takes back just what it has
    room for. The score is the pair's larger cost after the exchange less the mean of the
    two before."""
    P = len(hc)
    load_h, load_l = load_heavy[:, None, None], load_light[:, None, None]
    h = np.maximum(hc, 0)
    if every.shape[1] == 1:  # one bucket: every candidate's bins are its light group's
        target = np.broadcast_to(every[light, 0][:, None, :], (*hc.shape, every.shape[2]))
    else:
        target = every[light[:, None], p.bucket[h]]  # (P, K, M)
    valid = (hc >= 0)[:, :, None] & (target >= 0)
    y = np.maximum(target, 0)
    h_len = p.length[h][:, :, None]
    h_cost = p.cost[h][:, :, None]
    need = h_len - bins.room[y]  # tokens the light bin must give back
    found, back_t, back_c, at = runs.take(y, need)
    valid &= (need > 0) & found
    fill = h_len + bins.room[p.bin[h]][:, :, None]  # the most the heavy bin takes back
    whole = back_t <= fill
    last = runs.order[at]
    tail = np.zeros(at.shape, np.int64)
    new_h = load_h - h_cost + back_c
    new_l = load_l + h_cost - back_c
    if cost is None:
        valid &= whole
    else:  # the last piece of the run: its tail goes, its head stays
        tail = np.where(whole, 0, fill - (back_t - p.length[last]))
        n_last = p.length[last]
        both = np.concatenate([np.maximum(tail, 1).ravel(), np.maximum(n_last - tail, 1).ravel()])
        parts = np.asarray(cost(both), dtype=np.float64).reshape(2, *tail.shape)
        cut_h = load_h - h_cost + back_c - p.cost[last] + parts[0]
        cut_l = load_l + h_cost - back_c + parts[1] + p.extra[last]
        new_h = np.where(whole, new_h, cut_h)
        new_l = np.where(whole, new_l, cut_l)
    worst = np.maximum(new_h, new_l)
    valid &= worst < load_h * (1 - PROGRESS)
    # Each pair's best over its (candidate, bin) grid: one argmin of the flattened grid,
    # the index taken apart with divmod (ties: the first candidate, then the first bin).
    score = np.where(valid, worst - (load_h + load_l) / 2, np.inf).reshape(P, -1)
    flat = np.argmin(score, axis=1)
    rows = np.arange(P)
    a, m = np.divmod(flat, target.shape[2])
    yb = y[rows, a, m]
    return Exchanges(
        score[rows, flat], h[rows, a], yb, runs.first[yb], at[rows, a, m] + 1, tail[rows, a, m]
    )


def _commit_exchanges(
    p: Pieces, bins: Bins, new_bin: np.ndarray, ex: Exchanges, sel: np.ndarray, runs: Runs,
    cost: CostFunction | None,
) -> None:  # fmt: skip
    """Make the exchanges of the pairs ``sel`` on top of ``new_bin`` (the round's swaps and
    moves), cut the runs' last pieces that give a tail, and recompute the bins."""
    cut_last = cut_tail = cut_to = np.zeros(0, np.int64)
    if sel.any():
        order, piece, target = runs.order, ex.piece[sel], ex.target[sel]
        new_bin[piece] = target
        # Every run's positions in ``order`` in one array: each run's start, repeated over
        # its length, plus a count within the run (the offsets of a running sum, no loop).
        counts = ex.run_hi[sel] - ex.run_lo[sel]
        taken = (ex.run_lo[sel] - counts.cumsum() + counts).repeat(counts)
        taken += np.arange(int(counts.sum()))
        new_bin[order[taken]] = p.bin[piece].repeat(counts)
        cutting = ex.tail[sel] > 0  # the run's last piece stays, less its tail
        cut_last = order[ex.run_hi[sel][cutting] - 1]
        cut_tail, cut_to = ex.tail[sel][cutting], p.bin[piece][cutting]
        new_bin[cut_last] = target[cutting]
    p.bin = new_bin
    if len(cut_last) and cost is not None:
        by_piece = cut_last.argsort()  # (distinct pieces: any sort gives this order)
        cut_last, cut_tail, cut_to = cut_last[by_piece], cut_tail[by_piece], cut_to[by_piece]
        parts = np.stack([p.length[cut_last] - cut_tail, cut_tail], axis=1).ravel()
        index = p.cut(cut_last.repeat(2), parts, cost)
        p.bin[index[1::2]] = cut_to
    rebin(p, bins)

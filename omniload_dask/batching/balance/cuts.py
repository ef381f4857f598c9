"""Pass 3's cut round: per pair, the tail of a heavy piece handed over, cut where it evens most.

Each heavy group hands the tail of one of its ``CUT_PIECES`` costliest pieces to the light
group's micro-batch of that bucket with the most room; that micro-batch may give back a run of
its k shortest pieces (k < ``CUT_RUNS``) to make room, the tail then being about as long as the
run. Every (piece, run) gets ``CUT_GRID`` cut points spread over the tails that fit both ways,
and the pair takes the one whose larger group cost is least::

    cost = L^2, one micro-batch of 10 tokens each, light group has room for 4
    heavy: a piece of 10 (100)        light: pieces 3, 3 (18)
    run k = 0: tails 1..4 fit; tail 4: heavy 6^2 = 36, light 18 + 16 = 34 -> worst 36
    run k = 1 (gives back a 3): tails 1..7; tail 5: heavy 25 + 9 = 34, light 9 + 25 = 34

A cut moves a document's tail into another group: the document goes on in that group's
micro-batch (``Assignment.cuts`` counts them); pass 5 (:mod:`.slide`) may slide that cut later.
"""

from __future__ import annotations

import numpy as np

from omniload_dask.batching.balance.pairs import PROGRESS, Pairs, probed
from omniload_dask.batching.balance.pieces import Bins, Pieces
from omniload_dask.batching.balance.tables import RoundTables, fractions, rebin
from omniload_dask.batching.balance.whole import Round, nothing
from omniload_dask.plan.cost import CostFunction

__all__ = ["cut_round"]

CUT_PIECES = 3  # the heavy group's costliest pieces weighed for a cut
CUT_GRID = 7  # cut points weighed per piece and run
CUT_RUNS = 7  # runs (of 0 to 6 short pieces) a light micro-batch may give back for a tail
WEIGH_SOME_FROM = 256  # (pair, piece, run)s from which only those with cut points are weighed


def cut_round(
    p: Pieces, bins: Bins, load: np.ndarray, pairs: Pairs, cost: CostFunction,
    shared: RoundTables | None = None,
) -> Round:  # fmt: skip
    """One round of cuts (module doc): each pair's best cut's score and the commit, as
    :func:`~.whole.whole_round` returns them."""
    heavy, light = pairs.heavy, pairs.light
    none: Round = (np.full(len(heavy), np.inf), nothing)
    if pairs.probe_alone():
        tried, _ = cut_round(*probed(p, bins, load, pairs), cost)
        if not np.isfinite(tried).all():
            return none
    if shared is None:
        shared = RoundTables(p, bins, light, len(load))
    hc = shared.candidates(heavy, CUT_PIECES)
    h = np.maximum(hc, 0)
    # Every (pair, piece, run, cut point) at once: arrays of (P, CUT_PIECES, CUT_RUNS, GRID).
    n = p.length[h][..., None, None]
    dest = shared.roomiest[light[:, None], p.bucket[h]]
    y = np.maximum(dest, 0)[..., None]
    runs = shared.runs
    k = np.arange(CUT_RUNS)
    at = runs.first[y] + k - 1  # the run of the k shortest ends at order[at]
    has = (k == 0) | (at < runs.end[y])
    at = np.minimum(np.maximum(at, 0), len(runs.order) - 1)  # (np.clip: 3x the call cost)
    back_t = np.where(k > 0, runs.tokens[at] - runs.base_t[y], 0)[..., None]
    back_c = np.where(k > 0, runs.costs[at] - runs.base_c[y], 0.0)[..., None]
    room_y, room_h = bins.room[y][..., None], bins.room[p.bin[h]][..., None, None]
    # The tail x must fit the room the run frees, and the run the room the tail leaves.
    lo = np.maximum(1, back_t - room_h)
    hi = np.minimum(n - 1, back_t + room_y)
    ok = ((hc >= 0) & (dest >= 0))[..., None] & has & (lo <= hi)[..., 0]
    base_h = load[heavy][:, None] - (p.cost[h] - p.extra[h])  # (the extra stays with the head)
    x: np.ndarray | None = None  # (the whole grid's cut points, where it is weighed)
    if ok.size >= WEIGH_SOME_FROM:
        worst = _weigh_some(ok, lo, hi, n, back_c, base_h, load[light], cost)
    else:  # (a few cells: the whole grid costs fewer calls)
        x = lo + np.rint(fractions(CUT_GRID) * np.maximum(hi - lo, 0)).astype(np.int64)
        x = np.minimum(x, np.maximum(n - 1, 1))
        both = np.asarray(cost(np.concatenate([(n - x).ravel(), x.ravel()])), np.float64)
        kept, moved = both.reshape(2, *x.shape)
        new_h = base_h[..., None, None] + kept + back_c
        new_l = load[light][:, None, None, None] + moved - back_c
        worst = np.where(ok[..., None], np.maximum(new_h, new_l), np.inf)
    worst = worst.reshape(len(heavy), -1)
    flat = np.argmin(worst, axis=1)
    rows = np.arange(len(heavy))
    act = pairs.probed(worst[rows, flat] < load[heavy] * (1 - PROGRESS))
    if not np.count_nonzero(act):
        return none

    def commit(mask: np.ndarray) -> None:
        do = act & mask
        if not np.count_nonzero(do):
            return
        a, rest = np.divmod(flat[do], CUT_RUNS * CUT_GRID)
        kk, g = np.divmod(rest, CUT_GRID)
        r = rows[do]
        if x is not None:
            tail = x[r, a, kk, g]
        else:  # (its cut point, made as _weigh_some made it)
            cell = (r * h.shape[1] + a) * CUT_RUNS + kk
            tail = _points(lo.reshape(-1)[cell], hi.reshape(-1)[cell],
                           n.reshape(-1)[cell // CUT_RUNS], g)  # fmt: skip
        piece, to = h[r, a], y[r, a, 0]
        lo_run = runs.first[to]  # (every run's pieces at once, as whole.py commits them)
        run = (lo_run - kk.cumsum() + kk).repeat(kk) + np.arange(int(kk.sum()))
        p.bin[runs.order[run]] = p.bin[piece].repeat(kk)
        order = piece.argsort(kind="stable")  # (Pieces.cut takes its pieces ascending)
        piece, tail, to = piece[order], tail[order], to[order]
        parts = np.empty(2 * len(piece), np.int64)  # (head, tail) of each piece in turn
        parts[0::2] = p.length[piece] - tail
        parts[1::2] = tail
        index = p.cut(piece.repeat(2), parts, cost)
        p.bin[index[1::2]] = to
        rebin(p, bins)

    score = np.where(act, worst[rows, flat] - (load[heavy] + load[light]) / 2, np.inf)
    return score, commit


def _weigh_some(
    ok: np.ndarray, lo: np.ndarray, hi: np.ndarray, n: np.ndarray, back_c: np.ndarray,
    base_h: np.ndarray, load_light: np.ndarray, cost: CostFunction,
) -> np.ndarray:  # fmt: skip
    """The larger group cost after each cut point (inf: none) of the (pair, piece, run)s
    ``ok`` that have some (often a third of them), each weighed as on the whole grid, with
    the same operations in the same order: cut round's ``worst`` at a fraction of the
    cells."""
    at_ok = ok.reshape(-1).nonzero()[0]
    piece_of = at_ok // CUT_RUNS  # (its pair and piece)
    n_k = n.reshape(-1)[piece_of]
    back_c_k = back_c.reshape(-1)[at_ok][:, None]
    x = _points(lo.reshape(-1)[at_ok], hi.reshape(-1)[at_ok], n_k, slice(None))
    both = np.asarray(cost(np.concatenate([(n_k[:, None] - x).ravel(), x.ravel()])), np.float64)
    kept, moved = both.reshape(2, *x.shape)
    new_h = base_h.reshape(-1)[piece_of][:, None] + kept
    new_h += back_c_k
    new_l = load_light[at_ok // (ok.shape[1] * CUT_RUNS)][:, None] + moved
    new_l -= back_c_k
    worst = np.full((ok.size, CUT_GRID), np.inf)
    worst[at_ok] = np.maximum(new_h, new_l)
    return worst


def _points(lo: np.ndarray, hi: np.ndarray, n: np.ndarray, grid: slice | np.ndarray) -> np.ndarray:
    """The cut points ``grid`` (all: a row each) of tails from ``lo`` to ``hi`` tokens of
    pieces of ``n``: ``CUT_GRID`` spread over the range, at least 1 and at most ``n - 1``."""
    spread = fractions(CUT_GRID)[grid]
    if isinstance(grid, slice):
        x = lo[:, None] + np.rint(spread * np.maximum(hi - lo, 0)[:, None]).astype(np.int64)
        return np.minimum(x, np.maximum(n - 1, 1)[:, None])
    x = lo + np.rint(spread * np.maximum(hi - lo, 0)).astype(np.int64)
    return np.minimum(x, np.maximum(n - 1, 1))

"""Pass 3 of the balancer: even the heavy groups against the light ones, many pairs at once.

Each round pairs the heaviest groups with the lightest (the heaviest with the lightest, the
second with the second, ...) and, for every pair at once in numpy, finds the change whose cost
shift is nearest half the pair's gap: the move of one piece, the swap of two, or the exchange
of one piece for a run of the shortest pieces of one of the light group's micro-batches (when
both are full of tokens, only an exchange moves attention cost)::

    both groups full (no room for a move or a one-for-one swap), cost grows faster than L
    heavy: pieces of cost 40 (16 tokens) and 10     light: 4 pieces of cost 5 (4 tokens each)
    gap = 50 - 20 = 30; exchange the 40 for the 4 short pieces: shift 40 - 20 = 20
    loads 30, 40 -> the step costs 40 instead of 50

Every change keeps each micro-batch within its tokens and leaves no more of them empty. A
pair's groups are its own in a round, so the changes of a round never meet. The step time is
the heaviest group's: a round whose probe (a few of the pairs at the peak) finds no change, or
that does not lower the peak, ends the pass, so a step that cannot gain costs one probe. With
at most ``CUT_EXCHANGES_UP_TO`` groups and cutting allowed, an exchange may cut the last piece
of its run to fit exactly (cheap at that size; at thousands of groups it would cut a document
per group for a few ten-thousandths of efficiency).

Where cutting is allowed (``long_documents: split``) and a step is still below ``CUT_FROM``
(0.98) after that, cut rounds follow while it is below ``CUT_BELOW`` (0.99): per pair, the
better of an exchange whose run's last piece is cut to fit exactly, and the tail of one of the
heavy group's costliest pieces handed to the light group (which may give back a run of its
shortest pieces to make room), cut where the two come out most even; a cut is taken only where
it evens the pair clearly better than whole pieces; once a cut round finds whole pieces
better for no pair, the step's later rounds weigh only cuts (about half a cut round's time:
at DP 8 in the head-to-head's shape whole pieces win in about one cut round of seven). The
work is bounded: at most ``ROUNDS`` rounds of whole pieces and ``CUT_ROUNDS`` of cuts per step,
``SMALL_CUT_ROUNDS`` of cuts up to ``CUT_EXCHANGES_UP_TO`` groups. There a round costs about half
a millisecond, and the cuts it makes are what pass 5 (:mod:`.slide`) slides. On the head to
head's real corpus, 12 rounds instead of 8 bring the mean efficiency within 0.01 of the bound at
DP 8, 16 and 32 (0.9802 -> 0.9829, 0.9761 -> 0.9812, 0.9746 -> 0.9837), for 25-55 % more
planning time and about a third more cuts (BENCHMARKS.md, session 25).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from omniload_dask.batching.balance.pieces import Bins, Pieces
from omniload_dask.batching.balance.tables import RoundTables, Runs, fractions, rebin
from omniload_dask.batching.cost import CostFunction

__all__ = ["CUT_BELOW", "CUT_ROUNDS", "ROUNDS", "SMALL_CUT_ROUNDS", "STEPS_UP_TO", "refine_groups"]

TOLERANCE = 2e-3  # a group within 0.2% of the mean is even enough
ROUNDS = 8  # rounds of whole pieces per step ...
CUT_ROUNDS = 8  # ... and of cuts (most of them weigh cuts alone: see the module doc) ...
SMALL_CUT_ROUNDS = 12  # ... up to CUT_EXCHANGES_UP_TO groups
CANDIDATES = 8  # pieces of each group weighed for moves and swaps, spread over its costs ...
PAIR_BUDGET = 1 << 15  # ... or more, up to 32, while pairs x candidates^2 stays under this
PROGRESS = 1e-4  # a round must lower the heaviest group by this share, or refinement stops
CUT_FROM = 0.98  # a step below this efficiency with whole pieces gets pieces cut ...
CUT_BELOW = 0.99  # ... while it is below this
CUT_PIECES = 3  # the heavy group's costliest pieces weighed for a cut
CUT_GRID = 7  # cut points weighed per piece and run
CUT_RUNS = 7  # runs (of 0 to 6 short pieces) a light micro-batch may give back for a tail
PROBE_FROM = 8  # pairs from which a round first weighs this many of its heaviest ...
PROBE_ALONE_FROM = 32  # ... alone, before the round, from this many pairs (below: the round
# is cheap, and the probe's pairs are read from its scores: the same answer)
CUT_EXCHANGES_UP_TO = 64  # groups up to which whole-piece rounds may cut an exchange to fit
CUT_GAIN = 1e-3  # a cut must even a pair this share of its heavy group better than whole
WHOLE_IN_CUT_ROUNDS = "until_unused"  # whole pieces weighed in cut rounds: or "always"
STEPS_UP_TO = CUT_EXCHANGES_UP_TO  # groups up to which steps may be refined side by side


def refine_groups(p: Pieces, bins: Bins, groups: int, cost: CostFunction, cut: bool) -> None:
    """Pass 3 (module doc): changes ``p.bin`` (and, with ``cut``, cuts pieces) in place."""
    if groups < 2 or not len(p):
        return
    peak = np.inf
    changed = True  # (load is recomputed only after a round changed something)
    for _ in range(ROUNDS):
        load = np.bincount(bins.group[p.bin], p.cost, groups)
        changed = False
        if load.max() > peak * (1 - PROGRESS):
            break  # the last round did not lower the heaviest group: it sets the step time
        peak = float(load.max())
        pairs = _pairs(load, TOLERANCE)
        if pairs is None:
            break
        fit_by_cut = cut and groups <= CUT_EXCHANGES_UP_TO  # cheap there, and worth 0.003
        score, commit = _whole_round(p, bins, load, *pairs, cost if fit_by_cut else None)
        if not np.isfinite(score).any():
            break
        commit(np.isfinite(score))
        changed = True
    if changed:
        load = np.bincount(bins.group[p.bin], p.cost, groups)
    if not cut or load.mean() >= CUT_FROM * load.max():
        return
    peak = np.inf
    weigh_whole = True
    for _ in range(SMALL_CUT_ROUNDS if groups <= CUT_EXCHANGES_UP_TO else CUT_ROUNDS):
        load = np.bincount(bins.group[p.bin], p.cost, groups)
        if load.max() > peak * (1 - PROGRESS):
            break
        peak = float(load.max())
        pairs = _pairs(load, 1 - CUT_BELOW)
        if pairs is None:
            break
        heavy, light = pairs
        # Per pair, a cut only where it evens the pair clearly better than whole pieces do
        # (both weighed on the same tables of the step: nothing changes between them).
        shared = RoundTables(p, bins, light, groups)
        whole = np.full(len(heavy), np.inf)
        commit_whole: Callable[[np.ndarray], None] = _nothing
        if weigh_whole:
            whole, commit_whole = _whole_round(p, bins, load, heavy, light, cost, shared)
        by_cut_score, commit_cut = _cut_round(p, bins, load, heavy, light, cost, shared)
        by_cut = by_cut_score < whole - CUT_GAIN * load[heavy]
        by_whole = np.isfinite(whole) & ~by_cut
        if not (by_cut | by_whole).any():
            break
        commit_whole(by_whole)  # (pairs are disjoint: one's changes leave the others be)
        commit_cut(by_cut)
        # Once whole pieces even no pair better than a cut, the step's later rounds cut
        # (what is left to even is what whole pieces could not: half a round's time saved).
        weigh_whole = WHOLE_IN_CUT_ROUNDS == "always" or bool(by_whole.any())


def _pairs(load: np.ndarray, tolerance: float) -> tuple[np.ndarray, np.ndarray] | None:
    """(heavy, light) groups, paired heaviest with lightest: the groups more than
    ``tolerance`` of the peak above the mean, at most half of all groups."""
    count = int(pair_counts(load[None, :], tolerance)[0])
    if not count:
        return None
    order = (-load).argsort(kind="stable")
    return order[:count], order[::-1][:count]


def pair_counts(rows: np.ndarray, tolerance: float) -> np.ndarray:
    """Per row of group loads (steps x groups), the pairs :func:`_pairs` makes of it (0:
    none). A row's max, mean and sums are what the row alone gives, to the bit."""
    peak, mean = rows.max(axis=1), rows.sum(axis=1) / rows.shape[1]  # (= rows.mean(axis=1))
    above = ((rows - mean[:, None]) > (tolerance * peak)[:, None]).sum(axis=1)
    count = np.minimum(above, rows.shape[1] // 2)
    count[(peak <= 0) | (peak - mean <= tolerance * peak)] = 0
    return count


class StepPairs(NamedTuple):
    """The pairs of a round of several steps side by side (:mod:`.refine_steps`): the most
    pairs one step has, each pair's step, and each step's probe (:func:`_probe`: pair
    indices among all the round's pairs)."""

    per_step: int
    pair_step: np.ndarray
    probe: np.ndarray

    def probed(self, act: np.ndarray) -> np.ndarray:
        """``act`` without the pairs of steps whose probe found no change (as a step alone
        then gets nothing from the round)."""
        failed = self.pair_step[self.probe[~act[self.probe]]]
        return act & ~np.isin(self.pair_step, failed) if len(failed) else act


def _candidates(pairs: int) -> int:
    """Pieces of each group weighed for moves and swaps in a round of ``pairs`` pairs."""
    return int(min(max(math.sqrt(PAIR_BUDGET / pairs), CANDIDATES), 32))


def _probe(load: np.ndarray, heavy: np.ndarray) -> np.ndarray | None:
    """With many pairs: a few of the pairs whose heavy group is at the peak, to weigh first.
    The peak falls only if every such group gets lighter; if one of these cannot, the round
    (a few milliseconds at DP 1,024) is not worth running."""
    if len(heavy) <= PROBE_FROM:
        return None
    peak = float(load[heavy[0]])
    top = int((-load[heavy]).searchsorted(-peak * (1 - PROGRESS), side="right"))
    spread = np.linspace(0, max(top, 1) - 1, PROBE_FROM).round().astype(np.int64)
    return spread[np.append(True, spread[1:] != spread[:-1])]  # (ascending: np.unique's)


def _probed(
    p: Pieces, bins: Bins, load: np.ndarray, heavy: np.ndarray, light: np.ndarray
) -> tuple[Pieces, Bins, np.ndarray, np.ndarray, np.ndarray]:
    """The probe's pairs alone: their groups' pieces and bins (in their order, so every tie
    falls as it would among all groups), the groups numbered heavy first, then light. A
    round weighs only the pairs' own groups, so it scores them here as it would in the whole
    step, at the cost of these few groups instead of all of them.
    """
    members = np.concatenate([heavy, light])
    local = np.full(len(load), -1, np.int64)
    local[members] = np.arange(len(members))
    bin_group = local[bins.group]
    kept_bins = (bin_group >= 0).nonzero()[0]
    renumber = np.full(len(bins.room), -1, np.int64)
    renumber[kept_bins] = np.arange(len(kept_bins))
    piece_bin = renumber[p.bin]
    kept = (piece_bin >= 0).nonzero()[0]
    bucket = bins.bucket[kept_bins]  # (bins are by bucket: so are the kept ones)
    count = np.bincount(bucket, minlength=len(bins.offset) - 1)
    sub_bins = Bins(
        np.concatenate([[0], count.cumsum()]).astype(np.int64),
        bins.capacity[kept_bins],
        bins.room[kept_bins],
        bins.load[kept_bins],
        bucket,
        bin_group[kept_bins],
        bins.slot[kept_bins],
    )
    sub = Pieces(
        p.doc[kept], p.start[kept], p.length[kept], p.cost[kept], p.bucket[kept],
        p.extra[kept], piece_bin[kept],
    )  # fmt: skip
    pairs = len(heavy)
    return sub, sub_bins, load[members], np.arange(pairs), np.arange(pairs, 2 * pairs)


def _probe_first(probe: np.ndarray | None, pairs: int) -> bool:
    """Whether a round weighs its probe alone before it (many pairs: the round is dear), or
    reads the probe's pairs from its own scores (the same scores: see :func:`_probed`)."""
    return probe is not None and pairs >= PROBE_ALONE_FROM


def _whole_round(
    p: Pieces, bins: Bins, load: np.ndarray, heavy: np.ndarray, light: np.ndarray,
    cost: CostFunction | None = None, shared: RoundTables | None = None,
    steps: StepPairs | None = None,
) -> tuple[np.ndarray, Callable[[np.ndarray], None]]:  # fmt: skip
    """One round of moves, swaps and exchanges: the best for each pair. With ``cost``, an
    exchange may cut the last piece of its run. Returns each pair's score, its larger cost
    after the change less the mean of the two before (inf: nothing helps), and a function
    that makes the changes of the pairs of a mask.

    With many pairs, a few whose heavy groups are at the peak are weighed first
    (:func:`_probe`): alone where the round is dear, else in it (the same scores: up to
    ``PROBE_ALONE_FROM`` pairs the round weighs as many candidates as the probe alone).
    ``shared`` holds what a cut round's weighing reads too (made here if not given).
    ``steps``: the pairs are those of several steps side by side (:mod:`.refine_steps`):
    each pair is weighed as in its step alone, each step's probe judging its own pairs.
    """
    nothing = np.full(len(heavy), np.inf), _nothing
    probe = _probe(load, heavy) if steps is None else None
    if _probe_first(probe, len(heavy)):
        assert probe is not None
        tried, _ = _whole_round(*_probed(p, bins, load, heavy[probe], light[probe]), cost)
        if not np.isfinite(tried).all():
            return nothing
    groups = len(load)
    if shared is None:
        shared = RoundTables(p, bins, light, groups)
    roomiest, every = shared.roomiest, shared.every
    gap = load[heavy] - load[light]
    per_bin = np.bincount(p.bin, minlength=len(bins.room))
    k = _candidates(len(heavy) if steps is None else steps.per_step)
    both = shared.candidates(np.concatenate([heavy, light]), k)
    hc, lc = both[: len(heavy)], both[len(heavy) :]  # (P, K) each
    P, K = hc.shape
    h = np.maximum(hc, 0)
    q = np.maximum(lc, 0)
    h_len, h_cost, h_bucket, h_bin = p.length[h], p.cost[h], p.bucket[h], p.bin[h]
    q_len, q_cost, q_bin = p.length[q], p.cost[q], p.bin[q]
    h_room = bins.room[h_bin]
    # Swaps, (P, K, K): same bucket, both micro-batches keep within their tokens.
    ok = (hc >= 0)[:, :, None] & (lc >= 0)[:, None, :]
    ok &= h_bucket[:, :, None] == p.bucket[q][:, None, :]
    ok &= (h_room + h_len)[:, :, None] >= q_len[:, None, :]
    ok &= (bins.room[q_bin] + q_len)[:, None, :] >= h_len[:, :, None]
    delta = h_cost[:, :, None] - q_cost[:, None, :]
    ok &= (delta > 0) & (delta < gap[:, None, None])
    swap_score = np.where(ok, np.abs(gap[:, None, None] / 2 - delta), np.inf).reshape(P, -1)
    # Moves, (P, K): into the light group's micro-batch of that bucket with the most room;
    # one that empties its micro-batch only into an empty one (no more stay empty).
    dest = roomiest[light[:, None], h_bucket]
    fills = per_bin[np.maximum(dest, 0)] == 0
    move_ok = (hc >= 0) & (dest >= 0) & ((per_bin[h_bin] > 1) | fills)
    move_ok &= bins.room[np.maximum(dest, 0)] >= h_len
    move_ok &= h_cost < gap[:, None]
    move_score = np.where(move_ok, np.abs(gap[:, None] / 2 - h_cost), np.inf)
    runs = shared.runs
    ex = _exchanges(p, bins, runs, light, every, hc, (load[heavy], load[light]), cost)
    best = np.stack([swap_score.min(axis=1), move_score.min(axis=1), ex[0]], axis=1)
    kind = np.argmin(best, axis=1)
    score = best[np.arange(P), kind]
    # A change must lower the heavy group by PROGRESS of its cost (the score is the new
    # larger cost less the pair's mean, which is half the gap below the heavy group).
    act = score < (gap / 2) - PROGRESS * load[heavy]
    if steps is not None:
        act = steps.probed(act)
    score = np.where(act, score, np.inf)
    if not act.any() or (probe is not None and not act[probe].all()):
        return nothing

    def commit(mask: np.ndarray) -> None:
        do = act & mask
        if not do.any():
            return
        new_bin = p.bin.copy()
        sel = do & (kind == 0)
        if sel.any():
            flat = np.argmin(swap_score[sel], axis=1)
            a, c = flat // K, flat % K
            hp, qp = hc[sel, a], lc[sel, c]
            new_bin[hp], new_bin[qp] = p.bin[qp], p.bin[hp]
        sel = do & (kind == 1)
        if sel.any():
            a = np.argmin(move_score[sel], axis=1)
            new_bin[hc[sel, a]] = dest[sel, a]
        sel = do & (kind == 2)
        cut_last = cut_tail = cut_to = np.zeros(0, np.int64)
        if sel.any():
            _, piece, target, run_lo, run_hi, tail = ex
            order = runs.order
            new_bin[piece[sel]] = target[sel]
            counts = run_hi[sel] - run_lo[sel]
            taken = (run_lo[sel] - counts.cumsum() + counts).repeat(counts)
            taken += np.arange(int(counts.sum()))
            new_bin[order[taken]] = p.bin[piece[sel]].repeat(counts)
            cutting = tail[sel] > 0  # the run's last piece stays, less its tail
            cut_last = order[run_hi[sel][cutting] - 1]
            cut_tail, cut_to = tail[sel][cutting], p.bin[piece[sel]][cutting]
            new_bin[cut_last] = target[sel][cutting]
        p.bin = new_bin
        if len(cut_last) and cost is not None:
            by_piece = cut_last.argsort()
            cut_last, cut_tail, cut_to = cut_last[by_piece], cut_tail[by_piece], cut_to[by_piece]
            parts = np.stack([p.length[cut_last] - cut_tail, cut_tail], axis=1).ravel()
            index = p.cut(cut_last.repeat(2), parts, cost)
            p.bin[index[1::2]] = cut_to
        rebin(p, bins)

    return score, commit


def _nothing(mask: np.ndarray) -> None:
    """The commit of a round that found nothing."""


def _exchanges(
    p: Pieces, bins: Bins, runs: Runs, light: np.ndarray, every: np.ndarray,
    hc: np.ndarray, loads: tuple[np.ndarray, np.ndarray], cost: CostFunction | None,
) -> tuple[np.ndarray, ...]:  # fmt: skip
    """Per pair, the best exchange of a heavy candidate for a run of the shortest pieces of
    one of the light group's micro-batches of its bucket. With ``cost`` (cutting allowed), the
    run's last piece may be cut so that the heavy micro-batch takes back just what it has
    room for (``tail`` tokens of that piece; 0: no cut).

    Returns ``(score, piece, target bin, run start, run stop, tail)``: the run is
    ``runs.order[run start:run stop]``; the score is the pair's larger cost after the
    exchange less the mean of the two before.
    """
    P = len(hc)
    load_h, load_l = (x[:, None, None] for x in loads)
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
    score = np.where(valid, worst - (load_h + load_l) / 2, np.inf).reshape(P, -1)
    flat = np.argmin(score, axis=1)
    rows = np.arange(P)
    a, m = np.divmod(flat, target.shape[2])
    yb = y[rows, a, m]
    return (score[rows, flat], h[rows, a], yb, runs.first[yb], at[rows, a, m] + 1, tail[rows, a, m])


def _cut_round(
    p: Pieces, bins: Bins, load: np.ndarray, heavy: np.ndarray, light: np.ndarray,
    cost: CostFunction, shared: RoundTables | None = None, steps: StepPairs | None = None,
) -> tuple[np.ndarray, Callable[[np.ndarray], None]]:  # fmt: skip
    """Each heavy group hands the tail of one of its costliest pieces to the light group's
    micro-batch of that bucket with the most room, cut where the pair comes out most even;
    that micro-batch may give back a run of its k shortest pieces (k < ``CUT_RUNS``) to make
    room, the tail then being about as long as the run. Returns the best cut's score for
    each pair and its commit, as :func:`_whole_round` does (``steps`` too)."""
    nothing = np.full(len(heavy), np.inf), _nothing
    probe = _probe(load, heavy) if steps is None else None
    if _probe_first(probe, len(heavy)):
        assert probe is not None
        tried, _ = _cut_round(*_probed(p, bins, load, heavy[probe], light[probe]), cost)
        if not np.isfinite(tried).all():
            return nothing
    groups = len(load)
    if shared is None:
        shared = RoundTables(p, bins, light, groups)
    roomiest = shared.roomiest
    hc = shared.candidates(heavy, CUT_PIECES)
    h = np.maximum(hc, 0)
    n = p.length[h][..., None, None]  # (pairs, pieces, 1, 1): runs, cut points last
    dest = roomiest[light[:, None], p.bucket[h]]
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
    ok = ((hc >= 0) & (dest >= 0))[..., None, None] & has[..., None] & (lo <= hi)
    x = lo + np.rint(fractions(CUT_GRID) * np.maximum(hi - lo, 0)).astype(np.int64)
    x = np.minimum(x, np.maximum(n - 1, 1))
    both = np.asarray(cost(np.concatenate([(n - x).ravel(), x.ravel()])), np.float64)
    kept, moved = both.reshape(2, *x.shape)
    c_h = (p.cost[h] - p.extra[h])[..., None, None]
    new_h = load[heavy][:, None, None, None] - c_h + kept + back_c
    new_l = load[light][:, None, None, None] + moved - back_c
    worst = np.where(ok, np.maximum(new_h, new_l), np.inf).reshape(len(heavy), -1)
    flat = np.argmin(worst, axis=1)
    rows = np.arange(len(heavy))
    act = worst[rows, flat] < load[heavy] * (1 - PROGRESS)
    if steps is not None:
        act = steps.probed(act)
    score = np.where(act, worst[rows, flat] - (load[heavy] + load[light]) / 2, np.inf)
    if not act.any() or (probe is not None and not act[probe].all()):
        return nothing

    def commit(mask: np.ndarray) -> None:
        do = act & mask
        if not do.any():
            return
        a, rest = np.divmod(flat[do], CUT_RUNS * CUT_GRID)
        kk, g = np.divmod(rest, CUT_GRID)
        r = rows[do]
        piece, tail, to = h[r, a], x[r, a, kk, g], y[r, a, 0]
        lo_run = runs.first[to]
        run = (lo_run - kk.cumsum() + kk).repeat(kk) + np.arange(int(kk.sum()))
        p.bin[runs.order[run]] = p.bin[piece].repeat(kk)
        order = piece.argsort(kind="stable")
        piece, tail, to = piece[order], tail[order], to[order]
        parts = np.stack([p.length[piece] - tail, tail], axis=1).ravel()
        index = p.cut(piece.repeat(2), parts, cost)
        p.bin[index[1::2]] = to
        rebin(p, bins)

    return score, commit

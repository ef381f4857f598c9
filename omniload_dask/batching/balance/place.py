"""Pass 2 of the balancer: pieces into micro-batches, largest cost first, in numpy rounds.

Pieces go by decreasing cost (LPT) in rounds: a round gives the next pieces, one each, to the
groups in increasing order of load, each into the group's cheapest micro-batch with room; as
exact LPT would, a round stops before a group that is heavier than a lighter one will be with
its piece (but never before a quarter of the groups have one). A piece that does not fit its
group tries the groups of the round that got nothing. What no round can place fills the room
left: by decreasing room, each micro-batch takes the longest piece left that fits (best fit);
what fits no micro-batch whole is poured into those with the most room, cut where one is full
(or, when cutting is not allowed, :func:`pack` names the bucket that needs one more
micro-batch per group)::

    2 groups x 1 micro-batch of 8 tokens, cost = L, pieces 6, 5, 3, 2
    round 1: 6 -> g0, 5 -> g1           round 2: 3 -> g1 (5), then 2 -> g0 (6 < 5 + 3)
    loads 8, 8; with pieces 6, 6, 4 instead: 4 fits neither whole -> cut 2 + 2

A bucket with ``DEAL_FROM`` or more micro-batches per group is packed micro-batches first (the
same rounds over all its micro-batches, as if each were a group), then dealt to the groups,
``micro_batches`` rounds: each round gives its micro-batches, costliest first, to the groups in
increasing order of load. Rounds cost a sort of the open groups (or micro-batches) each, and a
step takes about as many as a group (or micro-batch) gets pieces, whatever the DP size.
"""

from __future__ import annotations

import numpy as np

from omniload_dask.batching.balance.pieces import Bins, Pieces, by_cost
from omniload_dask.batching.cost import CostFunction
from omniload_dask.batching.sorting import stable_order, stable_order_of_floats

__all__ = ["DEAL_FROM", "MIN_ROUND", "fill_room", "pack"]

DEAL_FROM = 8  # micro-batches per group from which a bucket is packed bins first, then dealt
MIN_ROUND = 0.25  # the shortest round of LPT over groups, as a share of the groups


def _rounds(p: Pieces, bins: Bins, queue: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """LPT in rounds of the pieces ``queue`` (by decreasing cost) into bins ``lo:hi``; returns
    the pieces that fit no bin of their round (still by decreasing cost)."""
    length, room, load = p.length, bins.room, bins.load
    while len(queue):
        open_ = lo + (room[lo:hi] >= length[queue].min()).nonzero()[0]
        if not len(open_):
            break
        k = min(len(open_), len(queue))
        target = open_[load[open_].argsort(kind="stable")][:k]  # the least loaded bins
        head = queue[:k]
        fits = length[head] <= room[target]
        bins.put(p, head[fits], target[fits])
        if fits.all():
            queue = queue[k:]
            continue
        # Misses try the bins of the round that got nothing, by decreasing room.
        miss, free = head[~fits], target[~fits]
        free = free[np.lexsort((free, -room[free]))]
        ok = length[miss] <= room[free]
        bins.put(p, miss[ok], free[ok])
        if not (fits.any() or ok.any()):
            break
        queue = np.concatenate([miss[~ok], queue[k:]])  # still by decreasing cost
    return queue


def _best_fit(p: Pieces, bins: Bins, waiting: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Fill the bins' room with the waiting pieces, in rounds: by decreasing room, each bin
    takes the longest piece left that fits it; returns the pieces that fit no bin whole."""
    length, room = p.length, bins.room
    waiting = waiting[np.lexsort((waiting, -length[waiting]))]
    sizes = -length[waiting]  # ascending (and so they stay as pieces are taken out)
    while len(waiting):
        open_ = lo + (room[lo:hi] >= -sizes[-1]).nonzero()[0]
        if not len(open_):
            break
        open_ = open_[(-room[open_]).argsort(kind="stable")]
        # The first piece that fits each bin; bin i takes the first not taken by bins before
        # it: a(i) = max(fits(i), a(i - 1) + 1) = i + running max of (fits(i') - i').
        fits = sizes.searchsorted(-room[open_], side="left")
        rank = np.arange(len(open_))
        take = rank + np.maximum.accumulate(fits - rank)
        ok = take < len(waiting)
        if not ok.any():
            break
        bins.put(p, waiting[take[ok]], open_[ok])
        keep = np.ones(len(waiting), dtype=bool)
        keep[take[ok]] = False
        waiting, sizes = waiting[keep], sizes[keep]
    return waiting


def _pour(p: Pieces, bins: Bins, left: np.ndarray, lo: int, hi: int, cost: CostFunction) -> None:
    """Cut the pieces ``left`` into the bins with the most room (a step's tokens always fit:
    ``balance()`` sizes the buckets for them), fewest bins first."""
    left = np.sort(left)
    open_ = lo + (bins.room[lo:hi] > 0).nonzero()[0]
    open_ = open_[(-bins.room[open_]).argsort(kind="stable")]
    bin_end = bins.room[open_].cumsum()
    piece_end = p.length[left].cumsum()
    total = int(piece_end[-1])
    # np.union1d of two ascending arrays: one vectorised sort, then the repeats dropped
    bounds = np.sort(np.concatenate([bin_end[bin_end < total], piece_end]))
    bounds = bounds[np.append(True, bounds[1:] != bounds[:-1])]
    starts = np.concatenate([[0], bounds[:-1]])
    owner = left[piece_end.searchsorted(starts, side="right")]
    where = open_[bin_end.searchsorted(starts, side="right")]
    bins.add(p, p.cut(owner, bounds - starts, cost), where)


def _group_rounds(
    p: Pieces, bins: Bins, queue: np.ndarray, lo: int, micro: int, load: np.ndarray
) -> np.ndarray:
    """LPT in rounds over groups: the next pieces, one per group, to the open groups in
    increasing order of ``load``, each into its cheapest micro-batch with room (bins
    ``lo + slot * groups + group``); returns the pieces that fit no group of their round, by
    decreasing cost."""
    groups = len(load)
    length = p.length
    # Views, slot-major, so that reductions over a group's micro-batches run along axis 0.
    room = bins.room[lo : lo + groups * micro].reshape(micro, groups)
    cost = bins.load[lo : lo + groups * micro].reshape(micro, groups)
    ordered = length[queue]
    if (ordered[1:] <= ordered[:-1]).all():  # by decreasing length: the last is the shortest
        least = np.broadcast_to(ordered[-1:], ordered.shape)
    else:
        least = np.minimum.accumulate(ordered[::-1])[::-1]  # shortest piece from i on
    pos, waiting = 0, queue[:0]  # pieces queue[pos:], after the misses ``waiting``

    def place(piece: np.ndarray, target: np.ndarray, c: np.ndarray) -> np.ndarray:
        """Each piece (of costs ``c``) into its target group's cheapest micro-batch with
        room (the lowest slot on a tie); returns which had one."""
        n = length[piece]
        if micro == 1:
            ok = room[0, target] >= n
            where = lo + target
        elif micro == 2:  # (as below, in fewer passes)
            fit = np.take(room, target, axis=1) >= n
            load_of = np.take(cost, target, axis=1)
            second = fit[1] & (~fit[0] | (load_of[1] < load_of[0]))
            ok = fit[0] | fit[1]
            where = target + np.where(second, lo + groups, lo)
        else:
            fit = np.take(room, target, axis=1) >= n
            masked = np.where(fit, np.take(cost, target, axis=1), np.inf)
            m = np.zeros(len(piece), dtype=np.int64)
            best = masked[0]
            for j in range(1, micro):  # the cheapest micro-batch with room (lowest slot first)
                better = masked[j] < best
                m[better] = j
                best = np.minimum(best, masked[j])
            ok = np.isfinite(best)
            where = lo + m * groups + target
        if not ok.all():
            at = ok.nonzero()[0]  # (one pass over the mask, then takes)
            piece, target, where, c, n = piece[at], target[at], where[at], c[at], n[at]
        p.bin[piece] = where  # (Bins.put, with the gathers made once)
        bins.room[where] -= n
        bins.load[where] += c
        load[target] += c
        return ok

    while pos < len(queue) or len(waiting):
        shortest = least[pos] if pos < len(queue) else np.iinfo(np.int64).max
        if len(waiting):
            shortest = min(shortest, int(length[waiting].min()))
        if micro <= 2:  # (one pass: cheaper than a reduction over the axis)
            most = room[0].copy() if micro == 1 else np.maximum(room[0], room[1])
        else:
            most = room.max(axis=0)
        if most.min() >= shortest:  # every group open
            target = stable_order_of_floats(load)  # the least loaded groups
        else:
            open_ = (most >= shortest).nonzero()[0]
            if not len(open_):
                break
            target = open_[stable_order_of_floats(load[open_])]
        k = min(len(target), len(waiting) + len(queue) - pos)
        target = target[:k]
        if len(waiting):
            head = np.concatenate([waiting, queue[pos : pos + max(0, k - len(waiting))]])[:k]
        else:
            head = queue[pos : pos + k]
        # As exact LPT would: piece j goes to the j-th lightest group only while that group
        # is no heavier than the lighter ones will be with their pieces (rounds of at least
        # a quarter of the groups, which stays within a small piece of exact LPT).
        before = load[target]
        head_cost = p.cost[head]
        after = np.minimum.accumulate(before + head_cost)
        late = (before[1:] > after[:-1]).nonzero()[0]
        if len(late) and late[0] + 1 >= MIN_ROUND * groups:
            k = int(late[0]) + 1
            target, head, head_cost = target[:k], head[:k], head_cost[:k]
        taken = max(0, k - len(waiting))  # from queue[pos:]
        rest = waiting[k:]
        pos += taken
        ok = place(head, target, head_cost)
        if ok.all():
            waiting = rest
            continue
        # Misses try the groups of the round that got nothing, by decreasing room (their
        # rooms are as the round found them: none of them got a piece), unless even the
        # shortest miss fits none of them, as is usual once the groups fill up.
        bad = (~ok).nonzero()[0]
        miss, free = head[bad], target[bad]
        if int(length[miss].min()) <= int(most[free].max()):
            room_free = most[free]  # (by decreasing room: a radix sort of 16-bit rooms)
            free = free[stable_order(int(room_free.max()) - room_free)]
            again = place(miss, free, head_cost[bad])
            miss = miss[~again]
            ok[bad] = again
        waiting = np.concatenate([miss, rest])  # still by decreasing cost
        if not ok.any():
            break
    return np.concatenate([waiting, queue[pos:]])


def pack(p: Pieces, bins: Bins, groups: int, cost: CostFunction, cut: bool) -> int | None:
    """Put every piece into a micro-batch of its bucket and give every micro-batch to a group
    (module doc); returns None, or (only when ``cut`` is False) the bucket whose pieces cannot
    all be packed whole."""
    load = np.zeros(groups)
    nb = len(bins.offset) - 1
    peak = [float(p.cost[p.bucket == b].max(initial=0.0)) for b in range(nb)] if nb > 1 else [0]
    for b in sorted(range(nb), key=lambda b: (-peak[b], b)):  # costliest pieces first
        lo, hi = int(bins.offset[b]), int(bins.offset[b + 1])
        micro = (hi - lo) // groups
        mine = (p.bucket == b).nonzero()[0] if nb > 1 else np.arange(len(p))
        if not len(mine):
            continue
        queue = by_cost(p, mine)
        by_bins = micro >= DEAL_FROM
        if by_bins:
            left = _rounds(p, bins, queue, lo, hi)
        else:
            left = _group_rounds(p, bins, queue, lo, micro, load)
        if not fill_room(p, bins, left, lo, hi, cost, cut):
            return b
        if by_bins:
            _deal(bins, lo, hi, micro, load)
        else:
            load[:] = np.bincount(bins.group, bins.load, groups)
    return None


def fill_room(
    p: Pieces, bins: Bins, left: np.ndarray, lo: int, hi: int, cost: CostFunction, cut: bool
) -> bool:
    """What the rounds left (``left``) into the room of bins ``lo:hi``: best fit, then cut
    where they must be (module doc); False when a piece fits no bin whole and ``cut`` is
    False (nothing is cut then)."""
    if len(left):
        left = _best_fit(p, bins, left, lo, hi)
    if len(left):
        if not cut:
            return False
        _pour(p, bins, left, lo, hi, cost)
    return True


def _deal(bins: Bins, lo: int, hi: int, micro: int, load: np.ndarray) -> None:
    """Give every group ``micro`` of the bins ``lo:hi``, in rounds (module doc)."""
    groups = len(load)
    ids = np.arange(lo, hi)
    ids = ids[(-bins.load[ids]).argsort(kind="stable")]
    for r in range(micro):
        chunk = ids[r * groups : (r + 1) * groups]
        lightest = load.argsort(kind="stable")
        bins.group[chunk] = lightest
        bins.slot[chunk] = r
        load[lightest] += bins.load[chunk]

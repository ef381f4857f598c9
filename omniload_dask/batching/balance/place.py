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

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from omniload_dask.batching.assignment import Assignment
from omniload_dask.batching.balance.pieces import Bins, Pieces, by_cost
from omniload_dask.batching.balance.room import fill_rooms
from omniload_dask.batching.balance.rounds import group_rounds
from omniload_dask.batching.balance.routing import Bucket, StepPieces
from omniload_dask.plan.cost import CostFunction

__all__ = ["DEAL_FROM", "Placed", "fill_room", "pack", "place_steps"]

DEAL_FROM = 8  # micro-batches per group from which a bucket is packed bins first, then dealt


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
        if not np.count_nonzero(ok):
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
            left = group_rounds([p], [bins], [queue], groups, micro, lo, load)[0]
        if not fill_room(p, bins, left, lo, hi, cost, cut):
            if cut or not _fit_decreasing(p, bins, mine, lo, hi):
                return b
            by_bins = True  # packed bins first: they are dealt to the groups now
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


def _fit_decreasing(p: Pieces, bins: Bins, mine: np.ndarray, lo: int, hi: int) -> bool:
    """Where the rounds by cost leave whole pieces that fit nowhere: the bucket's pieces
    ``mine`` packed again by length alone, best fit decreasing (longest first, each into the
    bin with the least room that holds it; ties: the lower bin), the step's first ``p.head``
    documents (at least its first) before the others. True when every piece fits; else the
    bins are as the rounds left them. That is the order in which a pooled draw
    (``batch.pack_pool``, :func:`omniload_dask.core.pool.pack_window`) chose the step's
    documents, so its steps always fit; others get one more micro-batch only where even this
    fails."""
    length, doc = p.length, p.doc[mine]
    rooms = sorted((int(bins.capacity[b]), b) for b in range(lo, hi))
    where = np.empty(len(mine), dtype=np.int64)
    for k in np.lexsort((doc, -length[mine], doc >= max(p.head, 1))).tolist():
        n = int(length[mine[k]])
        at = bisect.bisect_left(rooms, (n, -1))
        if at == len(rooms):
            return False
        room, b = rooms.pop(at)
        bisect.insort(rooms, (room - n, b))
        where[k] = b
    bins.room[lo:hi] = bins.capacity[lo:hi]
    bins.load[lo:hi] = 0.0
    bins.add(p, mine, where)
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


@dataclass
class Placed:
    """A step after passes 1 and 2: its pieces in their bins, and what its split reports."""

    pieces: Pieces
    bins: Bins
    micro: np.ndarray  # micro-batches per group of each bucket
    spilled: int
    bound: float

    def assignment(self, buckets: Sequence[Bucket], groups: int) -> Assignment:
        """The step's split, as the balancer returns it."""
        pieces, bins, micro = self.pieces, self.bins, self.micro
        seq = np.asarray([b.seq_len for b in buckets], dtype=np.int64)
        offsets = np.concatenate([[0], micro.cumsum()])
        return Assignment(
            doc=pieces.doc,
            start=pieces.start,
            length=pieces.length,
            cost=pieces.cost,
            group=bins.group[pieces.bin],
            micro=offsets[pieces.bucket] + bins.slot[pieces.bin],
            micro_capacity=seq.repeat(micro),
            micro_bucket=np.arange(len(buckets)).repeat(micro),
            groups=groups,
            cuts=pieces.cuts,
            spilled=self.spilled,
            bound=self.bound,
        )


def place_steps(
    routed: Sequence[StepPieces], buckets: Sequence[Bucket], groups: int, cost: CostFunction,
    cut: bool, together: bool,
) -> list[Placed]:  # fmt: skip
    """Pass 2 of several steps: with ``together`` (one bucket, cuts allowed), the rounds over
    groups of the steps of as many micro-batches (fewer than ``DEAL_FROM``) side by side
    (:mod:`.rounds`), then each step's best fit; the other steps one by one (:func:`pack`).
    Every step's placements are those it gets alone."""
    placed: list[Placed | None] = [None] * len(routed)
    kinds: dict[int, list[int]] = {}
    for i, one in enumerate(routed):
        if together and cut and len(one.pieces) and int(one.micro[0]) < DEAL_FROM:
            kinds.setdefault(int(one.micro[0]), []).append(i)
    seq = np.asarray([buckets[0].seq_len], dtype=np.int64)
    for micro, kind in kinds.items():
        if len(kind) < 2:
            continue
        pieces = [routed[i].pieces for i in kind]
        bins = [Bins.new(seq, routed[i].micro, groups) for i in kind]
        queues = [by_cost(p, np.arange(len(p))) for p in pieces]
        lefts = group_rounds(pieces, bins, queues, groups, micro)
        fill_rooms(pieces, bins, lefts, groups, cost)  # (fill_room of each, side by side)
        for i, b in zip(kind, bins, strict=True):
            placed[i] = _placed(routed[i], b)
    return [
        one if one is not None else _pack_alone(routed[i], buckets, groups, cost, cut)
        for i, one in enumerate(placed)
    ]


def _placed(step: StepPieces, bins: Bins) -> Placed:
    return Placed(step.pieces, bins, step.micro, step.spilled, step.bound)


def _pack_alone(
    step: StepPieces, buckets: Sequence[Bucket], groups: int, cost: CostFunction, cut: bool
) -> Placed:
    """Pass 2 of one step; where its pieces cannot be packed whole (and may not be cut), its
    bucket gets one more micro-batch per group and it is packed again."""
    seq = np.asarray([b.seq_len for b in buckets], dtype=np.int64)
    pieces, micro = step.pieces, step.micro
    while True:
        bins = Bins.new(seq, micro, groups)
        pieces.bin[:] = -1
        stuck = pack(pieces, bins, groups, cost, cut)
        if stuck is None:
            return _placed(step, bins)
        micro[stuck] += 1

"""Pass 2 of the balancer: place pieces into the groups' micro-batches, largest cost first.

Pieces go by decreasing cost (LPT) to the least loaded group that has a micro-batch with room
for them, into that group's cheapest such micro-batch (which also evens the micro-batches of a
rank, what pipeline parallelism waits on). A piece that fits no micro-batch whole is cut into
the micro-batches with the most room (or, when cutting is not allowed, :func:`place` names the
bucket that needs one more micro-batch per group)::

    2 groups, 1 micro-batch of 8 tokens each, cost = L, pieces 6, 5, 3, 2
    6 -> g0 (load 0)    5 -> g1 (0)    3 -> g1 (5 < 6)    2 -> g0 (6 < 8)
    loads 8, 8; with pieces 6, 6, 4 instead: 4 fits neither whole -> cut 2 + 2

With ``redo`` it packs the pieces of some groups again, each in its own group: what the
refinement (:mod:`.refine`) changed.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from omniload_dask.batching.cost import CostFunction

__all__ = ["Pieces", "place"]


@dataclass
class Pieces:
    """A step's pieces while they are placed; cutting a piece adds its continuations."""

    doc: np.ndarray
    start: np.ndarray
    length: np.ndarray
    cost: np.ndarray
    bucket: np.ndarray
    group: np.ndarray
    micro: np.ndarray
    cuts: int = 0
    extra: np.ndarray | None = None  # per piece: cost beyond cost(length) (image encoder)

    def __post_init__(self) -> None:
        self._more: list[tuple[int, int, int, float, int, int]] = []  # appended at flush()

    @classmethod
    def new(
        cls, doc: np.ndarray, start: np.ndarray, length: np.ndarray, cost: np.ndarray,
        bucket: np.ndarray, extra: np.ndarray | None = None,
    ) -> Pieces:  # fmt: skip
        """Pieces not placed yet (group and micro-batch 0 until :func:`place` sets them)."""
        n = len(doc)
        zeros = np.zeros(n, np.int64)
        return cls(doc, start, length, cost, bucket, zeros, zeros.copy(), extra=extra)

    def cut(self, i: int, chunks: list[tuple[int, int, int]], cost: CostFunction) -> list[float]:
        """Piece i becomes ``chunks`` of (group, micro-batch, tokens); returns their costs."""
        costs = np.asarray(cost(np.asarray([n for _, _, n in chunks])), dtype=np.float64).tolist()
        if self.extra is not None:
            costs[0] += float(self.extra[i])  # the images stay with the first chunk
        g, m, n = chunks[0]
        self.group[i], self.micro[i], self.length[i], self.cost[i] = g, m, n, costs[0]
        offset = int(self.start[i]) + n
        for (g, m, n), c in zip(chunks[1:], costs[1:], strict=True):
            self._more.append((i, offset, n, c, g, m))
            offset += n
        self.cuts += 1
        return costs

    def flush(self) -> None:
        """Append the continuations of cut pieces."""
        if not self._more:
            return
        src, start, length, cost, group, micro = (
            np.asarray(c) for c in zip(*self._more, strict=True)
        )
        self.doc = np.concatenate([self.doc, self.doc[src]])
        self.bucket = np.concatenate([self.bucket, self.bucket[src]])
        self.start = np.concatenate([self.start, start.astype(np.int64)])
        self.length = np.concatenate([self.length, length.astype(np.int64)])
        self.cost = np.concatenate([self.cost, cost.astype(np.float64)])
        self.group = np.concatenate([self.group, group.astype(np.int64)])
        self.micro = np.concatenate([self.micro, micro.astype(np.int64)])
        if self.extra is not None:
            self.extra = np.concatenate([self.extra, np.zeros(len(src))])
        self._more = []


class _Bins:
    """Room and cost of every (bucket, group, micro-batch), as lists for a fast Python loop.

    ``occupied`` (a mask of pieces) starts the bins with those pieces already in them. Per
    group, the largest and the total room of each bucket are mirrored in numpy arrays, so the
    rarer searches across groups are one masked argmin.
    """

    def __init__(
        self, seq: np.ndarray, micro: np.ndarray, groups: int, p: Pieces,
        occupied: np.ndarray | None = None,
    ) -> None:  # fmt: skip
        self.room: list[list[list[int]]] = []
        self.cost: list[list[list[float]]] = []
        self.most: list[np.ndarray] = []  # per bucket: each group's largest room (numpy)
        self.most_list: list[list[int]] = []  # the same as lists, read in the hot loop
        self.total: list[list[int]] = []  # per bucket: each group's room in all
        for b, (s, m) in enumerate(zip(seq.tolist(), micro.tolist(), strict=True)):
            tokens = np.zeros(groups * m, dtype=np.int64)
            costs = np.zeros(groups * m)
            if occupied is not None:
                here = occupied & (p.bucket == b)
                cell = p.group[here] * m + p.micro[here]
                tokens = np.bincount(cell, p.length[here], groups * m).astype(np.int64)
                costs = np.bincount(cell, p.cost[here], groups * m)
            room = (s - tokens).reshape(groups, m)
            self.room.append(room.tolist())
            self.cost.append(costs.reshape(groups, m).tolist())
            self.most.append(room.max(axis=1))
            self.most_list.append(self.most[-1].tolist())
            self.total.append(room.sum(axis=1).tolist())

    def pick(self, b: int, g: int, size: int) -> int:
        """The cheapest micro-batch of group g (bucket b) with room for ``size``, or -1."""
        room, cost = self.room[b][g], self.cost[b][g]
        best = -1
        for m, r in enumerate(room):
            if r >= size and (best < 0 or cost[m] < cost[best]):
                best = m
        return best

    def add(self, b: int, g: int, m: int, size: int, cost: float) -> None:
        """Put ``size`` tokens of ``cost`` into micro-batch m of group g (bucket b)."""
        room = self.room[b][g]
        room[m] -= size
        self.cost[b][g][m] += cost
        self.total[b][g] -= size
        most = max(room)
        if most != self.most_list[b][g]:
            self.most_list[b][g] = most
            self.most[b][g] = most

    def cut_plan(
        self, b: int, size: int, load: np.ndarray, prefer: int
    ) -> list[tuple[int, int, int]]:
        """Where the pieces of a cut go: group ``prefer`` if it has room for all of it, else
        the least loaded group that has, else the micro-batches with the most room anywhere
        (a step's tokens always fit: ``balance()`` sizes the buckets for them)."""
        total = self.total[b]
        if prefer >= 0 and total[prefer] >= size:
            groups = [prefer]
        else:
            g = _least(load, np.asarray(total) >= size)
            groups = [g] if g >= 0 else list(range(len(total)))
        cells = sorted((-r, g, m) for g in groups for m, r in enumerate(self.room[b][g]) if r > 0)
        chunks, rest = [], size
        for neg_room, g, m in cells:
            take = min(rest, -neg_room)
            chunks.append((g, m, take))
            rest -= take
            if not rest:
                break
        return chunks


def _least(load: np.ndarray, allowed: np.ndarray) -> int:
    """The least loaded allowed group (lowest index on ties), or -1."""
    g = int(np.argmin(np.where(allowed, load, np.inf)))
    return g if allowed[g] else -1


def place(
    p: Pieces,
    seq: np.ndarray,
    micro: np.ndarray,
    groups: int,
    cost: CostFunction,
    cut: bool,
    redo: np.ndarray | None = None,
) -> int | None:
    """Pass 2; with ``redo`` (a mask of groups) re-pack those groups' pieces, each in its group
    (cut across its micro-batches, if cutting is allowed, rather than moved to another group).

    Returns None, or the bucket that needs one more micro-batch (only when ``cut`` is False).
    """
    if redo is None:
        todo = np.arange(len(p.length))
        bins = _Bins(seq, micro, groups, p)
        load = np.zeros(groups)
    else:
        moving = redo[p.group]
        todo = np.flatnonzero(moving)
        bins = _Bins(seq, micro, groups, p, occupied=~moving)
        load = np.bincount(p.group[~moving], p.cost[~moving], groups).astype(np.float64)
    heap = [(x, g) for g, x in enumerate(load.tolist())]
    heapq.heapify(heap)
    loads = load.tolist()  # the loop reads lists: numpy scalars cost ~10x more per access
    lengths, costs = p.length.tolist(), p.cost.tolist()
    buckets, own = p.bucket.tolist(), p.group.tolist()
    group, micro_of = list(own), p.micro.tolist()
    rooms, bin_costs, total = bins.room, bins.cost, bins.total
    most, most_list = bins.most, bins.most_list
    replace = heapq.heapreplace
    for i in todo[np.lexsort((todo, -p.cost[todo]))].tolist():
        b, size, c = buckets[i], lengths[i], costs[i]
        if redo is None:
            top, g = heap[0]
            while top != loads[g]:  # loads only grow: refresh stale entries lazily
                replace(heap, (loads[g], g))
                top, g = heap[0]
        else:
            g = own[i]
        # The cheapest micro-batch of group g with room (inlined: this loop is the hot path).
        room, cell_cost = rooms[b][g], bin_costs[b][g]
        m = -1
        for k, r in enumerate(room):
            if r >= size and (m < 0 or cell_cost[k] < cell_cost[m]):
                m = k
        if m < 0 and not (redo is not None and cut and total[b][g] >= size):
            g = _least(load, most[b] >= size)  # the least loaded group with room
            m = bins.pick(b, g, size) if g >= 0 else -1
        if m >= 0:
            group[i], micro_of[i] = g, m
            room = rooms[b][g]
            room[m] -= size
            bin_costs[b][g][m] += c
            total[b][g] -= size
            largest = max(room)
            if largest != most_list[b][g]:
                most_list[b][g] = largest
                most[b][g] = largest
            loads[g] += c
            load[g] = loads[g]
            continue
        if not cut:
            return b
        chunks = bins.cut_plan(b, size, load, own[i] if redo is not None else -1)
        group[i], micro_of[i] = chunks[0][:2]
        for (g, m, n), piece_cost in zip(chunks, p.cut(i, chunks, cost), strict=True):
            bins.add(b, g, m, n, piece_cost)
            loads[g] += piece_cost
            load[g] = loads[g]
    p.group[: len(group)] = group
    p.micro[: len(micro_of)] = micro_of
    p.flush()
    return None

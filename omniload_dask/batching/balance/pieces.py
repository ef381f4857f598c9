"""The pieces of a step and its micro-batches ("bins") while the passes place them.

Every pass reads and changes these two tables: a piece is a token range of a document with its
cost and the bin it is in; a bin is one micro-batch of one group with its room and cost::

    pieces  doc start length cost bin        bins  group slot capacity room load
            0   0     6      6    0                0     0    8        2    6
            1   0     5      5    1                1     0    8        0    8
            2   0     3      3    1
            (2 groups x 1 micro-batch of 8 tokens, cost = L; piece 3 not placed yet: bin -1)

Several steps side by side (:func:`side_by_side`) are one step of as many groups as all of
them: step s's groups numbered from ``s * groups`` and its bins in the s-th block; every pass
runs on that and :func:`apart` gives each step its own tables back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from omniload_dask.batching.sorting import stable_order
from omniload_dask.plan.cost import CostFunction

__all__ = ["Bins", "Pieces", "apart", "by_cost", "side_by_side"]


@dataclass
class Pieces:
    """A step's pieces while they are placed: piece i is tokens ``[start, start + length)`` of
    document ``doc``; ``extra`` (image encoder cost) sits on a document's first piece and is
    part of its ``cost``. ``bin`` is the micro-batch a piece is in (-1: not placed yet).

    Cutting a piece (:meth:`cut`) keeps its first part at its index and appends the others.
    """

    doc: np.ndarray
    start: np.ndarray
    length: np.ndarray
    cost: np.ndarray
    bucket: np.ndarray
    extra: np.ndarray
    bin: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    cuts: int = 0  # pieces cut (each makes its document continue in another micro-batch)
    head: int = 1  # documents 0 .. head-1 go first where pieces are packed by length (.place)

    @classmethod
    def new(
        cls, doc: np.ndarray, start: np.ndarray, length: np.ndarray, bucket: np.ndarray,
        extra: np.ndarray, cost: CostFunction,
    ) -> Pieces:  # fmt: skip
        """Pieces not placed yet, their costs from ``cost`` (plus ``extra``)."""
        costs = np.asarray(cost(length), dtype=np.float64) + extra
        return cls(doc, start, length, costs, bucket, extra, np.full(len(doc), -1, np.int64))

    def __len__(self) -> int:
        return len(self.doc)

    def cut(self, piece: np.ndarray, tokens: np.ndarray, cost: CostFunction) -> np.ndarray:
        """Cut pieces into consecutive parts: ``piece`` (ascending, each index once per part,
        parts in token order) and each part's ``tokens``. Returns the index of every part: a
        piece's first part keeps its index (and its ``extra``), the others are appended.
        """
        if not len(piece):
            return np.zeros(0, np.int64)
        first = np.empty(len(piece), dtype=bool)
        first[0] = True
        np.not_equal(piece[1:], piece[:-1], out=first[1:])
        heads = first.nonzero()[0]
        parts = np.empty(len(heads), np.int64)  # parts of each piece (np.diff of the heads)
        parts[:-1] = heads[1:] - heads[:-1]
        parts[-1] = len(piece) - heads[-1]
        offset = tokens.cumsum() - tokens  # each part's start within its piece
        offset -= offset[first].repeat(parts)
        n = len(self.doc)
        index = np.empty(len(piece), dtype=np.int64)
        index[first] = piece[first]
        more = ~first
        index[more] = np.arange(n, n + len(piece) - len(heads))
        extra = np.where(first, self.extra[piece], 0.0)
        costs = np.asarray(cost(tokens), dtype=np.float64) + extra
        # Every column grows by the copied rows of the parts cut off (one gather per column:
        # cheaper than a concatenation each); their length and cost are set below, their
        # extra is 0 (it stays with the first part).
        rows = np.concatenate([np.arange(n), piece[more]])
        self.doc = self.doc[rows]
        self.bucket = self.bucket[rows]
        self.bin = self.bin[rows]
        self.extra = self.extra[rows]
        self.extra[n:] = 0.0
        self.start = self.start[rows]
        self.length = self.length[rows]
        self.cost = self.cost[rows]
        self.start[index] = self.start[piece] + offset
        self.length[index] = tokens
        self.cost[index] = costs
        self.cuts += int(np.count_nonzero(parts > 1))
        return index


@dataclass
class Bins:
    """The step's micro-batches: bucket b has bins ``offset[b]:offset[b + 1]``
    (``groups * micro[b]`` of them), each with its capacity, room, cost and (once dealt) its
    group and its micro-step within the group's micro-steps of that bucket (``slot``)."""

    offset: np.ndarray
    capacity: np.ndarray
    room: np.ndarray
    load: np.ndarray
    bucket: np.ndarray
    group: np.ndarray
    slot: np.ndarray

    @classmethod
    def new(cls, seq: np.ndarray, micro: np.ndarray, groups: int) -> Bins:
        """Empty bins for ``micro[b]`` micro-batches of ``seq[b]`` tokens per group."""
        count = micro * groups
        offset = np.concatenate([[0], count.cumsum()]).astype(np.int64)
        bucket = np.arange(len(seq)).repeat(count)
        capacity = seq[bucket].astype(np.int64)
        within = np.arange(int(offset[-1])) - offset[bucket]
        slot, group = np.divmod(within, groups)  # slot-major (a bucket packed by bins: dealt)
        return cls(offset, capacity, capacity.copy(), np.zeros(len(bucket)), bucket, group, slot)

    def put(self, p: Pieces, piece: np.ndarray, where: np.ndarray) -> None:
        """Put pieces into bins (each bin at most once in ``where``)."""
        p.bin[piece] = where
        self.room[where] -= p.length[piece]
        self.load[where] += p.cost[piece]

    def add(self, p: Pieces, piece: np.ndarray, where: np.ndarray) -> None:
        """Put pieces into bins (a bin may repeat)."""
        p.bin[piece] = where
        n = len(self.room)
        self.room -= np.bincount(where, p.length[piece], n).astype(np.int64)
        self.load += np.bincount(where, p.cost[piece], n)


def by_cost(p: Pieces, ids: np.ndarray) -> np.ndarray:
    """``ids`` (ascending) by decreasing cost, ties in the order of ``ids``.

    Where cost follows length alone and rises with it, this is the order by decreasing
    length: a radix sort of 16-bit lengths, several times faster than sorting the costs
    (checked on the result: costs fall where lengths do and are equal where they are; else
    the costs are sorted).
    """
    length = p.length[ids]
    if len(ids) > 64 and not p.extra[ids].any() and int(length.max()) < 1 << 16:
        order = stable_order(0xFFFF - length)
        c, n = p.cost[ids][order], length[order]
        if np.all((c[1:] < c[:-1]) | ((n[1:] == n[:-1]) & (c[1:] == c[:-1]))):
            return ids[order]
    return ids[(-p.cost[ids]).argsort(kind="stable")]


def side_by_side(steps: Sequence[tuple[Pieces, Bins]], groups: int) -> tuple[Pieces, Bins]:
    """Several steps' pieces and bins (one bucket, as many bins each) as one step of
    ``len(steps) * groups`` groups: step s has groups ``s * groups`` on and its bins in the
    s-th block (what the balancer's passes 3 to 5 run on: :func:`~.split.balance_steps`)."""
    shape = len(steps[0][1].room)
    cat = np.concatenate
    ps, bs = [q for q, _ in steps], [b for _, b in steps]
    p = Pieces(
        cat([q.doc for q in ps]), cat([q.start for q in ps]), cat([q.length for q in ps]),
        cat([q.cost for q in ps]), cat([q.bucket for q in ps]), cat([q.extra for q in ps]),
        cat([q.bin + s * shape for s, q in enumerate(ps)]),
    )  # fmt: skip
    bins = Bins(
        np.asarray([0, shape * len(steps)], np.int64), cat([b.capacity for b in bs]),
        cat([b.room for b in bs]), cat([b.load for b in bs]), cat([b.bucket for b in bs]),
        cat([b.group + s * groups for s, b in enumerate(bs)]), cat([b.slot for b in bs]),
    )  # fmt: skip
    return p, bins


def apart(
    p: Pieces, bins: Bins, steps: Sequence[tuple[Pieces, Bins]], groups: int
) -> list[tuple[Pieces, Bins]]:
    """Each step's pieces (in the order its own pass would leave them: its pieces first,
    then the parts cut off, in the order they were cut) and bins, from :func:`side_by_side`."""
    shape = len(steps[0][1].room)
    step_of = p.bin // shape
    out = []
    for s, (before, b) in enumerate(steps):
        mine = (step_of == s).nonzero()[0]
        q = Pieces(
            p.doc[mine], p.start[mine], p.length[mine], p.cost[mine], p.bucket[mine],
            p.extra[mine], p.bin[mine] - s * shape,
            before.cuts + len(mine) - len(before),  # (each cut of the pass adds one piece)
        )  # fmt: skip
        window = slice(s * shape, (s + 1) * shape)
        out.append((q, Bins(
            b.offset, bins.capacity[window], bins.room[window], bins.load[window],
            bins.bucket[window], bins.group[window] - s * groups, bins.slot[window],
        )))  # fmt: skip
    return out

"""Split one global batch among the DP groups and pack each group's share into micro-batches.

The global batch (its documents are fixed by the mix, whatever the DP size) becomes pieces of at
most a bucket's ``seq_len`` tokens. The goal is the smallest largest group cost (ranks wait for
the slowest one) under hard token limits: every micro-batch holds at most its ``seq_len``. Three
passes, all deterministic (ties go to the lower index)::

    1 route    each document to a context bucket; a bucket over its capacity hands its
               shortest length-routed documents down to the next shorter bucket
    2 place    pieces by decreasing cost (LPT): each goes to the least loaded group that has a
               micro-batch with room for it, into that group's cheapest such micro-batch (which
               also evens the micro-batches of a rank, what pipeline parallelism waits on); a
               piece that fits no micro-batch whole is cut into those with the most room (or,
               when cutting is not allowed, every group gets one more micro-batch of its bucket)
    3 refine   heaviest group against the lightest ones: the move, swap, or exchange of one
               piece for a run of the other group's shortest pieces, that best evens the pair;
               groups it changed are packed again

Worked example: 2 groups, 1 micro-batch of 8 tokens each, cost = L, pieces 6, 5, 3, 2::

    6 -> g0 (load 0)    5 -> g1 (0)    3 -> g1 (5 < 6)    2 -> g0 (6 < 8)
    loads 8, 8: efficiency mean/max = 1.0

A document's ``extra`` cost (the vision encoder's cost of its images, see :mod:`.cost`) is added
to its first piece, where its images sit, so groups are balanced on backbone and encoder cost
together; a piece cut while placing keeps it in its first chunk.

Pass 3 matters when every group is full of tokens: LPT can then only give the last pieces to
whoever has room, and only an exchange (a long piece for several short ones of as many tokens)
moves attention cost. ``benchmarks/balance.py --compare`` measures what each pass adds.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from omniload_dask.batching.cost import CostFunction, CostModel

__all__ = ["Assignment", "Bucket", "CostModel", "balance", "route", "split_documents"]

REFINE_TOLERANCE = 2e-3  # stop once the heaviest group is within 0.2% of the mean
REFINE_PARTNERS = 4  # lightest groups tried against the heaviest before giving up
REFINE_BUDGET = 3_000_000  # piece pairs the refinement may weigh per global batch (~10 ms)
SWAP_SAMPLE = 96  # pieces of each group weighed for moves and swaps (all, below that)
REFINE_PROGRESS = 1e-4  # a run of moves must lower the heaviest group by this fraction ...
# ... within as many moves as there are groups (each move evens one heavy group), or it stops


@dataclass(frozen=True)
class Bucket:
    """Micro-batches of at most ``seq_len`` tokens, ``micro_batches`` of them per group.

    A ``pinned`` bucket takes only the documents of the sources pinned to it.
    """

    seq_len: int
    micro_batches: int
    pinned: bool = False


@dataclass
class Assignment:
    """The split of one step: piece i is tokens ``[start, start + length)`` of document ``doc``.

    It goes to DP group ``group[i]``, micro-step ``micro[i]``; micro-step m has room for
    ``micro_capacity[m]`` tokens and belongs to bucket ``micro_bucket[m]``.
    """

    doc: np.ndarray
    start: np.ndarray
    length: np.ndarray
    cost: np.ndarray
    group: np.ndarray
    micro: np.ndarray
    micro_capacity: np.ndarray
    micro_bucket: np.ndarray
    groups: int
    cuts: int = 0  # pieces cut to fill micro-batches (documents continued elsewhere)
    spilled: int = 0  # documents handed down to a shorter bucket
    _order: np.ndarray | None = field(default=None, repr=False)

    @property
    def num_micro_steps(self) -> int:
        return len(self.micro_capacity)

    @property
    def group_costs(self) -> np.ndarray:
        return np.bincount(self.group, self.cost, self.groups)

    @property
    def group_tokens(self) -> np.ndarray:
        return np.bincount(self.group, self.length, self.groups).astype(np.int64)

    @property
    def micro_tokens(self) -> np.ndarray:
        """Tokens per (group, micro-step)."""
        flat = self.group * self.num_micro_steps + self.micro
        size = self.groups * self.num_micro_steps
        return np.bincount(flat, self.length, size).astype(np.int64).reshape(self.groups, -1)

    @property
    def micro_costs(self) -> np.ndarray:
        """Cost per (group, micro-step)."""
        flat = self.group * self.num_micro_steps + self.micro
        size = self.groups * self.num_micro_steps
        return np.bincount(flat, self.cost, size).reshape(self.groups, -1)

    @property
    def efficiency(self) -> float:
        """mean/max of the group costs (1.0 = perfect balance)."""
        costs = self.group_costs
        peak = float(costs.max()) if len(costs) else 0.0
        return float(costs.mean() / peak) if peak > 0 else 1.0

    def output_order(self) -> np.ndarray:
        """Piece indices by (group, micro-step, document, start): the order batches hold them."""
        if self._order is None:
            self._order = np.lexsort((self.start, self.doc, self.micro, self.group))
        return self._order

    @property
    def bins(self) -> list[list[np.ndarray]]:
        """``bins[g][m]``: the piece indices of group g's micro-step m, in output order."""
        order = self.output_order()
        cells = self.group[order] * self.num_micro_steps + self.micro[order]
        bounds = np.searchsorted(cells, np.arange(self.groups * self.num_micro_steps + 1))
        m = self.num_micro_steps
        return [
            [order[bounds[g * m + k] : bounds[g * m + k + 1]] for k in range(m)]
            for g in range(self.groups)
        ]


def split_documents(
    lengths: np.ndarray, seq_len: int | np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Cut documents into pieces of at most ``seq_len`` tokens (a number, or one per document).

    Returns ``(doc index, start offset)`` per piece; piece lengths follow from them.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    size = np.broadcast_to(np.asarray(seq_len, dtype=np.int64), lengths.shape)
    npieces = np.maximum(1, -(-lengths // size))
    doc = np.repeat(np.arange(len(lengths), dtype=np.int64), npieces)
    first = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(npieces, out=first[1:])
    within = np.arange(len(doc), dtype=np.int64) - np.repeat(first[:-1], npieces)
    return doc, within * size[doc]


def _ladder(buckets: Sequence[Bucket]) -> list[int]:
    """Buckets that take documents by length, shortest first."""
    free = [b for b, spec in enumerate(buckets) if not spec.pinned]
    return sorted(free, key=lambda b: (buckets[b].seq_len, b))


def route(
    lengths: np.ndarray,
    sources: np.ndarray,
    buckets: Sequence[Bucket],
    pinned: dict[int, int] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Bucket of each document, and whether it was routed by length (so it may spill).

    ``pinned`` maps a source index to its (pinned) bucket. Other documents go to the shortest
    bucket that is not pinned and holds them whole, or the longest such bucket if none does.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    sources = np.asarray(sources, dtype=np.int64)
    bucket = np.zeros(len(lengths), dtype=np.int64)
    by_length = np.ones(len(lengths), dtype=bool)
    free = _ladder(buckets)
    if free:
        limits = np.asarray([buckets[b].seq_len for b in free], dtype=np.int64)
        pick = np.minimum(np.searchsorted(limits, lengths, side="left"), len(free) - 1)
        bucket = np.asarray(free, dtype=np.int64)[pick]
    for source, b in (pinned or {}).items():
        mine = sources == source
        bucket[mine] = b
        by_length[mine] = False
    return bucket, by_length


def balance(
    lengths: np.ndarray,
    doc_bucket: np.ndarray,
    buckets: Sequence[Bucket],
    groups: int,
    cost: CostFunction,
    *,
    by_length: np.ndarray | None = None,
    cut: bool = True,
    refine: bool = True,
    extra: np.ndarray | None = None,
) -> Assignment:
    """Split documents of ``lengths`` (bucket ``doc_bucket``) among ``groups`` (module doc).

    Every micro-batch holds at most its bucket's ``seq_len`` tokens; a step gets more than a
    bucket's ``micro_batches`` only when its tokens need them, or (``cut=False``) when its
    pieces cannot be packed whole. ``refine=False`` skips pass 3 (for measurements).
    ``extra`` is a cost per document on top of ``cost`` of its pieces (image encoder terms).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    doc_bucket = np.asarray(doc_bucket, dtype=np.int64).copy()
    seq = np.asarray([b.seq_len for b in buckets], dtype=np.int64)
    micro = np.asarray([b.micro_batches for b in buckets], dtype=np.int64)
    movable = np.ones(len(lengths), bool) if by_length is None else np.asarray(by_length, bool)
    spilled = _spill(lengths, doc_bucket, movable, _ladder(buckets), micro * seq * groups)
    doc, start = split_documents(lengths, seq[doc_bucket])
    piece_bucket = doc_bucket[doc]
    length = np.minimum(lengths[doc] - start, seq[piece_bucket])
    costs = np.asarray(cost(length), dtype=np.float64)
    piece_extra = None
    if extra is not None:
        piece_extra = np.where(start == 0, np.asarray(extra, np.float64)[doc], 0.0)
        costs = costs + piece_extra
    need = np.bincount(piece_bucket, length, len(buckets)).astype(np.int64)
    micro = np.maximum(micro, -(-need // (seq * groups)))
    while True:
        pieces = _Pieces.new(doc, start, length, costs, piece_bucket, piece_extra)
        stuck = _place(pieces, seq, micro, groups, cost, cut)
        if stuck is None and refine:
            touched = _refine(pieces, micro * seq, groups)
            if touched.any():
                stuck = _place(pieces, seq, micro, groups, cost, cut, redo=touched)
        if stuck is None:
            break
        micro[stuck] += 1  # cannot pack whole and may not cut: one more micro-batch
    offsets = np.concatenate([[0], np.cumsum(micro)])
    return Assignment(
        doc=pieces.doc,
        start=pieces.start,
        length=pieces.length,
        cost=pieces.cost,
        group=pieces.group,
        micro=pieces.micro + offsets[pieces.bucket],
        micro_capacity=np.repeat(seq, micro),
        micro_bucket=np.repeat(np.arange(len(buckets)), micro),
        groups=groups,
        cuts=pieces.cuts,
        spilled=spilled,
    )


def _spill(
    lengths: np.ndarray,
    bucket: np.ndarray,
    movable: np.ndarray,
    ladder: list[int],
    capacity: np.ndarray,
) -> int:
    """Hand the shortest length-routed documents of an over-full bucket to the next shorter."""
    spilled = 0
    for hi, lo in zip(ladder[:0:-1], ladder[-2::-1], strict=True):
        over = int(lengths[bucket == hi].sum() - capacity[hi])
        if over <= 0:
            continue
        cand = np.flatnonzero((bucket == hi) & movable)
        cand = cand[np.lexsort((cand, lengths[cand]))]
        take = int(np.searchsorted(np.cumsum(lengths[cand]), over, side="left")) + 1
        bucket[cand[:take]] = lo
        spilled += min(take, len(cand))
    return spilled


@dataclass
class _Pieces:
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
    ) -> _Pieces:  # fmt: skip
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
        self, seq: np.ndarray, micro: np.ndarray, groups: int, p: _Pieces,
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
        (a step's tokens always fit: :func:`balance` sizes the buckets for them)."""
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


def _place(
    p: _Pieces,
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


def _refine(p: _Pieces, cap: np.ndarray, groups: int, max_moves: int | None = None) -> np.ndarray:
    """Pass 3: even the heaviest group against the lightest ones; returns the groups changed.

    Works on group totals (a group may hold ``micro_batches * seq_len`` tokens of a bucket);
    the changed groups are packed into micro-batches again afterwards.
    """
    group, length, cost, bucket = p.group, p.length, p.cost, p.bucket
    nb = len(cap)
    load = np.bincount(group, cost, groups)
    tokens = np.bincount(group * nb + bucket, length, groups * nb).astype(np.int64)
    tokens = tokens.reshape(groups, nb)
    touched = np.zeros(groups, dtype=bool)
    ids = np.arange(groups)
    peak, stalled = float(load.max()), 0
    budget = REFINE_BUDGET  # pairs weighed: a deterministic bound on the planning time
    for _ in range(max_moves if max_moves is not None else 8 * groups + 64):
        heavy = int(np.argmax(load))
        if load[heavy] - load.mean() <= REFINE_TOLERANCE * load[heavy]:
            break
        if load[heavy] < peak * (1 - REFINE_PROGRESS):
            peak, stalled = float(load[heavy]), 0
        elif stalled > max(groups, 4):
            break  # tiny gains only: not worth the planning time
        stalled += 1
        mine = np.flatnonzero(group == heavy)
        mine_sample = _spread(cost[mine], SWAP_SAMPLE)  # the same for every partner below
        room_h = np.maximum(cap, tokens[heavy]) - tokens[heavy]
        for light in np.lexsort((ids, load))[:REFINE_PARTNERS].tolist():
            gap = load[heavy] - load[light]
            if gap <= 0:
                break
            room_l = np.maximum(cap, tokens[light]) - tokens[light]
            others = np.flatnonzero(group == light)
            budget -= min(len(mine), SWAP_SAMPLE) * (min(len(others), SWAP_SAMPLE) + 1)
            if budget < 0:
                return touched  # few groups of many small pieces: near even already
            move = _best_move(mine, others, gap, length, cost, bucket, room_h, room_l, mine_sample)
            if move is None:
                continue
            to_light, to_heavy, delta = move
            group[to_light] = light
            group[to_heavy] = heavy
            load[heavy] -= delta
            load[light] += delta
            for src, dst, moved in ((heavy, light, to_light), (light, heavy, to_heavy)):
                np.add.at(tokens[src], bucket[moved], -length[moved])
                np.add.at(tokens[dst], bucket[moved], length[moved])
            touched[[heavy, light]] = True
            break
        else:
            break  # the heaviest group cannot be improved: it sets the step time
    return touched


def _spread(values: np.ndarray, k: int) -> np.ndarray:
    """Positions of at most ``k`` of ``values``, evenly spaced over their sorted order."""
    n = len(values)
    if n <= k:
        return np.arange(n)
    order = np.argsort(values, kind="stable")
    return np.unique(order[np.linspace(0, n - 1, k).round().astype(np.int64)])


def _best_move(
    heavy: np.ndarray,
    light: np.ndarray,
    gap: float,
    length: np.ndarray,
    cost: np.ndarray,
    bucket: np.ndarray,
    room_h: np.ndarray,
    room_l: np.ndarray,
    hs: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, float] | None:
    """The move, swap or exchange between two groups whose cost shift is nearest ``gap / 2``.

    A shift ``delta`` in (0, gap) lowers the pair's larger cost. ``room_*`` are per bucket;
    ``hs``: the positions in ``heavy`` weighed for moves and swaps (its ``_spread``), when the
    caller has them already.
    """
    best: tuple[float, np.ndarray, np.ndarray, float] | None = None
    lh, ch, bh = length[heavy], cost[heavy], bucket[heavy]
    # Moves (the last column: nothing comes back) and one-for-one swaps, among at most
    # SWAP_SAMPLE pieces of each group spread over its range of costs (groups of hundreds of
    # small documents offer many near-equal choices; weighing all pairs cost milliseconds).
    if hs is None:
        hs = _spread(ch, SWAP_SAMPLE)
    ls = _spread(cost[light], SWAP_SAMPLE)
    sub_h, sub_l = heavy[hs], light[ls]
    lhs, chs, bhs = lh[hs], ch[hs], bh[hs]
    lq = np.append(length[sub_l], 0)
    cq = np.append(cost[sub_l], 0.0)
    bq = np.append(bucket[sub_l], -1)
    same = (bhs[:, None] == bq[None, :]) | (bq[None, :] < 0)
    fits_l = lhs[:, None] - np.where(same, lq[None, :], 0) <= room_l[bhs][:, None]
    fits_h = np.where(
        same,
        lq[None, :] - lhs[:, None] <= room_h[bhs][:, None],
        lq[None, :] <= room_h[np.maximum(bq, 0)][None, :],
    )
    delta = chs[:, None] - cq[None, :]
    ok = fits_l & fits_h & (delta > 0) & (delta < gap)
    if ok.any():
        score = np.where(ok, np.abs(gap / 2 - delta), np.inf)
        i, j = np.unravel_index(int(np.argmin(score)), score.shape)
        back = sub_l[j : j + 1] if j < len(sub_l) else sub_l[:0]
        best = (float(score[i, j]), sub_h[i : i + 1], back, float(delta[i, j]))
    # Exchanges: a heavy piece for the light group's shortest pieces of its bucket.
    for b in np.unique(bh).tolist():
        pool = light[bucket[light] == b]
        if not len(pool):
            continue
        pool = pool[np.lexsort((pool, length[pool]))]
        cum_tokens = np.cumsum(length[pool])
        cum_cost = np.cumsum(cost[pool])
        sel = np.flatnonzero(bh == b)
        short = lh[sel] - room_l[b]  # tokens the light group must give back
        k = np.searchsorted(cum_tokens, short, side="left")
        valid = (short > 0) & (k < len(pool))
        k = np.minimum(k, len(pool) - 1)
        d = ch[sel] - cum_cost[k]
        ok = valid & (d > 0) & (d < gap) & (cum_tokens[k] - lh[sel] <= room_h[b])
        if not ok.any():
            continue
        score = np.where(ok, np.abs(gap / 2 - d), np.inf)
        at = int(np.argmin(score))
        if best is None or score[at] < best[0]:
            best = (float(score[at]), heavy[sel[at] : sel[at] + 1], pool[: k[at] + 1], float(d[at]))
    return None if best is None else best[1:]

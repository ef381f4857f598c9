"""Split one global batch among the DP groups and pack each group's share into micro-batches.

The global batch (its documents are fixed by the mix, whatever the DP size) becomes pieces of at
most a bucket's ``seq_len`` tokens. The goal is the smallest largest group cost (ranks wait for
the slowest one) under hard token limits: every micro-batch holds at most its ``seq_len``. Four
passes, all in numpy and deterministic (ties go to the lower index), one module each::

    1 route    each document to a context bucket; a bucket over its capacity hands its
               shortest length-routed documents down to the next shorter bucket (.routing)
    2 place    pieces by decreasing cost (LPT) in rounds: each round gives the next pieces,
               one each, to the least loaded groups, into a group's cheapest micro-batch with
               room (which also evens the micro-batches of a rank, what pipeline parallelism
               waits on); what fits nowhere in its round fills the room left (best fit), and
               what fits no micro-batch whole is cut into those with the most room (or, when
               cutting is not allowed, every group gets one more micro-batch of its bucket).
               With many micro-batches per group they are packed first and dealt (.placement)
    3 refine   the heavy groups against the light ones, many pairs at once: the move, swap,
               or exchange of one piece for a run of a micro-batch's shortest pieces, that
               best evens each pair (.refine)
    4 polish   up to 64 groups: exchanges of up to two pieces for up to two between a heavy
               and a light group's micro-batches, within their tokens (.polish)
    5 slide    up to 64 groups, where cuts are allowed: move a cut between the heavy group
               and another one by a short piece's length, the short piece going back (.slide)

Worked example: 2 groups, 1 micro-batch of 8 tokens each, cost = L, pieces 6, 5, 3, 2::

    6 -> g0 (load 0)    5 -> g1 (0)    3 -> g1 (5 < 6)    2 -> g0 (6 < 8)
    loads 8, 8: efficiency mean/max = 1.0

A document's ``extra`` cost (the vision encoder's cost of its images, see :mod:`.cost`) is added
to its first piece, where its images sit, so groups are balanced on backbone and encoder cost
together; a piece cut keeps it in its first part. Costs come from the plan's cost model only
(called on arrays of piece lengths), so every term it has applies here.

Few documents per group. No split of whole pieces does better than the *structural bound*,
the mean group cost over the costliest piece (:func:`structural_bound`, kept as
``Assignment.bound``): a group that holds that piece costs at least that much. Where the plan
lets documents be cut (``long_documents: split``), pieces that cost more than a group's fair
share are cut into as many parts of equal tokens as it takes to cost no more than that, and a
step still below 0.98 after pass 3's whole-piece changes gets cut rounds (:mod:`.refine`)
while it is below 0.99: every group gets work, and a step of 4,096 groups with 4,096 documents
comes out at 0.99 instead of 0.12, at the price of cutting most documents
(``Assignment.cuts``). Otherwise documents are only cut where a piece fits no micro-batch
whole, and a group or micro-batch may get no piece when its bucket has fewer pieces than
micro-batches: it is handed out empty (``num_tokens`` 0, ``cu_seqlens`` ``[0]``, the step's
other fields as usual) and counted (``Assignment.empty_micro_batches``).

Several steps at once (:func:`balance_steps`, what the scheduler plugin's planning thread
runs on the steps drawn since its last batch): pass 1 and pass 2's best fit and cuts step by
step, pass 2's rounds over groups (:mod:`.placement_steps`) and passes 3 to 5 for the steps
side by side (their pieces and bins in one set of arrays, step s's groups numbered from
``s * groups``), each step with its own queue, rounds, pairs, peak and reasons to stop, and
its own running sums. Every split is the one its step alone gets, to the last bit (the tests
compare them field by field); at DP 8 and 16 a round's time is the numpy calls' own cost, so
eight steps side by side take about half the time of eight alone (BENCHMARKS.md, session 26).

Passes 3 and 4 matter when every group is full of tokens: LPT can then only give the last pieces
to whoever has room, and only an exchange (a long piece for several short ones of as many
tokens) moves attention cost. ``benchmarks/balance.py --compare`` measures what each pass adds and
``benchmarks/planning.py`` what planning costs. The result is an
:class:`~.assignment.Assignment`; this module also exports the names its callers use with it
(``Bucket``, ``route``, ``split_documents``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

import omniload_dask.batching.balance.refine as refinement
from omniload_dask.batching.assignment import Assignment
from omniload_dask.batching.balance.pieces import Bins, Pieces
from omniload_dask.batching.balance.place import DEAL_FROM, fill_room, pack
from omniload_dask.batching.balance.polish import polish_groups, polish_steps
from omniload_dask.batching.balance.refine import refine_groups
from omniload_dask.batching.balance.refine_steps import refine_steps
from omniload_dask.batching.balance.rounds import group_rounds_steps
from omniload_dask.batching.balance.route import Bucket, ladder, route, spill, split_documents
from omniload_dask.batching.balance.slide import slide_cuts, slide_steps
from omniload_dask.batching.cost import CostFunction

__all__ = [
    "Assignment", "Bucket", "balance", "balance_steps", "route", "split_documents",
    "structural_bound",
]  # fmt: skip


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
    pieces cannot be packed whole. ``refine=False`` skips passes 3 to 5 (for measurements).
    ``extra`` is a cost per document on top of ``cost`` of its pieces (image encoder terms).
    """
    placed = _place(lengths, doc_bucket, buckets, groups, cost, by_length, cut, extra)
    if refine:
        refine_groups(placed.pieces, placed.bins, groups, cost, cut)
        _polish_and_slide(placed, groups, cost, cut)
    return placed.assignment(buckets, groups)


def balance_steps(
    steps: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]],
    buckets: Sequence[Bucket],
    groups: int,
    cost: CostFunction,
    *,
    cut: bool = True,
) -> list[Assignment]:
    """:func:`balance` of several steps, ``(lengths, doc_bucket, by_length, extra)`` each: the
    same splits, bit for bit, with passes 3 to 5 run for steps side by side where they can
    be (one bucket, at most ``STEPS_UP_TO`` groups: :func:`~.refine_steps.refine_steps`,
    :func:`~.polish.polish_steps`, :func:`~.slide.slide_steps`; steps of as many bins
    together)."""
    if len(buckets) != 1 or not 2 <= groups <= refinement.STEPS_UP_TO:
        placed = [_place(n, b, buckets, groups, cost, by, cut, x) for n, b, by, x in steps]
        for one in placed:
            refine_groups(one.pieces, one.bins, groups, cost, cut)
            _polish_and_slide(one, groups, cost, cut)
        return [one.assignment(buckets, groups) for one in placed]
    placed = _place_steps(steps, buckets, groups, cost, cut)
    kinds: dict[int, list[_Placed]] = {}  # steps side by side: those of as many bins
    for one in placed:
        if len(one.pieces):
            kinds.setdefault(len(one.bins.room), []).append(one)
    for kind in kinds.values():
        _take_back(kind, refine_steps([(o.pieces, o.bins) for o in kind], groups, cost, cut))
        _take_back(kind, polish_steps([(o.pieces, o.bins) for o in kind], groups))
        if cut:
            _take_back(kind, slide_steps([(o.pieces, o.bins) for o in kind], groups, cost))
    return [one.assignment(buckets, groups) for one in placed]


def _take_back(kind: list[_Placed], done: list[tuple[Pieces, Bins]]) -> None:
    """Take each step's pieces and bins back from a pass run side by side."""
    for one, (pieces, bins) in zip(kind, done, strict=True):
        one.pieces, one.bins = pieces, bins


@dataclass
class _Placed:
    """A step after passes 1 and 2: its pieces in their bins, and what the split reports."""

    pieces: Pieces
    bins: Bins
    micro: np.ndarray  # micro-batches per group of each bucket
    spilled: int
    bound: float

    def assignment(self, buckets: Sequence[Bucket], groups: int) -> Assignment:
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


def _place_steps(
    steps: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]],
    buckets: Sequence[Bucket],
    groups: int,
    cost: CostFunction,
    cut: bool,
) -> list[_Placed]:
    """Passes 1 and 2 of several steps of one bucket: pass 2's rounds over groups side by
    side for the steps of as many micro-batches (:mod:`.placement_steps`; the same
    placements as :func:`_place` of each), where cuts are allowed."""
    ready = [_prepare(n, b, buckets, groups, cost, by, cut, x) for n, b, by, x in steps]
    placed: list[_Placed | None] = [None] * len(ready)
    kinds: dict[int, list[int]] = {}
    for i, (pieces, micro, _, _) in enumerate(ready):
        if cut and len(pieces) and int(micro[0]) < DEAL_FROM:
            kinds.setdefault(int(micro[0]), []).append(i)
    seq = np.asarray([buckets[0].seq_len], dtype=np.int64)
    for each, kind in kinds.items():
        if len(kind) < 2:
            continue
        pairs = [(ready[i][0], Bins.new(seq, ready[i][1], groups)) for i in kind]
        lefts = group_rounds_steps(pairs, groups, each)
        for i, (pieces, bins), left in zip(kind, pairs, lefts, strict=True):
            fill_room(pieces, bins, left, 0, len(bins.room), cost, cut)
            placed[i] = _Placed(pieces, bins, *ready[i][1:])
    return [
        one if one is not None else _pack(*ready[i], buckets, groups, cost, cut)
        for i, one in enumerate(placed)
    ]


def _place(
    lengths: np.ndarray,
    doc_bucket: np.ndarray,
    buckets: Sequence[Bucket],
    groups: int,
    cost: CostFunction,
    by_length: np.ndarray | None,
    cut: bool,
    extra: np.ndarray | None,
) -> _Placed:
    """Passes 1 and 2 (module doc) of one step."""
    ready = _prepare(lengths, doc_bucket, buckets, groups, cost, by_length, cut, extra)
    return _pack(*ready, buckets, groups, cost, cut)


def _prepare(
    lengths: np.ndarray,
    doc_bucket: np.ndarray,
    buckets: Sequence[Bucket],
    groups: int,
    cost: CostFunction,
    by_length: np.ndarray | None,
    cut: bool,
    extra: np.ndarray | None,
) -> tuple[Pieces, np.ndarray, int, float]:
    """Pass 1 and pass 2's pieces of one step: its pieces (cut where they cost more than a
    group's fair share), micro-batches per group of each bucket, documents spilled to a
    shorter bucket, and the structural bound."""
    lengths = np.asarray(lengths, dtype=np.int64)
    doc_bucket = np.asarray(doc_bucket, dtype=np.int64).copy()
    seq = np.asarray([b.seq_len for b in buckets], dtype=np.int64)
    micro = np.asarray([b.micro_batches for b in buckets], dtype=np.int64)
    movable = np.ones(len(lengths), bool) if by_length is None else np.asarray(by_length, bool)
    spilled = spill(lengths, doc_bucket, movable, ladder(buckets), micro * seq * groups)
    doc, start = split_documents(lengths, seq[doc_bucket] if len(seq) > 1 else seq[0])
    piece_bucket = doc_bucket[doc]
    length = np.minimum(lengths[doc] - start, seq[piece_bucket])
    piece_extra = np.zeros(len(doc))
    if extra is not None:
        piece_extra = np.where(start == 0, np.asarray(extra, np.float64)[doc], 0.0)
    pieces = Pieces.new(doc, start, length, piece_bucket, piece_extra, cost)
    bound = structural_bound(pieces.cost, groups)
    if len(buckets) > 1:
        need = np.bincount(piece_bucket, length, len(buckets)).astype(np.int64)
    else:
        need = np.asarray([length.sum()], dtype=np.int64)
    micro = np.maximum(micro, -(-need // (seq * groups)))
    if cut and bound < 1.0:  # a piece costs more than a group's fair share
        _cut_costly(pieces, groups, cost)
    return pieces, micro, spilled, bound


def _pack(
    pieces: Pieces,
    micro: np.ndarray,
    spilled: int,
    bound: float,
    buckets: Sequence[Bucket],
    groups: int,
    cost: CostFunction,
    cut: bool,
) -> _Placed:
    """Pass 2 of one step's pieces (:func:`_prepare`)."""
    seq = np.asarray([b.seq_len for b in buckets], dtype=np.int64)
    while True:
        bins = Bins.new(seq, micro, groups)
        pieces.bin[:] = -1
        stuck = pack(pieces, bins, groups, cost, cut)
        if stuck is None:
            break
        micro[stuck] += 1  # cannot pack whole and may not cut: one more micro-batch
    return _Placed(pieces, bins, micro, spilled, bound)


def _polish_and_slide(placed: _Placed, groups: int, cost: CostFunction, cut: bool) -> None:
    """Passes 4 and 5 (module doc) of one step."""
    polish_groups(placed.pieces, placed.bins, groups)
    if cut:
        slide_cuts(placed.pieces, placed.bins, groups, cost)


def structural_bound(costs: np.ndarray, groups: int) -> float:
    """The best efficiency any split of these pieces reaches without cutting them: the mean
    group cost over the costliest piece (at most 1)."""
    peak = float(costs.max()) if len(costs) else 0.0
    return min(1.0, float(costs.sum()) / groups / peak) if peak > 0 else 1.0


def _cut_costly(p: Pieces, groups: int, cost: CostFunction) -> None:
    """Cut every piece that costs more than a group's fair share (the mean group cost) into
    as many parts of (nearly) equal tokens as it takes to cost no more than that; again while
    some do (cutting lowers attention cost, and so the fair share)."""
    for _ in range(8):
        fair = float(p.cost.sum()) / groups
        costly = ((p.cost > fair) & (p.length > 1)).nonzero()[0]
        if fair <= 0 or not len(costly):
            return
        k = np.minimum(np.ceil(p.cost[costly] / fair).astype(np.int64), p.length[costly])
        _cut_even(p, costly, np.maximum(k, 2), cost)


def _cut_even(p: Pieces, piece: np.ndarray, parts: np.ndarray, cost: CostFunction) -> None:
    """Cut each of ``piece`` (ascending) into ``parts`` parts of (nearly) equal tokens."""
    owner = piece.repeat(parts)
    within = np.arange(len(owner)) - (parts.cumsum() - parts).repeat(parts)
    base, extra = np.divmod(p.length[piece], parts)
    tokens = base.repeat(parts) + (within < extra.repeat(parts))
    p.cut(owner, tokens, cost)

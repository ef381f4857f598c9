"""Split one global batch among the DP groups and pack each group's share into micro-batches.

The global batch (its documents are fixed by the mix, whatever the DP size) becomes pieces of at
most a bucket's ``seq_len`` tokens. The goal is the smallest largest group cost (ranks wait for
the slowest one) under hard token limits: every micro-batch holds at most its ``seq_len``. Three
passes, all deterministic (ties go to the lower index), one module each::

    1 route    each document to a context bucket; a bucket over its capacity hands its
               shortest length-routed documents down to the next shorter bucket (.routing)
    2 place    pieces by decreasing cost (LPT): each goes to the least loaded group that has a
               micro-batch with room for it, into that group's cheapest such micro-batch (which
               also evens the micro-batches of a rank, what pipeline parallelism waits on); a
               piece that fits no micro-batch whole is cut into those with the most room (or,
               when cutting is not allowed, every group gets one more micro-batch of its
               bucket) (.placement)
    3 refine   heaviest group against the lightest ones: the move, swap, or exchange of one
               piece for a run of the other group's shortest pieces, that best evens the pair;
               groups it changed are packed again (.refine)

Worked example: 2 groups, 1 micro-batch of 8 tokens each, cost = L, pieces 6, 5, 3, 2::

    6 -> g0 (load 0)    5 -> g1 (0)    3 -> g1 (5 < 6)    2 -> g0 (6 < 8)
    loads 8, 8: efficiency mean/max = 1.0

A document's ``extra`` cost (the vision encoder's cost of its images, see :mod:`.cost`) is added
to its first piece, where its images sit, so groups are balanced on backbone and encoder cost
together; a piece cut while placing keeps it in its first chunk.

Pass 3 matters when every group is full of tokens: LPT can then only give the last pieces to
whoever has room, and only an exchange (a long piece for several short ones of as many tokens)
moves attention cost. ``benchmarks/balance.py --compare`` measures what each pass adds. The
result is an :class:`~.assignment.Assignment`; this module also exports the names its callers
use with it (``Bucket``, ``route``, ``split_documents``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from omniload_dask.batching.assignment import Assignment
from omniload_dask.batching.cost import CostFunction
from omniload_dask.batching.placement import Pieces, place
from omniload_dask.batching.refine import refine_groups
from omniload_dask.batching.routing import Bucket, ladder, route, spill, split_documents

__all__ = ["Assignment", "Bucket", "balance", "route", "split_documents"]


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
    spilled = spill(lengths, doc_bucket, movable, ladder(buckets), micro * seq * groups)
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
        pieces = Pieces.new(doc, start, length, costs, piece_bucket, piece_extra)
        stuck = place(pieces, seq, micro, groups, cost, cut)
        if stuck is None and refine:
            touched = refine_groups(pieces, micro * seq, groups)
            if touched.any():
                stuck = place(pieces, seq, micro, groups, cost, cut, redo=touched)
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

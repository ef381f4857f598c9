"""Which context bucket each document goes to, and cutting documents into pieces.

A plan may declare several context buckets (micro-batches of different ``seq_len``). A document
goes to the shortest bucket that holds it whole (or the longest, if none does), unless its
source is pinned to a bucket; a bucket that holds more tokens than its micro-batches can take
hands its shortest length-routed documents down to the next shorter bucket::

    buckets 4k x 2 and 16k x 1 per group, 1 group; documents 3k, 5k, 12k, 9k
    route    3k -> 4k     5k, 12k, 9k -> 16k (26k tokens: 10k over its 16k)
    spill    16k hands down its shortest: 5k (still 5k over), then 9k -> 4k
    then     4k bucket: 3k + 5k + 9k = 17k tokens in pieces of at most 4k, so balance() gives
             it 5 micro-batches per group instead of 2 (the step's tokens need them)

Pieces are at most their bucket's ``seq_len`` tokens (:func:`split_documents`). Where cuts are
allowed, a piece that costs more than a group's fair share (the mean group cost) is cut into as
many parts of equal tokens as it takes to cost no more (:func:`pieces_of`: pass 1 of a step).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from omniload_dask.batching.balance.pieces import Pieces
from omniload_dask.plan.cost import CostFunction

__all__ = [
    "Bucket", "StepPieces", "cut_even", "ladder", "pieces_of", "route", "spill",
    "split_documents", "structural_bound",
]  # fmt: skip


@dataclass(frozen=True)
class Bucket:
    """Micro-batches of at most ``seq_len`` tokens, ``micro_batches`` of them per group.

    A ``pinned`` bucket takes only the documents of the sources pinned to it.
    """

    seq_len: int
    micro_batches: int
    pinned: bool = False


def split_documents(
    lengths: np.ndarray, seq_len: int | np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Cut documents into pieces of at most ``seq_len`` tokens (a number, or one per document).

    Returns ``(doc index, start offset)`` per piece; piece lengths follow from them.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    size = np.asarray(seq_len, dtype=np.int64)  # (a number divides faster than an array)
    npieces = np.maximum(1, -(-lengths // size))
    doc = np.arange(len(lengths), dtype=np.int64).repeat(npieces)
    start = np.zeros(len(doc), dtype=np.int64)
    if len(doc) > len(lengths):  # only the pieces after a document's first start past 0
        long = (npieces > 1).nonzero()[0]
        count = npieces[long]
        first = npieces.cumsum()[long] - count  # each long document's first piece
        within = np.arange(int(count.sum())) - (count.cumsum() - count).repeat(count)
        step = np.broadcast_to(size, lengths.shape)[long]
        start[first.repeat(count) + within] = within * step.repeat(count)
    return doc, start


def ladder(buckets: Sequence[Bucket]) -> list[int]:
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
    free = ladder(buckets)
    if len(free) > 1:
        limits = np.asarray([buckets[b].seq_len for b in free], dtype=np.int64)
        pick = np.minimum(limits.searchsorted(lengths, side="left"), len(free) - 1)
        bucket = np.asarray(free, dtype=np.int64)[pick]
    elif free:  # one bucket takes them all
        bucket[:] = free[0]
    for source, b in (pinned or {}).items():
        mine = sources == source
        bucket[mine] = b
        by_length[mine] = False
    return bucket, by_length


def spill(
    lengths: np.ndarray,
    bucket: np.ndarray,
    movable: np.ndarray,
    ladder: list[int],
    capacity: np.ndarray,
    whole: np.ndarray | None = None,
) -> int:
    """Hand the shortest length-routed documents of an over-full bucket to the next shorter;
    with ``whole`` (each bucket's ``seq_len``, where documents may not be cut) only those that
    the shorter bucket holds whole."""
    spilled = 0
    for hi, lo in zip(ladder[:0:-1], ladder[-2::-1], strict=True):
        over = int(lengths[bucket == hi].sum() - capacity[hi])
        if over <= 0:
            continue
        cand = ((bucket == hi) & movable).nonzero()[0]
        if whole is not None:
            cand = cand[lengths[cand] <= whole[lo]]
        cand = cand[np.lexsort((cand, lengths[cand]))]
        take = int(lengths[cand].cumsum().searchsorted(over, side="left")) + 1
        bucket[cand[:take]] = lo
        spilled += min(take, len(cand))
    return spilled


@dataclass
class StepPieces:
    """A step after pass 1: its pieces (none placed yet), its micro-batches per group of each
    bucket, the documents it spilled to a shorter bucket, and its structural bound."""

    pieces: Pieces
    micro: np.ndarray
    spilled: int
    bound: float


def pieces_of(
    lengths: np.ndarray,
    doc_bucket: np.ndarray,
    buckets: Sequence[Bucket],
    groups: int,
    cost: CostFunction,
    by_length: np.ndarray | None,
    cut: bool,
    extra: np.ndarray | None,
    head: int = 1,
) -> StepPieces:
    """Pass 1 of one step (module doc): its pieces (cut where they cost more than a group's
    fair share, if ``cut``), micro-batches per group of each bucket (more than declared where
    the step's tokens need them), documents spilled to a shorter bucket, and the structural
    bound."""
    lengths = np.asarray(lengths, dtype=np.int64)
    doc_bucket = np.asarray(doc_bucket, dtype=np.int64).copy()
    seq = np.asarray([b.seq_len for b in buckets], dtype=np.int64)
    micro = np.asarray([b.micro_batches for b in buckets], dtype=np.int64)
    movable = np.ones(len(lengths), bool) if by_length is None else np.asarray(by_length, bool)
    spilled = spill(
        lengths, doc_bucket, movable, ladder(buckets), micro * seq * groups, None if cut else seq
    )
    doc, start = split_documents(lengths, seq[doc_bucket] if len(seq) > 1 else seq[0])
    piece_bucket = doc_bucket[doc]
    length = np.minimum(lengths[doc] - start, seq[piece_bucket])
    piece_extra = np.zeros(len(doc))
    if extra is not None:
        piece_extra = np.where(start == 0, np.asarray(extra, np.float64)[doc], 0.0)
    pieces = Pieces.new(doc, start, length, piece_bucket, piece_extra, cost)
    pieces.head = head
    bound = structural_bound(pieces.cost, groups)
    if len(buckets) > 1:
        need = np.bincount(piece_bucket, length, len(buckets)).astype(np.int64)
    else:
        need = np.asarray([length.sum()], dtype=np.int64)
    micro = np.maximum(micro, -(-need // (seq * groups)))
    if cut and bound < 1.0:  # a piece costs more than a group's fair share
        _cut_costly(pieces, groups, cost)
    return StepPieces(pieces, micro, spilled, bound)


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
        cut_even(p, costly, np.maximum(k, 2), cost)


def cut_even(p: Pieces, piece: np.ndarray, parts: np.ndarray, cost: CostFunction) -> None:
    """Cut each of ``piece`` (ascending) into ``parts`` parts of (nearly) equal tokens."""
    # Every part of every piece at once: its piece and its number within the piece (a
    # repeat and the offsets of a running sum); the first ``extra`` parts get a token more.
    owner = piece.repeat(parts)
    within = np.arange(len(owner)) - (parts.cumsum() - parts).repeat(parts)
    base, extra = np.divmod(p.length[piece], parts)
    tokens = base.repeat(parts) + (within < extra.repeat(parts))
    p.cut(owner, tokens, cost)

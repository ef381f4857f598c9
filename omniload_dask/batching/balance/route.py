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

Pieces are at most their bucket's ``seq_len`` tokens (:func:`split_documents`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Bucket", "ladder", "route", "spill", "split_documents"]


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
) -> int:
    """Hand the shortest length-routed documents of an over-full bucket to the next shorter."""
    spilled = 0
    for hi, lo in zip(ladder[:0:-1], ladder[-2::-1], strict=True):
        over = int(lengths[bucket == hi].sum() - capacity[hi])
        if over <= 0:
            continue
        cand = ((bucket == hi) & movable).nonzero()[0]
        cand = cand[np.lexsort((cand, lengths[cand]))]
        take = int(lengths[cand].cumsum().searchsorted(over, side="left")) + 1
        bucket[cand[:take]] = lo
        spilled += min(take, len(cand))
    return spilled

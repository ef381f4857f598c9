"""Labels of a packed micro-batch: the one place that decides which positions the loss counts.

A position's label is the next token of its document piece when that token is a target, else
-100 (:data:`IGNORE_INDEX`). Not targets: a document's first token (nothing predicts it), image
placeholders, the tokens a chat source's ``train_on`` rule leaves out (the shard's ``target``
mask), and nothing past a piece's last token (the next token lies in another micro-batch)::

    input_ids     [5 6 7 | 8 9 10]      two pieces, cu_seqlens [0 3 6]
    target        [T T T | T F T]        (9 is a prompt token of a chat)
    labels        [6 7 -100 -100 10 -100]
    positions     [T T F F T F]          loss_positions: where labels are not -100

Every path a micro-batch takes (wire form and :func:`~omniload_dask.batching.wire.expand`, context-parallel slices, the
fan-out, the DataLoader adapter, resume) gets its labels from :func:`derived`, so a mask holds
on each of them; pre-tokenized sources with masks go through the same function.

The data plane counts a step's loss positions without the tokens (``global_loss_tokens``, the
sum over every DP group and micro-batch): a read task reports each record's :class:`Holes`, the
spans of its tokens that are not targets (none for plain text), and a piece ``[lo, hi)`` of a
record has a loss position for each target among its tokens ``lo + 1 .. hi - 1``
(:func:`count_loss_tokens`)::

    record  [5 6 7 8 9 10]   holes [(0, 2)] (5 and 6 are a prompt)
    piece [0, 4): targets among 6 7 8 -> 7 8: 2      piece [4, 6): among 10 -> 1
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["IGNORE_INDEX", "Holes", "count_loss_tokens", "derived", "loss_positions"]

IGNORE_INDEX = -100


def derived(
    input_ids: np.ndarray,
    cu: np.ndarray,
    total: int,
    token_map: np.ndarray | None,
    target: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """``position_ids`` and ``labels`` of a packed micro-batch (padding: 0 and -100).

    Every feeder runs this on every micro-batch it yields: without images or a target mask
    the labels are the tokens shifted by one with each piece's last position set to -100
    (two vector copies, the same labels as :func:`loss_positions` selects)."""
    width = len(input_ids)
    bounds = cu.astype(np.int64)
    starts = np.repeat(bounds[:-1], bounds[1:] - bounds[:-1])
    position_ids = np.zeros(width, dtype=np.int64)
    np.subtract(np.arange(total, dtype=np.int64), starts, out=position_ids[:total])
    labels = np.full(width, IGNORE_INDEX, dtype=np.int64)
    if token_map is None and target is None:
        if total:
            labels[: total - 1] = input_ids[1:total]
            # (a piece's last position; -1 for an empty first piece is the last position,
            # which no label reaches: it stays -100 either way)
            labels[bounds[1:] - 1] = IGNORE_INDEX
        return position_ids, labels
    counts = loss_positions(cu, total, token_map, target)
    at = np.flatnonzero(counts)  # (never a piece's last token: at + 1 stays inside)
    labels[at] = input_ids[at + 1]
    return position_ids, labels


def loss_positions(
    cu: np.ndarray, total: int, token_map: np.ndarray | None, target: np.ndarray | None
) -> np.ndarray:
    """Which of a micro-batch's ``total`` positions have a label the loss counts: not a
    piece's last token, not before an image placeholder or a token that is no target."""
    counts = np.zeros(total, dtype=bool)
    if total:
        counts[: total - 1] = True
        counts[cu[1:] - 1] = False
        if token_map is not None:  # image placeholders are never targets
            counts[: total - 1] &= token_map[1:total] < 0
        if target is not None:
            counts[: total - 1] &= target[1:total]
    return counts


@dataclass(frozen=True)
class Holes:
    """The tokens of each record that are not targets, as spans: record r's are
    ``spans[bounds[r]:bounds[r + 1]]``, each ``(start, stop)`` counted from the record's first
    token, ascending and disjoint. A record of plain text has none."""

    bounds: np.ndarray  # int64 (records + 1)
    spans: np.ndarray  # int64 (spans, 2)

    @classmethod
    def of(cls, offsets: np.ndarray, target: np.ndarray | None) -> Holes | None:
        """The holes of records ``offsets`` (token offsets, records + 1) whose tokens are
        targets where ``target`` (bool per token) says so; None when every token is one."""
        if target is None or bool(target.all()):
            return None
        off = np.asarray(offsets, dtype=np.int64)
        hole = ~np.asarray(target, dtype=bool)
        edge = np.zeros(len(hole) + 1, dtype=bool)  # a run starts or stops here
        edge[0] = edge[-1] = True
        edge[off] = True  # (runs never cross a record's boundary)
        change = np.flatnonzero(np.diff(hole.astype(np.int8)) != 0) + 1
        edge[change] = True
        cuts = np.flatnonzero(edge)
        starts, stops = cuts[:-1], cuts[1:]
        keep = hole[starts] if len(hole) else np.zeros(0, dtype=bool)
        starts, stops = starts[keep], stops[keep]
        record = np.searchsorted(off, starts, side="right") - 1
        spans = np.stack([starts, stops], axis=1) - off[record][:, None]
        bounds = np.searchsorted(record, np.arange(len(off)), side="left").astype(np.int64)
        return cls(bounds, spans.astype(np.int64).reshape(-1, 2))

    @classmethod
    def join(cls, portions: Sequence[tuple[int, Holes | None]]) -> Holes | None:
        """The holes of portions read one after another, ``(records, holes)`` each (a unit
        read in portions): their records numbered on, in order; None when none has any."""
        if all(h is None for _, h in portions):
            return None
        counts = [
            np.diff(h.bounds) if h is not None else np.zeros(n, dtype=np.int64) for n, h in portions
        ]
        bounds = np.zeros(sum(len(c) for c in counts) + 1, dtype=np.int64)
        np.cumsum(np.concatenate(counts), out=bounds[1:])
        spans = [h.spans for _, h in portions if h is not None]
        return cls(bounds, np.concatenate(spans).reshape(-1, 2))

    def select(self, start: int, stop: int, keep: np.ndarray | None = None) -> Holes:
        """The holes of records ``start .. stop - 1``, numbered from 0 (``keep``: a bool per
        one of them, the records that stay; the others are left out, as a read leaves out
        the empty records it skips)."""
        counts = np.diff(self.bounds[start : stop + 1])
        spans = self.spans[int(self.bounds[start]) : int(self.bounds[stop])]
        if keep is not None:
            spans, counts = spans[np.repeat(keep, counts)], counts[keep]
        bounds = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=bounds[1:])
        return Holes(bounds, spans.reshape(-1, 2))

    def to_wire(self) -> tuple[bytes, bytes]:
        """Its spans per record and the spans, as int32 bytes (a read task's report)."""
        return np.diff(self.bounds).astype(np.int32).tobytes(), self.spans.astype(
            np.int32
        ).tobytes()

    @classmethod
    def from_wire(cls, counts: bytes, spans: bytes) -> Holes:
        """What :meth:`to_wire` gave."""
        c = np.frombuffer(counts, dtype=np.int32)
        bounds = np.zeros(len(c) + 1, dtype=np.int64)
        np.cumsum(c, out=bounds[1:])
        return cls(bounds, np.frombuffer(spans, dtype=np.int32).astype(np.int64).reshape(-1, 2))


def count_loss_tokens(
    lo: np.ndarray, hi: np.ndarray, holes: Holes | None = None, records: np.ndarray | None = None
) -> int:
    """Loss positions of record pieces ``[lo[i], hi[i])``: the targets among each piece's
    tokens after its first (module docstring); piece i is of record ``records[i]`` of
    ``holes`` (None: every token a target). The same count as :func:`loss_positions` gives
    for the micro-batches that hold the pieces."""
    lo, hi = np.asarray(lo, dtype=np.int64), np.asarray(hi, dtype=np.int64)
    total = int(np.maximum(hi - lo - 1, 0).sum())
    if holes is None or records is None or not len(holes.spans):
        return total
    first = holes.bounds[records]
    count = holes.bounds[records + 1] - first
    piece = np.repeat(np.arange(len(lo)), count)
    before = np.cumsum(count) - count
    at = np.repeat(first - before, count) + np.arange(int(count.sum()), dtype=np.int64)
    a = np.maximum(holes.spans[at, 0], lo[piece] + 1)
    b = np.minimum(holes.spans[at, 1], hi[piece])
    return total - int(np.maximum(b - a, 0).sum())

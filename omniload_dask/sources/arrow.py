"""Hugging Face ``datasets`` folders written by ``save_to_disk``: Arrow IPC stream files.

``save_to_disk`` writes ``data-00000-of-0000N.arrow`` files (the Arrow streaming format: a
schema message, then record batches of ``writer_batch_size`` rows) beside ``state.json`` and
``dataset_info.json``. The source's path is the folder (or globs of ``.arrow`` files); its
records are rows, either a column of token ids (``sources[].tokens``, e.g. ``input_ids``: a list
of integers per row, no tokenizer runs; with ``sources[].mask``, a ``loss_mask`` or ``labels``
column beside it) or a text column (``sources[].text``) that the plan's tokenizer turns into
tokens. A record's offset is its row number in its file.

A stream file has no footer to seek by, so discovery reads each file through once, message by
message: where each record batch starts, its rows and, for a token column, every row's length
(the list offsets), so the data plane plans token sources before any read reports; with a mask
column also each row's tokens that are not targets (:func:`.token_masks.mask_holes`, from the
same batches), which the data plane's loss-token counts need. Units are
record batches (or runs of ``unit_records`` rows of one). A read seeks to its batch; a worker
finds where a file's batches start from the same walk, done once per file and process::

    file   [schema][batch 0: rows 0-999][batch 1: rows 1000-1049][end]
    units  (f, 0, 1000) (f, 1000, 1050)        read (f, 1000, 1050): seek to batch 1
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import numpy as np
import pyarrow as pa

from omniload_dask.batching.labels import Holes
from omniload_dask.errors import SourceError
from omniload_dask.plan import SourceSpec
from omniload_dask.sources.base import RawRecords, Units
from omniload_dask.sources.files import open_file
from omniload_dask.sources.ids import MAX_OFFSET
from omniload_dask.sources.parquet import column_texts
from omniload_dask.sources.token_arrays import check_token_field, list_column
from omniload_dask.sources.token_masks import (
    check_mask_field,
    mask_holes,
    mask_list_column,
    masked_records,
)

__all__ = ["FORMAT", "ArrowFolder", "text_records", "token_records"]


class ArrowFolder:
    """The Arrow format (``save_to_disk`` folders): units are record batches."""

    name: str = "arrow"
    extensions: tuple[str, ...] = (".arrow",)

    def units(
        self,
        spec: SourceSpec,
        fs: Any,
        files: list[str],
        sizes: list[int],
        skip_unreadable: bool = False,
    ) -> Units:
        """Record batches of every file (cut into ``unit_records`` rows where set); for a token
        column every row's length as well."""
        rows: list[tuple[int, int, int]] = []
        lengths: list[np.ndarray] = []
        holes: list[tuple[int, Holes | None]] = []  # (records, their holes) per file
        for i, url in enumerate(files):
            layout = _walk(spec, fs, url, with_lengths=spec.tokens is not None)
            if layout.rows >= MAX_OFFSET:
                raise SourceError(f"source {spec.name!r}: file {url!r}: {layout.rows} rows")
            for first, count in zip(layout.firsts, layout.counts, strict=True):
                step = spec.unit_records or max(count, 1)
                rows.extend(
                    (i, lo, min(lo + step, first + count))
                    for lo in range(first, first + count, step)
                )
            if layout.lengths is not None:
                lengths.append(layout.lengths)
                holes.append((len(layout.lengths), layout.holes))
        table = np.asarray(rows, dtype=np.int64).reshape(-1, 3)
        counts = table[:, 2] - table[:, 1]
        if spec.tokens is None:
            return Units(table, counts, split="rows")
        index = np.zeros(len(table) + 1, np.int64)
        np.cumsum(counts, out=index[1:])
        flat = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
        known = spec.mask is not None and all(h is not None for _, h in holes)
        return Units(table, counts, split="rows", lengths=flat, length_index=index,
                     holes=_joined(holes, len(flat)) if known else None)  # fmt: skip

    def read(self, spec: SourceSpec, fs: Any, path: str, start: int, stop: int) -> RawRecords:
        """Rows ``[start, stop)`` of one file: token ids, or texts for the tokenizer."""
        url = fs.unstrip_protocol(path)
        layout = _layout(fs, path, url, spec.name)
        first = int(np.searchsorted(layout.firsts, start, side="right")) - 1
        last = int(np.searchsorted(layout.firsts, stop, side="left"))
        column = spec.tokens or spec.text
        names = [column] if spec.mask is None else [column, spec.mask.column]
        pieces: list[list[Any]] = [[] for _ in names]
        with open_file(fs, path) as f:
            for b in range(first, last):
                f.seek(int(layout.positions[b]))
                batch = pa.ipc.read_record_batch(pa.ipc.read_message(f), layout.schema)
                lo = max(start - int(layout.firsts[b]), 0)
                hi = min(stop - int(layout.firsts[b]), batch.num_rows)
                for got, name in zip(pieces, names, strict=True):
                    got.append(batch.column(name).slice(lo, hi - lo))
        values = [
            pa.chunked_array(got, type=layout.schema.field(name).type)
            for got, name in zip(pieces, names, strict=True)
        ]
        if spec.tokens is not None:
            return token_records(spec, values[0], start, values[1] if spec.mask else None)
        return text_records(spec, values[0], start)


def token_records(spec: SourceSpec, column: Any, first_row: int, mask: Any = None) -> RawRecords:
    """Rows of a token-id column (lists of integers) from row ``first_row`` on, with their
    targets from the ``mask`` column where the source has one; a null row is a bad record."""
    flat, lengths, null_rows = list_column(column)
    offsets = np.arange(first_row, first_row + len(lengths), dtype=np.int64)
    why = f"column {spec.tokens!r} is null or holds a null id"
    if mask is not None:
        values, value_lengths, null_masks = mask_list_column(mask)
        reasons = dict.fromkeys(np.flatnonzero(null_rows).tolist(), why)
        assert spec.mask is not None
        for r in np.flatnonzero(null_masks & ~null_rows).tolist():
            reasons[r] = f"mask column {spec.mask.column!r} is null or holds a null value"
        return masked_records(spec, flat, lengths, values, value_lengths, offsets, reasons)
    bad = [(int(r), why) for r in offsets[null_rows].tolist()]
    keep = ~null_rows
    return RawRecords.of_tokens(flat, lengths[keep], offsets[keep], bad)


def text_records(spec: SourceSpec, column: Any, first_row: int) -> RawRecords:
    """Rows of a text column from row ``first_row`` on; a null or non-UTF-8 row is bad."""
    texts, rows, bad, _ = column_texts(spec, column, first_row)
    return RawRecords(texts, rows, bad)


class _Layout:
    """Where a stream file's record batches start, their first rows and sizes."""

    def __init__(self, schema: Any, positions: list[int], counts: list[int]) -> None:
        self.schema = schema
        self.positions = np.asarray(positions, np.int64)
        self.counts = np.asarray(counts, np.int64)
        self.firsts = np.concatenate([[0], np.cumsum(self.counts)[:-1]]).astype(np.int64)
        self.rows = int(self.counts.sum())
        self.lengths: np.ndarray | None = None
        self.holes: Holes | None = None  # with a mask column: its tokens that are not targets


def _walk(spec: SourceSpec, fs: Any, url: str, with_lengths: bool, check: bool = True) -> _Layout:
    """Read one stream file through: its schema (checked), batches and token lengths."""
    where = f"source {spec.name!r}: file {url!r}"
    positions, counts, lengths = [], [], []
    holes: list[tuple[int, Holes | None]] = []  # (rows, their holes) per batch, with a mask
    with open_file(fs, fs._strip_protocol(url)) as f:
        try:
            schema = pa.ipc.read_schema(pa.ipc.read_message(f))
        except Exception as exc:
            raise SourceError(
                f"{where} is not an Arrow stream file as save_to_disk writes ({exc})"
            ) from None
        if check:
            _check_column(spec, url, schema)
        while True:
            at = f.tell()
            try:
                message = pa.ipc.read_message(f)
            except EOFError:
                break
            except Exception as exc:
                raise SourceError(
                    f"{where}: unreadable Arrow message at byte {at} ({exc}); is the file "
                    "truncated?"
                ) from None
            if message.type != "record batch":
                raise SourceError(f"{where}: a {message.type} message at byte {at} (not read)")
            batch = pa.ipc.read_record_batch(message, schema)
            positions.append(at)
            counts.append(batch.num_rows)
            if with_lengths:
                _, got, null_ids = list_column(batch.column(spec.tokens))
                lengths.append(got)
                if spec.mask is not None:  # (the batch holds the mask column already)
                    mask = batch.column(spec.mask.column)
                    holes.append((len(got), mask_holes(spec, got, null_ids, mask)))
    layout = _Layout(schema, positions, counts)
    if with_lengths:
        layout.lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
        if spec.mask is not None and all(h is not None for _, h in holes):
            layout.holes = _joined(holes, len(layout.lengths))
    return layout


def _joined(parts: list[tuple[int, Holes | None]], records: int) -> Holes:
    """The holes of record runs ``(records, holes)`` one after another (every run's known)."""
    none = Holes(np.zeros(records + 1, np.int64), np.zeros((0, 2), np.int64))
    return Holes.join(parts) or none


def _check_column(spec: SourceSpec, url: str, schema: Any) -> None:
    """The source's token column (a list of integers) or text column (strings) is there."""
    if spec.tokens is not None:
        check_token_field(spec, url, schema)
        if spec.mask is not None:
            check_mask_field(spec, url, schema)
        return
    if spec.text not in schema.names:
        raise SourceError(
            f"source {spec.name!r}: file {url!r} has no column {spec.text!r} "
            f"(columns: {', '.join(schema.names)}); set sources[].text or sources[].tokens"
        )
    kind = schema.field(spec.text).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise SourceError(
            f"source {spec.name!r}: file {url!r}: column {spec.text!r} has type {kind}, "
            "expected strings (a column of token ids is named by sources[].tokens)"
        )


_lock = threading.Lock()


def _layout(fs: Any, path: str, url: str, source: str) -> _Layout:
    """A file's batch layout, walked once per process (:func:`_walk` without lengths)."""
    with _lock:
        return _cached_layout(fs, path, url, source)


@functools.lru_cache(maxsize=1024)
def _cached_layout(fs: Any, path: str, url: str, source: str) -> _Layout:
    spec = SourceSpec(source, "arrow", (url,), 1.0)
    return _walk(spec, fs, url, with_lengths=False, check=False)


FORMAT = ArrowFolder()

"""Parquet: read units are runs of rows inside one row group; text and image columns by name.

A unit is ``(file index, first row, stop row)`` in the file's row numbers: a whole row group,
or with ``sources[].unit_records`` runs of at most that many rows of one row group::

    row groups of 100 rows, unit_records 40 -> (0, 40) (40, 80) (80, 100) (100, 140) ...

Discovery reads every file's footer once (row groups, row counts, schema), so a corrupt file or
a missing or mistyped column fails at start-up, naming the file. A record's offset is its row
number in the file.

Image-text sources name the image column with ``sources[].image``. It may hold the encoded image
(``binary``), a struct with a ``bytes`` field (the Hugging Face ``Image`` feature), or a list of
either (several images per record, in order; an empty list is a text-only record). A chat source
may have one too: its images go where its conversations mark them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from omniload_dask.errors import SourceError
from omniload_dask.plan import SourceSpec
from omniload_dask.sources.base import RawRecords, Units
from omniload_dask.sources.chat import conversation
from omniload_dask.sources.decoding import WatchedFile
from omniload_dask.sources.files import open_file
from omniload_dask.sources.ids import MAX_OFFSET
from omniload_dask.sources.parquet_pages import has_page_checksums

_T = TypeVar("_T")


class Parquet:
    """The Parquet format: units are row runs of one row group; text and images by column."""

    name: str = "parquet"
    extensions: tuple[str, ...] = (".parquet", ".pq")

    def units(
        self,
        spec: SourceSpec,
        fs: Any,
        files: list[str],
        sizes: list[int],
        skip_unreadable: bool = False,
    ) -> Units:
        """Row groups (or runs of ``unit_records`` rows of one), from every file's footer; the
        schema is checked on the way.

        A file whose footer is not Parquet fails, or with ``skip_unreadable`` becomes one unit
        of one row, whose read reports the file as one bad record.
        """

        def check(url: str, schema: pa.Schema) -> None:
            _text_field(spec, url, schema)
            if spec.has_images:
                _image_kind(spec, url, schema)

        return row_group_units(spec, fs, files, check, skip_unreadable)

    @staticmethod
    def _footer(spec: SourceSpec, fs: Any, url: str) -> pq.FileMetaData:
        """The file's metadata; :class:`_Unreadable` (a SourceError) if its bytes are not
        Parquet, a SourceError naming the file if the storage fails."""
        with open_file(fs, fs._strip_protocol(url)) as raw:
            f = WatchedFile(raw)
            try:
                return pq.ParquetFile(f).metadata
            except Exception as exc:
                if f.failure is not None:
                    raise SourceError(
                        f"source {spec.name!r}: file {url!r}: cannot read it "
                        f"({type(exc).__name__}: {exc})"
                    ) from None
                raise _Unreadable(
                    f"source {spec.name!r}: file {url!r} is not a readable Parquet file ({exc})"
                ) from None

    def read(self, spec: SourceSpec, fs: Any, path: str, start: int, stop: int) -> RawRecords:
        """Rows ``[start, stop)`` of the file (they lie in one or more whole or part row groups).

        Rows whose bytes cannot be decoded (a corrupt page, a file that is not Parquet) are bad
        records, one per row, so skipping them never depends on how the rows are split. Page
        checksums are verified where the file has them (:mod:`.parquet_pages`): a page whose
        bytes changed fails so even when it still decodes.
        """
        url = fs.unstrip_protocol(path)
        columns = [*spec.chat.columns] if spec.chat is not None else [spec.text]
        columns += spec.image
        with open_file(fs, path) as raw:
            f = WatchedFile(raw)
            try:
                pf = pq.ParquetFile(f, page_checksum_verification=True)
            except Exception as exc:
                if f.failure is not None:
                    raise
                return _unreadable(
                    start,
                    stop,
                    f"the file is not readable Parquet ({exc}); none of its rows can be read",
                )
            _text_field(spec, url, pf.schema_arrow)
            if spec.has_images:
                _image_kind(spec, url, pf.schema_arrow)
            meta = pf.metadata
            bounds = np.cumsum(
                [0] + [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
            )
            first_group = int(np.searchsorted(bounds, start, side="right")) - 1
            last_group = int(np.searchsorted(bounds, stop, side="left"))
            groups = list(range(first_group, last_group))
            try:
                table = pf.read_row_groups(groups, columns=columns)
            except Exception as exc:
                if f.failure is not None:
                    raise
                where = f"row group {groups[0]}" if len(groups) == 1 else f"row groups {groups}"
                what = "fails its page checksum" if "CRC" in str(exc) else "cannot be decoded"
                return _unreadable(start, stop, f"{where} {what} ({type(exc).__name__}: {exc})")
        table = table.slice(start - int(bounds[first_group]), stop - start)
        if spec.chat is not None:
            chats = _chats(spec, table, start)
            if not spec.has_images:
                return chats
            keep = (chats.offsets - start).tolist()
            images, offsets, convs, bad = _images(
                spec, table.column(spec.image[0]), start, keep, chats.chats or [], chats.bad
            )
            return RawRecords([""] * len(convs), offsets, bad, images=images, chats=convs)
        texts, offsets, bad, keep = column_texts(spec, table.column(0), start)
        if not spec.has_images:
            return RawRecords(texts=texts, offsets=offsets, bad=bad)
        images, offsets, texts, bad = _images(spec, table.column(1), start, keep, texts, bad)
        return RawRecords(texts=texts, offsets=offsets, bad=bad, images=images)

    def checksums(self, fs: Any, url: str) -> bool | None:
        """Whether the file carries page checksums (None: it cannot tell; ``validate``)."""
        with open_file(fs, fs._strip_protocol(url)) as raw:
            try:
                return has_page_checksums(pq.ParquetFile(raw).metadata, raw)
            except Exception:
                return None


class _Unreadable(SourceError):
    """A file's bytes are not Parquet (not an I/O failure)."""


def _unreadable(start: int, stop: int, reason: str) -> RawRecords:
    """Rows ``[start, stop)`` as bad records: ``reason`` says why they cannot be read."""
    return RawRecords(
        texts=[],
        offsets=np.zeros(0, dtype=np.int64),
        bad=[(row, reason) for row in range(start, stop)],
    )


def row_group_units(
    spec: SourceSpec,
    fs: Any,
    files: list[str],
    check: Callable[[str, pa.Schema], None],
    skip_unreadable: bool = False,
) -> Units:
    """Read units of Parquet files (text, images or token columns): each row group, or runs of
    ``unit_records`` rows of one, from every file's footer; ``check(url, schema)`` checks the
    columns the source reads. A file whose footer is not Parquet fails, or with
    ``skip_unreadable`` becomes one unit of one row whose read reports it as one bad record."""
    units: list[tuple[int, int, int]] = []
    for i, url in enumerate(files):
        try:
            meta = Parquet._footer(spec, fs, url)
        except _Unreadable:
            if not skip_unreadable:
                raise
            units.append((i, 0, 1))
            continue
        check(url, meta.schema.to_arrow_schema())
        if meta.num_rows >= MAX_OFFSET:
            raise SourceError(
                f"source {spec.name!r}: file {url!r} has {meta.num_rows} rows; "
                f"at most {MAX_OFFSET - 1}"
            )
        first = 0
        for rg in range(meta.num_row_groups):
            n = meta.row_group(rg).num_rows
            step = spec.unit_records or max(n, 1)
            units.extend((i, lo, min(lo + step, first + n)) for lo in range(first, first + n, step))
            first += n
    table = np.asarray(units, dtype=np.int64).reshape(-1, 3)
    return Units(table, table[:, 2] - table[:, 1], split="rows")


def column_texts(
    spec: SourceSpec, column: Any, first_row: int
) -> tuple[list[str], np.ndarray, list[tuple[int, str]], list[int]]:
    """The strings of a text column (Parquet, Arrow) from row ``first_row`` on: texts, their
    rows, bad rows (null, not UTF-8) with reasons, and the kept rows' indices in ``column``."""
    if pa.types.is_dictionary(column.type):
        column = column.cast(column.type.value_type)
    texts: list[str] = []
    rows: list[int] = []
    bad: list[tuple[int, str]] = []
    for row, value in enumerate(column.to_pylist(), start=first_row):
        if value is None:
            bad.append((row, f"column {spec.text!r} is null"))
        elif isinstance(value, bytes):
            try:
                texts.append(value.decode("utf-8"))
                rows.append(row)
            except UnicodeDecodeError as exc:
                bad.append((row, f"column {spec.text!r} is not UTF-8 ({exc})"))
        else:
            texts.append(value)
            rows.append(row)
    return texts, np.asarray(rows, dtype=np.int64), bad, [r - first_row for r in rows]


def _images(
    spec: SourceSpec,
    column: Any,
    first_row: int,
    keep: list[int],
    texts: list[_T],
    bad: list[tuple[int, str]],
) -> tuple[list[list[bytes]], np.ndarray, list[_T], list[tuple[int, str]]]:
    """Each kept record's encoded images; records whose image cell is unusable become bad.
    ``texts`` are the kept records' texts (or conversations), returned for those still kept."""
    name = spec.image[0]
    values = column.to_pylist()
    images: list[list[bytes]] = []
    out_texts: list[_T] = []
    rows: list[int] = []
    for text, index in zip(texts, keep, strict=True):
        row = first_row + index
        cell = values[index]
        items = cell if isinstance(cell, list) else [cell]
        blobs: list[bytes] = []
        reason = None
        for j, item in enumerate(items):
            blob = item.get("bytes") if isinstance(item, dict) else item
            if blob is None:
                where = f"column {name!r}" + (f" item {j}" if isinstance(cell, list) else "")
                reason = f"{where} holds no image bytes (null)"
                break
            blobs.append(blob)
        if reason is not None:
            bad.append((row, reason))
            continue
        images.append(blobs)
        out_texts.append(text)
        rows.append(row)
    bad.sort()
    return images, np.asarray(rows, dtype=np.int64), out_texts, bad


def _chats(spec: SourceSpec, table: pa.Table, first_row: int) -> RawRecords:
    """A chat source's rows as conversations (:mod:`omniload_dask.sources.chat`)."""
    assert spec.chat is not None
    chats: list[Any] = []
    rows: list[int] = []
    bad: list[tuple[int, str]] = []
    records = table.select(list(spec.chat.columns)).to_pylist()  # (not the image bytes)
    for row, record in enumerate(records, start=first_row):
        chat = conversation(spec.chat, record)
        if isinstance(chat, str):
            bad.append((row, chat))
        else:
            chats.append(chat)
            rows.append(row)
    offsets = np.asarray(rows, dtype=np.int64)
    return RawRecords(texts=[""] * len(chats), offsets=offsets, bad=bad, chats=chats)


def _text_field(spec: SourceSpec, url: str, schema: pa.Schema) -> pa.Field | None:
    if spec.chat is not None:  # conversations: lists of structs or strings, checked per record
        for name in spec.chat.columns:
            if name not in schema.names:
                raise SourceError(
                    f"source {spec.name!r}: file {url!r} has no column {name!r} "
                    f"(columns: {', '.join(schema.names)}); set sources[].chat.field"
                )
        return None
    if spec.text not in schema.names:
        raise SourceError(
            f"source {spec.name!r}: file {url!r} has no column {spec.text!r} "
            f"(columns: {', '.join(schema.names)}); set sources[].text"
        )
    field = schema.field(spec.text)
    kind = field.type.value_type if pa.types.is_dictionary(field.type) else field.type
    if not (
        pa.types.is_string(kind)
        or pa.types.is_large_string(kind)
        or pa.types.is_binary(kind)
        or pa.types.is_large_binary(kind)
        or pa.types.is_string_view(kind)
    ):
        raise SourceError(
            f"source {spec.name!r}: file {url!r}: column {spec.text!r} has type {field.type}, "
            "expected a string column"
        )
    return field


def _is_blob(kind: pa.DataType) -> bool:
    if pa.types.is_struct(kind):
        names = [kind.field(i).name for i in range(kind.num_fields)]
        return "bytes" in names and _is_blob(kind.field("bytes").type)
    return (
        pa.types.is_binary(kind) or pa.types.is_large_binary(kind) or pa.types.is_binary_view(kind)
    )


def _image_kind(spec: SourceSpec, url: str, schema: pa.Schema) -> None:
    """Check the image column: binary, struct{bytes}, or a list of those."""
    name = spec.image[0]
    if name not in schema.names:
        raise SourceError(
            f"source {spec.name!r}: file {url!r} has no column {name!r} "
            f"(columns: {', '.join(schema.names)}); set sources[].image"
        )
    kind = schema.field(name).type
    inner = kind.value_type if pa.types.is_list(kind) or pa.types.is_large_list(kind) else kind
    if not _is_blob(inner):
        raise SourceError(
            f"source {spec.name!r}: file {url!r}: column {name!r} has type {kind}, expected "
            "encoded images: binary, struct<bytes: binary>, or a list of either"
        )


FORMAT = Parquet()

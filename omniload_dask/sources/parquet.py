"""Parquet: one read unit per row group; the text column is named by ``sources[].text``.

Discovery reads every file's footer once (row groups, row counts, schema), so a corrupt file or
a missing or non-text column fails at start-up, naming the file. A record's offset is its row
number in the file.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import SourceError
from ..plan import SourceSpec
from .base import RawRecords, open_file
from .ids import MAX_OFFSET


class Parquet:
    name: str = "parquet"
    extensions: tuple[str, ...] = (".parquet", ".pq")

    def units(
        self,
        spec: SourceSpec,
        fs: Any,
        files: list[str],
        sizes: list[int],
    ) -> tuple[np.ndarray, np.ndarray]:
        units: list[tuple[int, int, int]] = []
        rows: list[int] = []
        for i, url in enumerate(files):
            meta = self._footer(spec, fs, url)
            _text_field(spec, url, meta.schema.to_arrow_schema())
            if meta.num_rows >= MAX_OFFSET:
                raise SourceError(
                    f"source {spec.name!r}: file {url!r} has {meta.num_rows} rows; "
                    f"at most {MAX_OFFSET - 1}"
                )
            for rg in range(meta.num_row_groups):
                units.append((i, rg, rg + 1))
                rows.append(meta.row_group(rg).num_rows)
        return (np.asarray(units, dtype=np.int64).reshape(-1, 3), np.asarray(rows, dtype=np.int64))

    def _footer(self, spec: SourceSpec, fs: Any, url: str) -> pq.FileMetaData:
        try:
            with open_file(fs, fs._strip_protocol(url)) as f:
                return pq.ParquetFile(f).metadata
        except (pa.ArrowInvalid, pa.ArrowException, OSError) as exc:
            raise SourceError(
                f"source {spec.name!r}: file {url!r} is not a readable Parquet file ({exc})"
            ) from None

    def read(self, spec: SourceSpec, fs: Any, path: str, start: int, stop: int) -> RawRecords:
        url = fs.unstrip_protocol(path)
        with open_file(fs, path) as f:
            pf = pq.ParquetFile(f)
            _text_field(spec, url, pf.schema_arrow)
            first_row = sum(pf.metadata.row_group(g).num_rows for g in range(start))
            table = pf.read_row_groups(list(range(start, stop)), columns=[spec.text])
        column = table.column(0)
        if pa.types.is_dictionary(column.type):
            column = column.cast(column.type.value_type)
        values = column.to_pylist()
        texts: list[str] = []
        offsets: list[int] = []
        bad: list[tuple[int, str]] = []
        for row, value in enumerate(values, start=first_row):
            if value is None:
                bad.append((row, f"column {spec.text!r} is null"))
            elif isinstance(value, bytes):
                try:
                    texts.append(value.decode("utf-8"))
                    offsets.append(row)
                except UnicodeDecodeError as exc:
                    bad.append((row, f"column {spec.text!r} is not UTF-8 ({exc})"))
            else:
                texts.append(value)
                offsets.append(row)
        return RawRecords(texts=texts, offsets=np.asarray(offsets, dtype=np.int64), bad=bad)


def _text_field(spec: SourceSpec, url: str, schema: pa.Schema) -> pa.Field:
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


FORMAT = Parquet()

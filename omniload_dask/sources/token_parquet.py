"""Parquet with a column of token ids (``sources[].tokens``): pre-tokenized Parquet sets.

Units are row groups, or runs of ``unit_records`` rows of one, as for text Parquet
(:mod:`.parquet`); discovery reads every footer and checks that the column is a list of
integers. A footer gives row counts, not list lengths, so a unit's lengths come with its read.
A record's offset is its row number in the file; a null row (or one holding a null id) is a
bad record.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow.parquet as pq

from omniload_dask.errors import SourceError
from omniload_dask.plan import SourceSpec
from omniload_dask.sources.arrow import token_records
from omniload_dask.sources.base import RawRecords, Units
from omniload_dask.sources.decoding import WatchedFile
from omniload_dask.sources.files import open_file
from omniload_dask.sources.ids import MAX_OFFSET
from omniload_dask.sources.token_arrays import check_token_field

__all__ = ["FORMAT", "TokenParquet"]


class TokenParquet:
    """Parquet read for its token-id column: row-group units, lengths from the reads."""

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
        """Row groups (or runs of ``unit_records`` rows of one) from every footer."""
        units: list[tuple[int, int, int]] = []
        for i, url in enumerate(files):
            with open_file(fs, fs._strip_protocol(url)) as raw:
                f = WatchedFile(raw)
                try:
                    meta = pq.ParquetFile(f).metadata
                except Exception as exc:
                    if f.failure is not None or not skip_unreadable:
                        raise SourceError(
                            f"source {spec.name!r}: file {url!r} is not a readable Parquet "
                            f"file ({type(exc).__name__}: {exc})"
                        ) from None
                    units.append((i, 0, 1))  # its read reports the file as one bad record
                    continue
            check_token_field(spec, url, meta.schema.to_arrow_schema())
            if meta.num_rows >= MAX_OFFSET:
                raise SourceError(f"source {spec.name!r}: file {url!r}: {meta.num_rows} rows")
            first = 0
            for g in range(meta.num_row_groups):
                n = meta.row_group(g).num_rows
                step = spec.unit_records or max(n, 1)
                units.extend(
                    (i, lo, min(lo + step, first + n)) for lo in range(first, first + n, step)
                )
                first += n
        table = np.asarray(units, dtype=np.int64).reshape(-1, 3)
        return Units(table, table[:, 2] - table[:, 1], split="rows")

    def read(self, spec: SourceSpec, fs: Any, path: str, start: int, stop: int) -> RawRecords:
        """Rows ``[start, stop)``: their token ids; rows that cannot be decoded are bad."""
        with open_file(fs, path) as raw:
            f = WatchedFile(raw)
            try:
                pf = pq.ParquetFile(f)
                meta = pf.metadata
                bounds = np.cumsum(
                    [0] + [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
                )
                a = int(np.searchsorted(bounds, start, side="right")) - 1
                b = int(np.searchsorted(bounds, stop, side="left"))
                table = pf.read_row_groups(list(range(a, b)), columns=[spec.tokens])
            except Exception as exc:
                if f.failure is not None:
                    raise
                reason = f"cannot be decoded ({type(exc).__name__}: {exc})"
                empty = np.zeros(0, np.int64)
                return RawRecords.of_tokens(
                    empty, empty, empty, [(r, reason) for r in range(start, stop)]
                )
        column = table.column(0).slice(start - int(bounds[a]), stop - start)
        return token_records(spec, column, start)


FORMAT = TokenParquet()

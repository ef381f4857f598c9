"""Parquet with a column of token ids (``sources[].tokens``): pre-tokenized Parquet sets.

Units are row groups, or runs of ``unit_records`` rows of one, as for text Parquet
(:mod:`.parquet`); discovery reads every footer and checks that the column is a list of
integers. A footer gives row counts, not list lengths, so a unit's lengths come with its read.
A record's offset is its row number in the file; a null row (or one holding a null id) is a
bad record. A mask column (``sources[].mask``) is read beside the ids (:mod:`.token_masks`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow.parquet as pq

from omniload_dask.plan import SourceSpec
from omniload_dask.sources.arrow import token_records
from omniload_dask.sources.base import RawRecords, Units
from omniload_dask.sources.decoding import WatchedFile
from omniload_dask.sources.files import open_file
from omniload_dask.sources.parquet import row_group_units
from omniload_dask.sources.token_arrays import check_token_field
from omniload_dask.sources.token_masks import check_mask_field

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

        def check(url: str, schema: Any) -> None:
            check_token_field(spec, url, schema)
            if spec.mask is not None:
                check_mask_field(spec, url, schema)

        return row_group_units(spec, fs, files, check, skip_unreadable)

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
                columns = [spec.tokens] + ([spec.mask.column] if spec.mask else [])
                table = pf.read_row_groups(list(range(a, b)), columns=columns)
            except Exception as exc:
                if f.failure is not None:
                    raise
                reason = f"cannot be decoded ({type(exc).__name__}: {exc})"
                empty = np.zeros(0, np.int64)
                return RawRecords.of_tokens(
                    empty, empty, empty, [(r, reason) for r in range(start, stop)]
                )
        rows = table.slice(start - int(bounds[a]), stop - start)
        mask = rows.column(1) if spec.mask is not None else None
        return token_records(spec, rows.column(0), start, mask)


FORMAT = TokenParquet()

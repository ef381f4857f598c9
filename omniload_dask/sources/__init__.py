"""Source formats: how files of one format are listed into read units and read into records.

Each format is one module behind the :class:`SourceFormat` protocol, looked up by the plan's
``format`` field in :data:`FORMATS`. A read unit is ``(file index, start, stop)``: a Parquet row
group (``start`` = row group index) or a JSON Lines byte range (``stop = -1``: the whole file,
for compressed files that cannot be split). Readers keep no state between calls: the data plane
holds the only cursors, and a worker only ever sees one unit at a time.
"""

from __future__ import annotations

from omniload_dask.sources.base import (
    Catalog,
    RawRecords,
    SourceFormat,
    discover_source,
    read_unit_records,
)
from omniload_dask.sources.ids import (
    MAX_FILES,
    MAX_OFFSET,
    MAX_SOURCES,
    decode_sample_id,
    encode_sample_ids,
)

__all__ = [
    "MAX_FILES",
    "MAX_OFFSET",
    "MAX_SOURCES",
    "Catalog",
    "RawRecords",
    "SourceFormat",
    "decode_sample_id",
    "discover_source",
    "encode_sample_ids",
    "read_unit_records",
]

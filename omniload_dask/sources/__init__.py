"""Source formats: how files of one format are listed into read units and read into records.

Each format is one module behind the :class:`SourceFormat` protocol, looked up by the plan's
``format`` field in :func:`~omniload_dask.sources.registry.formats`. A read unit is ``(file
index, start, stop)``: rows of a Parquet row group, a JSON Lines byte range (a negative ``stop``
reads to the end of the file, see :class:`Units`), or records of a tar shard. Readers keep
no state between calls: the data plane holds the only cursors, and a worker only ever sees one
unit at a time.

This package exports the pure data (:class:`Catalog`, :class:`RawRecords`, sample ids), which
the data plane imports; the parts that open files through fsspec are imported from their
modules: :mod:`.registry` (``discover_source``, ``read_unit_records``), :mod:`.files`,
:mod:`.decoding` and the formats :mod:`.jsonl`, :mod:`.parquet`, :mod:`.webdataset`.
"""

from __future__ import annotations

from omniload_dask.sources.base import RawRecords, SourceFormat, Units
from omniload_dask.sources.catalog import Catalog
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
    "Units",
    "decode_sample_id",
    "encode_sample_ids",
]

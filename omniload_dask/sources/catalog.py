"""What discovery found for one source, as pure data: its files, read units and their sizes.

The data plane holds one :class:`Catalog` per source and never opens a file: it numbers the
units, sizes their reads and cuts costly ones into parts (:meth:`Catalog.parts`). Discovery
(:func:`~omniload_dask.sources.registry.discover_source`) builds it on a worker.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass

import numpy as np

__all__ = ["MIN_PART_BYTES", "Catalog", "catalog_fingerprint"]

MIN_PART_BYTES = 64 * 1024  # a byte-range part is at least this long


@dataclass(frozen=True)
class Catalog:
    """What discovery found for one source: its files and read units, in a fixed order.

    ``units`` is an int64 array of rows ``(file index, start, stop)``. ``rows`` holds the number
    of records per unit where the format knows it up front (Parquet, tar shards), else -1.
    A unit can be read in parts (:meth:`parts`); which records it holds never depends on that.
    """

    source: str
    files: tuple[str, ...]
    units: np.ndarray
    rows: np.ndarray
    total_bytes: int = 0
    split: str = "none"
    marks: np.ndarray | None = None
    mark_index: np.ndarray | None = None

    @property
    def num_units(self) -> int:
        """How many read units the source has (one epoch reads each once)."""
        return len(self.units)

    def size(self, u: int) -> int:
        """What a unit's read cost is measured per: its records if known, else its bytes."""
        if self.rows[u] >= 0:
            return int(self.rows[u])
        _, start, stop = (int(v) for v in self.units[u])
        return max(1, _end(stop) - start)

    def max_parts(self, u: int) -> int:
        """How many parts unit ``u`` can be read in (1: it cannot be split)."""
        _, start, stop = (int(v) for v in self.units[u])
        if self.split in ("rows", "marks"):
            return max(1, int(self.rows[u]))
        if self.split == "bytes":
            return max(1, (_end(stop) - start) // MIN_PART_BYTES)
        return 1

    def parts(self, u: int, count: int) -> list[tuple[int, int]]:
        """``(start, stop)`` of each of ``count`` reads that together hold unit ``u``'s records,
        in file order (``count`` is capped by :meth:`max_parts`)::

            rows   unit (f, 100, 164), 2 parts -> (100, 132), (132, 164)
            bytes  unit (f, 0, 4096), 2 parts  -> (0, 2048), (2048, 4096)
            marks  records at 0, 700, 1900 of unit (f, 0, 2400), 2 parts -> (0, 700), (700, 2400)
        """
        _, start, stop = (int(v) for v in self.units[u])
        count = max(1, min(int(count), self.max_parts(u)))
        if count == 1:
            return [(start, stop)]
        if self.split == "rows" or self.split == "bytes":
            end = _end(stop)
            cuts = [start + p * (end - start) // count for p in range(count)] + [stop]
        else:  # marks
            assert self.marks is not None and self.mark_index is not None
            first, last = int(self.mark_index[u]), int(self.mark_index[u + 1])
            n = last - first
            cuts = [int(self.marks[first + p * n // count]) for p in range(count)] + [stop]
        return list(itertools.pairwise(cuts))


def catalog_fingerprint(catalog: Catalog) -> str:
    """A short hash of a source's files and read units: the cursors are only valid for it."""
    h = hashlib.sha256()
    h.update(json.dumps(list(catalog.files)).encode())
    h.update(np.ascontiguousarray(catalog.units, dtype=np.int64).tobytes())
    return h.hexdigest()[:16]


def _end(stop: int) -> int:
    """Where a unit ends: its stop, or the estimated end of a unit that reads to the end."""
    return stop if stop >= 0 else -stop - 1

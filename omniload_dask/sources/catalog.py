"""What discovery found for one source, as pure data: its files, read units and their sizes.

The data plane holds one :class:`Catalog` per source and never opens a file: it numbers the
units, sizes their reads and cuts costly ones into portions (:meth:`Catalog.reads`). Discovery
(:func:`~omniload_dask.sources.registry.discover_source`) builds it on a worker.

Small files are read several at a time (:func:`merge_small_files`): a read unit holds
consecutive whole files up to the smaller of the source's ``unit_bytes`` and ``merge_bytes``
(1 MiB by default), where each of them is a unit of its own. Every read task costs the
scheduler and the workers a few ms of CPU whatever its size, so a corpus of files of a few KB
would otherwise pay it for every file. The cap is low because a unit is read whole before the
first draw from it and held until its last record is drawn: with a costly tokenizer (WordPiece,
about 0.4 s of CPU a MiB of text) units of 4 MiB made the first batch five times as late and
the read-ahead twice as large in memory (the head to head's benchmark page has the runs).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
from dataclasses import dataclass

import numpy as np

from omniload_dask.batching.labels import Holes

__all__ = [
    "MAX_FILES_PER_UNIT",
    "MIN_PORTION_BYTES",
    "Catalog",
    "catalog_fingerprint",
    "merge_small_files",
]

MIN_PORTION_BYTES = 64 * 1024  # a byte-range portion is at least this long
MAX_FILES_PER_UNIT = 64  # whole files one read unit holds at most (merge_small_files)
FileRange = tuple[int, int, int]  # (file index, start, stop): what one format read reads


@dataclass(frozen=True)
class Catalog:
    """What discovery found for one source: its files and read units, in a fixed order.

    ``units`` is an int64 array of rows ``(file index, start, stop)``: the format's units, one
    read each. ``rows`` holds the number of records per row of ``units`` where the format knows
    it up front (Parquet, tar shards), else -1. ``groups`` (None: one row each) gathers
    consecutive rows into the data plane's read units: unit ``u`` is rows
    ``groups[u]:groups[u + 1]``, read one after another in one task (whole small files, see
    :func:`merge_small_files`). A unit can be read in portions (:meth:`reads`); which records
    it holds never depends on that. :meth:`num_units`, :meth:`size`, :meth:`max_portions` and
    :meth:`reads` number the read units; :meth:`portions` the rows of ``units``.
    """

    source: str
    files: tuple[str, ...]
    units: np.ndarray
    rows: np.ndarray
    total_bytes: int = 0
    split: str = "none"
    marks: np.ndarray | None = None
    mark_index: np.ndarray | None = None
    groups: np.ndarray | None = None
    lengths: np.ndarray | None = None  # every record's tokens, where an index gives them
    length_index: np.ndarray | None = None  # row r's records: lengths[length_index[r]:...]
    holes: Holes | None = None  # with a mask column: each record's tokens that are not targets

    @property
    def num_units(self) -> int:
        """How many read units the source has (one epoch reads each once)."""
        return len(self.units) if self.groups is None else len(self.groups) - 1

    def _rows_of(self, u: int) -> range:
        """The rows of ``units`` that read unit ``u`` holds."""
        if self.groups is None:
            return range(u, u + 1)
        return range(int(self.groups[u]), int(self.groups[u + 1]))

    def size(self, u: int) -> int:
        """What a unit's read cost is measured per: its records if known, else its bytes."""
        rows = self._rows_of(u)
        return int(self._row_sizes[rows.start : rows.stop].sum())

    @functools.cached_property
    def _row_sizes(self) -> np.ndarray:
        """:meth:`size` of every row of ``units`` (worked out once: the data plane asks often)."""
        if len(self.units) == 0:
            return np.zeros(0, dtype=np.int64)
        units = np.asarray(self.units, dtype=np.int64)
        stop = units[:, 2]
        end = np.where(stop >= 0, stop, -stop - 1)
        by_bytes = np.maximum(1, end - units[:, 1])
        rows = np.asarray(self.rows, dtype=np.int64)
        return np.where(rows >= 0, rows, by_bytes)

    def max_portions(self, u: int) -> int:
        """How many portions unit ``u`` can be read in (1: it cannot be split); a unit of
        several files splits between them."""
        rows = self._rows_of(u)
        if len(rows) > 1:
            return len(rows)
        return self._row_max_portions(rows[0])

    def _row_max_portions(self, r: int) -> int:
        _, start, stop = (int(v) for v in self.units[r])
        if self.split in ("rows", "marks"):
            return max(1, int(self.rows[r]))
        if self.split == "bytes":
            return max(1, (_end(stop) - start) // MIN_PORTION_BYTES)
        return 1

    def reads(self, u: int, count: int) -> list[list[FileRange]]:
        """What each of ``count`` reads that together hold unit ``u``'s records reads, in
        order: a list of ``(file index, start, stop)`` each (``count`` is capped by
        :meth:`max_portions`). A unit of one row is cut as :meth:`portions` cuts it; a unit of
        several files into runs of whole files, of about equal sizes::

            unit of rows (3, 0, 50), (4, 0, 70), (5, 0, 30), 2 reads
                -> [(3, 0, 50), (4, 0, 70)], [(5, 0, 30)]
        """
        rows = self._rows_of(u)
        if len(rows) == 1:
            f = int(self.units[rows[0], 0])
            return [[(f, a, b)] for a, b in self.portions(rows[0], count)]
        count = max(1, min(int(count), len(rows)))
        ends = np.cumsum(self._row_sizes[rows.start : rows.stop], dtype=np.float64)
        # cut after the row where each share of the total is reached (at least one row a read)
        cuts = [0]
        for p in range(1, count):
            at = int(np.searchsorted(ends, ends[-1] * p / count, side="left")) + 1
            cuts.append(min(max(at, cuts[-1] + 1), len(rows) - (count - p)))
        cuts.append(len(rows))
        ranges: list[FileRange] = [
            (f, start, stop) for f, start, stop in self.units[rows.start : rows.stop].tolist()
        ]
        return [ranges[a:b] for a, b in itertools.pairwise(cuts)]

    def read_sizes(self, u: int, count: int) -> list[int]:
        """The :meth:`size` of each of :meth:`reads`' reads (they add up to the unit's)."""
        rows = self._rows_of(u)
        if len(rows) == 1:
            size = self.size(u)
            n = len(self.reads(u, count))
            return [(p + 1) * size // n - p * size // n for p in range(n)]
        out, r = [], rows.start
        for read in self.reads(u, count):
            out.append(int(self._row_sizes[r : r + len(read)].sum()))
            r += len(read)
        return out

    def known_lengths(self, u: int, count: int) -> list[np.ndarray] | None:
        """The token counts of the records of each of :meth:`reads`' ``count`` reads of unit
        ``u``, in file order, where discovery gave them up front (None: only the reads tell).

        Rows of a source with known lengths are record numbers (``split == "rows"``), so a
        read of rows ``[a, b)`` of row ``r`` holds records ``a - start .. b - start`` of it.
        """
        if self.lengths is None or self.length_index is None:
            return None
        return [self.lengths[a:b] for a, b in self._known_records(u, count)]

    def known_holes(self, u: int, count: int) -> list[Holes | None]:
        """With :meth:`known_lengths`, the holes (tokens that are not targets) of each read's
        records of more than 0 tokens, as its report gives them: None where it has none (every
        read's None for a source without a mask column)."""
        ranges = self._known_records(u, count)
        if self.holes is None or self.lengths is None:
            return [None] * len(ranges)
        out: list[Holes | None] = []
        for a, b in ranges:
            got = self.holes.select(a, b, self.lengths[a:b] > 0)
            out.append(got if len(got.spans) else None)
        return out

    def _known_records(self, u: int, count: int) -> list[tuple[int, int]]:
        """Which of ``lengths``' records each of :meth:`reads`' ``count`` reads of ``u`` holds."""
        assert self.length_index is not None
        rows = self._rows_of(u)
        index = self.length_index
        if len(rows) == 1:
            r = rows[0]
            base = int(index[r]) - int(self.units[r, 1])
            return [(base + a, base + b) for a, b in self.portions(r, count)]
        out, r = [], rows.start
        for read in self.reads(u, count):
            out.append((int(index[r]), int(index[r + len(read)])))
            r += len(read)
        return out

    def portions(self, u: int, count: int) -> list[tuple[int, int]]:
        """``(start, stop)`` of each of ``count`` reads that together hold the records of row
        ``u`` of ``units``, in file order (``count`` is capped by its own portion count)::

            rows   unit (f, 100, 164), 2 portions -> (100, 132), (132, 164)
            bytes  unit (f, 0, 4096), 2 portions  -> (0, 2048), (2048, 4096)
            marks  records at 0, 700, 1900 of unit (f, 0, 2400), 2 portions
                                                   -> (0, 700), (700, 2400)
        """
        _, start, stop = (int(v) for v in self.units[u])
        count = max(1, min(int(count), self._row_max_portions(u)))
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
    if catalog.groups is not None:
        h.update(b"groups")
        h.update(np.ascontiguousarray(catalog.groups, dtype=np.int64).tobytes())
    return h.hexdigest()[:16]


def merge_small_files(
    units: np.ndarray, rows: np.ndarray, sizes: list[int], unit_bytes: int,
    unit_records: int | None = None,
) -> np.ndarray | None:  # fmt: skip
    """Read units of consecutive whole small files (``Catalog.groups``), or None where no two
    merge. A row of ``units`` that is its file's only one (and whose size the storage
    reported) joins the run before it while the run's files stay within ``unit_bytes`` on
    storage (and ``unit_records`` records, where the plan sets it and the rows are known), at
    most :data:`MAX_FILES_PER_UNIT` files::

        files of 1, 1, 3, 1 MiB (one row each), unit_bytes 4 MiB -> units [0, 1], [2, 3]
    """
    n = len(units)
    if n < 2:
        return None
    files = units[:, 0]
    per_file = np.bincount(files, minlength=len(sizes))
    starts = [0]
    run_bytes = run_rows = 0
    prev_whole = False
    for r in range(n):
        f = int(files[r])
        size, count = int(sizes[f]), int(rows[r])
        whole = per_file[f] == 1 and size > 0  # (a size the storage did not report: alone)
        fits = (
            whole
            and prev_whole
            and r - starts[-1] < MAX_FILES_PER_UNIT
            and run_bytes + size <= unit_bytes
            and (
                unit_records is None
                or (min(count, run_rows) >= 0 and run_rows + count <= unit_records)
            )
        )
        if r > 0 and not fits:
            starts.append(r)
            run_bytes = run_rows = 0
        run_bytes += size
        run_rows = run_rows + count if count >= 0 and run_rows >= 0 else -1
        prev_whole = whole
    if len(starts) == n:
        return None
    return np.asarray([*starts, n], dtype=np.int64)


def _end(stop: int) -> int:
    """Where a unit ends: its stop, or the estimated end of a unit that reads to the end."""
    return stop if stop >= 0 else -stop - 1

"""The source protocol, file listing through fsspec, and the two entry points workers call."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import fsspec
import numpy as np
from fsspec.core import url_to_fs

from omniload_dask.errors import SourceError
from omniload_dask.plan import SourceSpec
from omniload_dask.sources.ids import MAX_FILES

_GLOB_CHARS = set("*?[")


MIN_PART_BYTES = 64 * 1024  # a byte-range part is at least this long


@dataclass(frozen=True)
class Units:
    """What a format's ``units()`` returns: the read units and how a unit may be split.

    ``table`` rows are ``(file index, start, stop)``; ``rows`` the records per unit where known
    up front, else -1. A negative ``stop`` means "to the end of the file", and ``-stop - 1`` is
    where that end is estimated to be (the last unit of a compressed JSON Lines file).
    ``split`` says how :meth:`Catalog.parts` cuts a unit into smaller reads with the same
    records: ``rows`` (start/stop are row numbers), ``bytes`` (byte ranges whose
    records are those starting inside, as JSON Lines), ``marks`` (records start at the byte
    offsets ``marks[mark_index[u]:mark_index[u + 1]]``), or ``none``.
    """

    table: np.ndarray
    rows: np.ndarray
    split: str = "none"
    marks: np.ndarray | None = None
    mark_index: np.ndarray | None = None


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


def _end(stop: int) -> int:
    """Where a unit ends: its stop, or the estimated end of a unit that reads to the end."""
    return stop if stop >= 0 else -stop - 1


@dataclass
class RawRecords:
    """Records of one read unit in file order: texts, offsets, and the records that failed.

    ``images`` (image-text sources) holds each record's encoded images, in order.
    """

    texts: list[str]
    offsets: np.ndarray
    bad: list[tuple[int, str]] = field(default_factory=list)
    images: list[list[bytes]] | None = None


class SourceFormat(Protocol):
    """A file format. Implementations are stateless; one module per format."""

    name: str
    extensions: tuple[str, ...]

    def units(
        self,
        spec: SourceSpec,
        fs: Any,
        files: list[str],
        sizes: list[int],
    ) -> Units:
        """Split files into read units; check each file (schema, footer) on the way."""

    def read(self, spec: SourceSpec, fs: Any, path: str, start: int, stop: int) -> RawRecords:
        """Read one unit; a bad record goes to ``bad`` with its offset and reason."""


def _formats() -> Mapping[str, SourceFormat]:
    from omniload_dask.sources import jsonl, parquet, webdataset

    formats: dict[str, SourceFormat] = {
        "jsonl": jsonl.FORMAT,
        "parquet": parquet.FORMAT,
        "webdataset": webdataset.FORMAT,
    }
    return formats


def get_format(name: str) -> SourceFormat:
    return _formats()[name]


def filesystem(spec: SourceSpec, url: str) -> tuple[Any, str]:
    try:
        return url_to_fs(url, **dict(spec.storage_options))
    except (ImportError, ValueError) as exc:
        raise SourceError(f"source {spec.name!r}: cannot open {url!r}: {exc}") from None


def list_files(spec: SourceSpec, fmt: SourceFormat) -> tuple[Any, list[str], list[int]]:
    """Resolve the source's paths and globs to a sorted list of files and their sizes."""
    found: dict[str, int] = {}
    fs = None
    for url in spec.paths:
        fs, path = filesystem(spec, url)
        try:
            if _GLOB_CHARS & set(path):
                hits = fs.glob(path, detail=True)
                if not hits:
                    raise SourceError(f"source {spec.name!r}: glob {url!r} matched no files")
                infos = list(hits.values())
            else:
                info = fs.info(path)
                if info["type"] == "directory":
                    infos = [
                        i
                        for i in fs.ls(path, detail=True)
                        if i["type"] == "file" and i["name"].endswith(fmt.extensions)
                    ]
                    if not infos:
                        raise SourceError(
                            f"source {spec.name!r}: folder {url!r} holds no "
                            f"{'/'.join(fmt.extensions)} files"
                        )
                else:
                    infos = [info]
        except FileNotFoundError:
            raise SourceError(f"source {spec.name!r}: path {url!r} does not exist") from None
        except SourceError:
            raise
        except Exception as exc:  # network, permissions, bad credentials: name them all
            raise SourceError(
                f"source {spec.name!r}: cannot list {url!r}: {type(exc).__name__}: {exc}"
            ) from None
        for info in infos:
            if info.get("type", "file") == "file":
                found[fs.unstrip_protocol(info["name"])] = int(info.get("size") or 0)
    files = sorted(found)
    if len(files) > MAX_FILES:
        raise SourceError(
            f"source {spec.name!r}: {len(files)} files; at most {MAX_FILES} per source "
            "(split it into several sources)"
        )
    return fs, files, [found[f] for f in files]


def discover_source(spec: SourceSpec) -> Catalog:
    """List a source's files and split them into read units (runs on a worker)."""
    fmt = get_format(spec.format)
    fs, files, sizes = list_files(spec, fmt)
    found = fmt.units(spec, fs, files, sizes)
    return Catalog(
        source=spec.name,
        files=tuple(files),
        units=found.table,
        rows=found.rows,
        total_bytes=int(sum(sizes)),
        split=found.split,
        marks=found.marks,
        mark_index=found.mark_index,
    )


def read_unit_records(spec: SourceSpec, file_url: str, start: int, stop: int) -> RawRecords:
    """Read one unit of one file; errors that are not about a single record raise SourceError."""
    fmt = get_format(spec.format)
    fs, path = filesystem(spec, file_url)
    try:
        return fmt.read(spec, fs, path, start, stop)
    except SourceError:
        raise
    except FileNotFoundError:
        raise SourceError(f"source {spec.name!r}: file {file_url!r} disappeared") from None
    except Exception as exc:
        raise SourceError(
            f"source {spec.name!r}: file {file_url!r}, unit [{start}, {stop}): "
            f"{type(exc).__name__}: {exc}"
        ) from None


def open_file(fs: Any, path: str, compression: str | None = None) -> Any:
    """Open for reading without read-ahead beyond what is asked (ranges are read exactly).

    zstd is opened here rather than through fsspec, whose ``zstandard`` reader stops at the end
    of the first frame (the rest of a multi-frame file, from ``pzstd`` or concatenated files,
    would be lost without a word) and returns nothing, without an error, for a truncated file.
    """
    if compression == "zstd":
        return _ZstdFrames(fs.open(path, "rb"))
    if compression:
        return fsspec.core.OpenFile(fs, path, mode="rb", compression=compression).open()
    return fs.open(path, "rb", cache_type="none")


class _ZstdFrames:
    """The decompressed bytes of every frame of a zstd file, read in order; a file that ends
    inside a frame raises instead of ending early."""

    CHUNK = 1 << 17

    def __init__(self, raw: Any) -> None:
        import zstandard

        self._raw = raw
        self._dctx = zstandard.ZstdDecompressor()
        self._frame = self._dctx.decompressobj()
        self._in_frame = False  # bytes of a frame fed, and its end not reached yet
        self._out = bytearray()
        self._done = False

    def read(self, size: int = -1) -> bytes:
        while not self._done and (size < 0 or len(self._out) < size):
            data = self._raw.read(self.CHUNK)
            if not data:
                self._done = True
                if self._in_frame:
                    raise ValueError("truncated zstd file: it ends inside a frame")
            while data:  # one chunk may end a frame and start the next
                self._in_frame = True
                self._out += self._frame.decompress(data)
                if not self._frame.eof:
                    break
                data = self._frame.unused_data
                self._frame = self._dctx.decompressobj()
                self._in_frame = False
        cut = len(self._out) if size < 0 else min(size, len(self._out))
        out = bytes(self._out[:cut])
        del self._out[:cut]
        return out

    def close(self) -> None:
        self._raw.close()

    def __enter__(self) -> _ZstdFrames:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

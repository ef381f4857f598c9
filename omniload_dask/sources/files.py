"""Files through fsspec: resolve a source's paths to files, and open them for exact reads.

Every format reads through :func:`open_file`, which reads byte ranges exactly (no read-ahead)
and opens compressed files as a :class:`~omniload_dask.sources.decoding.Decompressed` stream
(member by member, :mod:`~omniload_dask.sources.members`); :func:`list_files` turns the
plan's paths, folders and globs into one sorted list of files with their sizes.
"""

from __future__ import annotations

from typing import Any

from fsspec.core import url_to_fs

from omniload_dask.errors import SourceError
from omniload_dask.plan import SourceSpec
from omniload_dask.plan.credentials import resolve
from omniload_dask.sources.base import SourceFormat
from omniload_dask.sources.decoding import Decompressed
from omniload_dask.sources.ids import MAX_FILES

__all__ = ["filesystem", "list_files", "open_file"]

_GLOB_CHARS = set("*?[")


def filesystem(spec: SourceSpec, url: str) -> tuple[Any, str]:
    """The fsspec filesystem and path of ``url``, with the source's storage options."""
    try:
        options = resolve(spec.storage_options)
        return url_to_fs(url, **options)
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


def open_file(fs: Any, path: str, compression: str | None = None) -> Any:
    """Open for reading without read-ahead beyond what is asked (ranges are read exactly).

    A compressed file comes as a :class:`~omniload_dask.sources.decoding.Decompressed` stream,
    which ends at bad data, says where, and keeps every byte decoded before it. The codecs'
    own decoders are used rather than fsspec's file objects: its ``zstandard`` reader stops at
    the end of the first frame (the rest of a multi-frame file, from ``pzstd`` or concatenated
    files, would be lost without a word) and returns nothing, without an error, for a
    truncated file; its ``gzip`` reader loses what the block that fails had decoded.
    """
    if compression:
        return Decompressed(fs, path, compression)
    return fs.open(path, "rb", cache_type="none")

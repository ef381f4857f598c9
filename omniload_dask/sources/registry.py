"""The formats by name, and the two entry points workers call: discover and read.

:func:`formats` maps the plan's ``sources[].format`` to its :class:`~.base.SourceFormat`.
:func:`discover_source` lists a source into a :class:`~.catalog.Catalog` at start-up;
:func:`read_unit_records` reads one unit of it (:func:`read_records` the reads of a unit). Both run on workers (they open files through
fsspec); the data plane only ever holds the catalog.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from omniload_dask.errors import SourceError
from omniload_dask.plan import SourceSpec
from omniload_dask.sources.base import RawRecords, SourceFormat
from omniload_dask.sources.catalog import Catalog, merge_small_files
from omniload_dask.sources.files import filesystem, list_files
from omniload_dask.sources.token_arrays import checked_tokens

__all__ = [
    "discover_source",
    "format_of",
    "formats",
    "get_format",
    "list_source",
    "read_records",
    "read_unit_records",
]


@functools.cache
def formats() -> Mapping[str, SourceFormat]:
    """Every format by its plan name; their modules load on the first call, not with this one
    (Parquet's imports pyarrow, which importing the package should not)."""
    from omniload_dask.sources.arrow import FORMAT as ARROW
    from omniload_dask.sources.flat import FORMAT as FLAT
    from omniload_dask.sources.jsonl import FORMAT as JSONL
    from omniload_dask.sources.mds import FORMAT as MDS
    from omniload_dask.sources.megatron import FORMAT as MEGATRON
    from omniload_dask.sources.parquet import FORMAT as PARQUET
    from omniload_dask.sources.webdataset import FORMAT as WEBDATASET

    return {
        "jsonl": JSONL,
        "parquet": PARQUET,
        "webdataset": WEBDATASET,
        "megatron": MEGATRON,
        "arrow": ARROW,
        "mds": MDS,
        "flat": FLAT,
    }


def get_format(name: str) -> SourceFormat:
    """The format named ``name`` (the plan has checked that it is one of :func:`formats`)."""
    return formats()[name]


def format_of(spec: SourceSpec) -> SourceFormat:
    """The format that reads ``spec``: Parquet with a token-id column has a reader of its own."""
    if spec.format == "parquet" and spec.tokens is not None:
        from omniload_dask.sources.token_parquet import FORMAT as TOKEN_PARQUET

        return TOKEN_PARQUET
    return get_format(spec.format)


def list_source(spec: SourceSpec) -> list[str]:
    """The source's files (its paths, folders and globs resolved); a SourceError naming the
    path that finds none (``omniload validate`` calls it before any job starts)."""
    return list_files(spec, format_of(spec))[1]


def discover_source(spec: SourceSpec, on_error: str = "raise") -> Catalog:
    """List a source's files and split them into read units (runs on a worker); small whole
    files of a text source are read several to a unit (:func:`.catalog.merge_small_files`).

    A file that cannot be parsed fails here, naming it; with ``on_error="skip"`` it gets a
    unit whose read reports it as a bad record instead.
    """
    fmt = format_of(spec)
    fs, files, sizes = list_files(spec, fmt)
    try:
        found = fmt.units(spec, fs, files, sizes, skip_unreadable=on_error == "skip")
    except SourceError:
        raise
    except Exception as exc:
        raise SourceError(
            f"source {spec.name!r}: cannot split its {len(files)} files into read units: "
            f"{type(exc).__name__}: {exc}"
        ) from None
    groups = None
    lengths, length_index, holes = found.lengths, found.length_index, found.holes
    masked = spec.mask is not None
    if on_error != "raise" or spec.transform or spec.filter or (masked and holes is None):
        # A record that a read skips (a bad token id) or that user code drops or changes would
        # differ from the index, and the data plane would have dealt with it already; a
        # mask's holes (what global_loss_tokens counts) come with the lengths (Arrow: the
        # mask column read beside the ids) or only with the reads.
        lengths = length_index = holes = None
    merge = min(spec.unit_bytes, spec.merge_bytes)
    if merge > 0 and not spec.has_images:  # image records are large: read file by file
        groups = merge_small_files(found.table, found.rows, sizes, merge, spec.unit_records)
    return Catalog(
        source=spec.name,
        files=tuple(files),
        units=found.table,
        rows=found.rows,
        total_bytes=int(sum(sizes)),
        split=found.split,
        marks=found.marks,
        mark_index=found.mark_index,
        groups=groups,
        lengths=lengths,
        length_index=length_index,
        holes=holes if masked else None,
    )


def read_unit_records(spec: SourceSpec, file_url: str, start: int, stop: int) -> RawRecords:
    """Read one unit of one file; errors that are not about a single record raise SourceError."""
    fmt = format_of(spec)
    fs, path = filesystem(spec, file_url)
    try:
        records = fmt.read(spec, fs, path, start, stop)
        if records.tokens is not None:  # ids checked against the vocabulary, as uint32
            records = checked_tokens(spec, records)
        return records
    except SourceError:
        raise
    except FileNotFoundError:
        raise SourceError(f"source {spec.name!r}: file {file_url!r} disappeared") from None
    except Exception as exc:
        raise SourceError(
            f"source {spec.name!r}: file {file_url!r}, unit [{start}, {stop}): "
            f"{type(exc).__name__}: {exc}"
        ) from None


def read_records(
    spec: SourceSpec, reads: Sequence[tuple[int, str, int, int]]
) -> tuple[RawRecords, np.ndarray, list[str]]:
    """The records of ``reads`` (``(file index, url, start, stop)`` each) in order, the file
    index of each, and the url of each bad one (a unit of one read: its own records as the
    format reads them; a unit of several small files: theirs one after another)."""
    if len(reads) == 1:
        f, url, lo, hi = reads[0]
        records = read_unit_records(spec, url, lo, hi)
        return records, np.full(len(records.offsets), f, np.int64), [url] * len(records.bad)
    texts: list[str] = []
    chats: list[Any] = []
    offsets, files, bad, urls = [], [], [], []
    tokens: list[np.ndarray] = []
    lengths: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    for f, url, lo, hi in reads:
        one = read_unit_records(spec, url, lo, hi)
        texts += one.texts
        chats += one.chats or []
        offsets.append(np.asarray(one.offsets, np.int64))
        files.append(np.full(len(one.offsets), f, np.int64))
        bad += one.bad
        urls += [url] * len(one.bad)
        if one.tokens is not None and one.lengths is not None:
            tokens.append(one.tokens)
            lengths.append(one.lengths)
            # (a read whose records all failed to decode has no mask: no tokens either)
            masks.append(one.mask if one.mask is not None else np.zeros(len(one.tokens), bool))
    records = RawRecords(
        texts, np.concatenate(offsets), bad, chats=chats if spec.chat is not None else None
    )
    if tokens:
        records.tokens = np.concatenate(tokens)
        records.lengths = np.concatenate(lengths)
        records.mask = np.concatenate(masks) if spec.mask is not None else None
    return records, np.concatenate(files), urls

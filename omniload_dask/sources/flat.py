"""Flat token arrays: one long array of token ids per file, documents ended by an id.

This is what nanoGPT's and litgpt's preparation scripts write: every document's ids followed
by the end-of-document id (GPT-2's ``<|endoftext|>``, 50256), all in one ``uint16`` (or
``uint32``) array, raw in a ``.bin`` or with a header in a ``.npy``. A record is one document,
its end-of-document id kept as its last token; its offset is the position of its first token.

A file is cut into units of ``unit_bytes`` of tokens. Like JSON Lines' byte ranges, a unit
``[start, stop)`` (in tokens) owns the documents that *begin* inside it: at position 0 or right
after an end-of-document id. It reads on past ``stop`` to the end of its last document, so
neighbouring units (and portions of a unit) never share or lose a document::

    ids     7 8 E | 9 E 4 | 5 6 E 3        (E: the end-of-document id; | unit bounds 3, 6)
    unit 0  [7 8 E]          unit 1 [9 E] [4 5 6 E]      unit 2 [3] (the file's last, no E)

Lengths are only known once a unit is read.
"""

from __future__ import annotations

import ast
from typing import Any

import numpy as np

from omniload_dask.errors import SourceError
from omniload_dask.plan import SourceSpec
from omniload_dask.sources.base import RawRecords, Units
from omniload_dask.sources.files import open_file
from omniload_dask.sources.ids import MAX_OFFSET

__all__ = ["FORMAT", "FlatTokens", "npy_layout"]

_TAIL = 1 << 16  # tokens read at a time past a unit's end, to its last document's end


def npy_layout(spec: SourceSpec, fs: Any, url: str) -> tuple[np.dtype, int]:
    """dtype and data offset of a ``.npy`` (a 1-d array) or a raw ``.bin`` (the plan's dtype)."""
    plan_dtype = np.dtype(spec.dtype or "uint16")
    if not url.endswith(".npy"):
        return plan_dtype, 0
    with open_file(fs, fs._strip_protocol(url)) as f:
        head = f.read(10)
        if head[:6] != b"\x93NUMPY":
            raise SourceError(f"source {spec.name!r}: file {url!r} is not a .npy file")
        major = head[6]
        size_bytes = 2 if major == 1 else 4
        f.seek(8)
        size = int.from_bytes(f.read(size_bytes), "little")
        text = f.read(size).decode("latin1")
    try:
        header = ast.literal_eval(text)
        dtype = np.dtype(header["descr"])
    except Exception as exc:
        raise SourceError(
            f"source {spec.name!r}: file {url!r}: unreadable .npy header ({exc})"
        ) from None
    if header.get("fortran_order") or len(header.get("shape", ())) != 1:
        raise SourceError(
            f"source {spec.name!r}: file {url!r}: a flat token array is one-dimensional "
            f"(shape {header.get('shape')})"
        )
    if dtype != plan_dtype:
        raise SourceError(
            f"source {spec.name!r}: file {url!r} holds {dtype}, the plan says "
            f"dtype: {plan_dtype} (sources[].dtype)"
        )
    return dtype, 8 + size_bytes + size


class FlatTokens:
    """The flat-array format: token ranges, documents cut at the end-of-document id."""

    name: str = "flat"
    extensions: tuple[str, ...] = (".bin", ".npy")

    def units(
        self,
        spec: SourceSpec,
        fs: Any,
        files: list[str],
        sizes: list[int],
        skip_unreadable: bool = False,
    ) -> Units:
        """Token ranges of ``unit_bytes`` per file; a file whose size is not a whole number
        of tokens fails (it is not of the plan's dtype, or cut short)."""
        rows: list[tuple[int, int, int]] = []
        for i, (url, size) in enumerate(zip(files, sizes, strict=True)):
            dtype, header = npy_layout(spec, fs, url)
            body = size - header
            if body % dtype.itemsize:
                raise SourceError(
                    f"source {spec.name!r}: file {url!r}: {body} bytes of data are not a whole "
                    f"number of {dtype} tokens (sources[].dtype, or a truncated file)"
                )
            count = body // dtype.itemsize
            if count >= MAX_OFFSET:
                raise SourceError(f"source {spec.name!r}: file {url!r}: {count} tokens")
            step = max(1, spec.unit_bytes // dtype.itemsize)
            rows.extend((i, lo, min(lo + step, count)) for lo in range(0, count, step))
        table = np.asarray(rows, dtype=np.int64).reshape(-1, 3)
        return Units(table, np.full(len(table), -1, np.int64), split="bytes")

    def read(self, spec: SourceSpec, fs: Any, path: str, start: int, stop: int) -> RawRecords:
        """The documents that begin in ``[start, stop)``, each to its end-of-document id."""
        url = fs.unstrip_protocol(path)
        dtype, header = npy_layout(spec, fs, url)
        size = dtype.itemsize
        eod = int(spec.eod if spec.eod is not None else -1)
        with open_file(fs, path) as f:
            lead = 1 if start > 0 else 0
            f.seek(header + (start - lead) * size)
            ids = np.frombuffer(f.read((stop - start + lead) * size), dtype)
            got = len(ids) - lead
            # position j begins a document if the id before it ends one (or it is the first)
            after_eod = np.zeros(len(ids), bool)
            after_eod[1:] = ids[:-1] == eod
            after_eod[0] = start == 0
            begins = np.flatnonzero(after_eod[lead:]) + lead
            if not len(begins):
                empty = np.zeros(0, np.int64)
                return RawRecords.of_tokens(np.zeros(0, np.uint32), empty, empty)
            tail = [ids[int(begins[0]) :]]
            # read on to the end of the last document (the file's end, if no E comes)
            if ids[-1] != eod and got == stop - start:
                while True:
                    chunk = np.frombuffer(f.read(_TAIL * size), dtype)
                    if not len(chunk):
                        break
                    hit = np.flatnonzero(chunk == eod)
                    if len(hit):
                        tail.append(chunk[: int(hit[0]) + 1])
                        break
                    tail.append(chunk)
        tokens = np.concatenate(tail) if len(tail) > 1 else tail[0]
        starts = begins - begins[0]
        lengths = np.diff(np.append(starts, len(tokens)))
        offsets = start - lead + begins
        return RawRecords.of_tokens(tokens, lengths, offsets.astype(np.int64))


FORMAT = FlatTokens()

"""Megatron ``IndexedDataset`` pairs: token ids in a ``.bin``, sizes and pointers in an ``.idx``.

The ``.idx`` that Megatron-Core's ``IndexedDatasetBuilder`` writes is, little-endian::

    b"MMIDIDX\\x00\\x00"  version u64 (1)  dtype code u8  sequences S u64  documents+1 D u64
    sequence lengths  int32[S]      (tokens of each sequence)
    sequence pointers int64[S]      (byte offset of each sequence in the .bin)
    document indices  int64[D]      (document d is sequences [idx[d], idx[d + 1]))

A record here is a *document* (its sequences concatenated, as the builder's ``add_document`` or
``add_item`` + ``end_document`` wrote it); its offset, and so its sample id, is its document
number. The catalog lists the ``.idx`` files; each one's ``.bin`` sits beside it. Discovery reads
every ``.idx`` whole and checks it against its ``.bin`` (header, version, dtype, counts, pointers,
size), so a pair that does not match fails at start-up naming the file. Read units are runs of
documents of about ``unit_bytes`` of tokens (``unit_records`` documents at most); every
document's length comes from the index, so the data plane plans before any read reports.

A read of documents ``[a, b)`` reads their slice of the document indices and of the sequence
lengths and pointers, then the one byte range of the ``.bin`` they span.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from omniload_dask.errors import SourceError
from omniload_dask.plan import SourceSpec
from omniload_dask.sources.base import RawRecords, Units
from omniload_dask.sources.files import open_file
from omniload_dask.sources.ids import MAX_OFFSET

__all__ = ["DTYPES", "FORMAT", "IndexedDataset", "read_index"]

MAGIC = b"MMIDIDX\x00\x00"
HEADER = len(MAGIC) + 8 + 1 + 8 + 8  # magic, version, dtype code, S, D
# Megatron-Core's DType codes (indexed_dataset.DType); float ones hold ids as whole numbers.
DTYPES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}


def bin_of(url: str) -> str:
    """The ``.bin`` beside an ``.idx``."""
    return url[: -len(".idx")] + ".bin"


def read_index(
    spec: SourceSpec, fs: Any, url: str
) -> tuple[np.dtype, np.ndarray, np.ndarray, np.ndarray]:
    """dtype, sequence lengths, pointers and document indices of one ``.idx``, each checked
    against the file and its ``.bin``; a SourceError naming the file and what is wrong."""
    where = f"source {spec.name!r}: file {url!r}"
    with open_file(fs, fs._strip_protocol(url)) as f:
        blob = f.read()
    if len(blob) < HEADER or blob[: len(MAGIC)] != MAGIC:
        raise SourceError(
            f"{where} is not a Megatron IndexedDataset index (its header is not MMIDIDX)"
        )
    version, code, count, docs = struct.unpack_from("<QBQQ", blob, len(MAGIC))
    if version != 1:
        raise SourceError(f"{where}: index version {version}; only version 1 is known")
    if code not in DTYPES:
        raise SourceError(f"{where}: dtype code {code} is not one Megatron writes (1-8)")
    dtype = np.dtype(DTYPES[code])
    want = HEADER + 12 * count + 8 * docs
    if len(blob) == want + count:
        raise SourceError(f"{where} is a multimodal index (sequence modes); not supported")
    if len(blob) != want or docs < 1:
        raise SourceError(
            f"{where}: {len(blob)} bytes, but its header says {count} sequences and "
            f"{docs - 1} documents ({want} bytes); is the file truncated or of another kind?"
        )
    lengths = np.frombuffer(blob, np.int32, count, HEADER).astype(np.int64)
    pointers = np.frombuffer(blob, np.int64, count, HEADER + 4 * count)
    doc_index = np.frombuffer(blob, np.int64, docs, HEADER + 12 * count)
    expected = np.zeros(count, np.int64)
    np.cumsum(lengths[:-1] * dtype.itemsize, out=expected[1:])
    if (lengths < 0).any() or not np.array_equal(pointers, expected):
        raise SourceError(f"{where}: sequence pointers do not follow the sequence lengths")
    if doc_index[0] != 0 or doc_index[-1] != count or (np.diff(doc_index) < 0).any():
        raise SourceError(
            f"{where}: document indices must rise from 0 to the {count} sequences "
            f"(got {doc_index[0]} .. {doc_index[-1]})"
        )
    data_url = bin_of(url)
    try:
        size = fs.size(fs._strip_protocol(data_url))
    except FileNotFoundError:
        raise SourceError(f"{where}: its data file {data_url!r} does not exist") from None
    need = int(lengths.sum()) * dtype.itemsize
    if size != need:
        raise SourceError(
            f"{where}: its data file {data_url!r} is {size} bytes; the index says "
            f"{need} ({int(lengths.sum())} tokens of {dtype.name})"
        )
    return dtype, lengths, pointers, doc_index


class IndexedDataset:
    """The Megatron format: units are runs of documents; every length known up front."""

    name: str = "megatron"
    extensions: tuple[str, ...] = (".idx",)

    def units(
        self,
        spec: SourceSpec,
        fs: Any,
        files: list[str],
        sizes: list[int],
        skip_unreadable: bool = False,
    ) -> Units:
        """Runs of whole documents of about ``unit_bytes`` of tokens per ``.idx``; every
        document's token count from the index (a pair that does not match always fails: its
        counts are what the data plane plans with)."""
        rows: list[tuple[int, int, int]] = []
        lengths: list[np.ndarray] = []
        for i, url in enumerate(files):
            if not url.endswith(".idx"):
                raise SourceError(
                    f"source {spec.name!r}: {url!r} is not a Megatron .idx file (give the "
                    "prefix, the .idx, a folder or a glob of .idx files)"
                )
            dtype, seq, _, doc_index = read_index(spec, fs, url)
            docs = len(doc_index) - 1
            if docs >= MAX_OFFSET:
                raise SourceError(f"source {spec.name!r}: file {url!r}: {docs} documents")
            cum = np.zeros(len(seq) + 1, np.int64)
            np.cumsum(seq, out=cum[1:])
            doc_tokens = np.diff(cum[doc_index])
            lengths.append(doc_tokens)
            rows.extend((i, a, b) for a, b in _runs(doc_tokens * dtype.itemsize, spec))
        table = np.asarray(rows, dtype=np.int64).reshape(-1, 3)
        counts = table[:, 2] - table[:, 1]
        flat = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
        # rows are in file order and cover each file's documents: their lengths, in turn
        index = np.zeros(len(table) + 1, np.int64)
        np.cumsum(counts, out=index[1:])
        return Units(table, counts, split="rows", lengths=flat, length_index=index)

    def read(self, spec: SourceSpec, fs: Any, path: str, start: int, stop: int) -> RawRecords:
        """Documents ``[start, stop)`` of one ``.idx`` / ``.bin`` pair, as token ids."""
        code, count, docs = self._header(fs, path)
        if not 0 <= start <= stop < docs:
            raise SourceError(
                f"file {fs.unstrip_protocol(path)!r}: documents [{start}, {stop}) are past its "
                f"{docs - 1} (it changed since discovery?)"
            )
        dtype = np.dtype(DTYPES[code])
        with open_file(fs, path) as f:
            f.seek(HEADER + 12 * count + 8 * start)
            doc_index = np.frombuffer(f.read(8 * (stop - start + 1)), np.int64)
            first, last = int(doc_index[0]), int(doc_index[-1])
            f.seek(HEADER + 4 * first)
            seq = np.frombuffer(f.read(4 * (last - first)), np.int32).astype(np.int64)
            f.seek(HEADER + 4 * count + 8 * first)
            pointer = int(np.frombuffer(f.read(8), np.int64)[0]) if last > first else 0
        cum = np.zeros(len(seq) + 1, np.int64)
        np.cumsum(seq, out=cum[1:])
        doc_tokens = np.diff(cum[doc_index - first])
        total = int(cum[-1])
        with open_file(fs, path[: -len(".idx")] + ".bin") as f:
            f.seek(pointer)
            data = f.read(total * dtype.itemsize)
        if len(data) != total * dtype.itemsize:
            raise SourceError(
                f"source {spec.name!r}: file {bin_of(fs.unstrip_protocol(path))!r} ended "
                f"inside documents [{start}, {stop}) (it changed since discovery?)"
            )
        tokens = np.frombuffer(data, dtype)
        offsets = np.arange(start, stop, dtype=np.int64)
        return RawRecords.of_tokens(tokens, doc_tokens, offsets)

    def _header(self, fs: Any, path: str) -> tuple[int, int, int]:
        """dtype code, sequence count and document-index count of an ``.idx``."""
        with open_file(fs, path) as f:
            head = f.read(HEADER)
        if len(head) < HEADER or head[: len(MAGIC)] != MAGIC:
            raise SourceError(f"file {fs.unstrip_protocol(path)!r} is no longer a Megatron index")
        _, code, count, docs = struct.unpack_from("<QBQQ", head, len(MAGIC))
        return int(code), int(count), int(docs)


def _runs(doc_bytes: np.ndarray, spec: SourceSpec) -> list[tuple[int, int]]:
    """Consecutive documents in runs of about ``unit_bytes`` (and ``unit_records`` at most)."""
    n = len(doc_bytes)
    if n == 0:
        return []
    ends = np.cumsum(doc_bytes)
    out, a = [], 0
    cap = spec.unit_records or n
    while a < n:
        base = int(ends[a - 1]) if a else 0
        b = int(np.searchsorted(ends, base + spec.unit_bytes, side="right"))
        b = min(max(b, a + 1), a + cap, n)
        out.append((a, b))
        a = b
    return out


FORMAT = IndexedDataset()

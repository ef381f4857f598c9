"""MosaicML Streaming MDS datasets: an ``index.json`` and the shards it lists.

``MDSWriter`` writes shards of samples and an ``index.json`` naming each shard's file
(``raw_data``, or ``zip_data`` where it compressed them), sample count, column names and
encodings. A shard is::

    samples N u32 | offsets u32[N + 1] (bytes from the shard's start) | config JSON | samples
    sample: u32 size of each variable-size column, then each column's bytes (columns by name)

The source's path is the folder holding ``index.json`` (or the file itself); the catalog's one
file is that index, and a record's offset is its sample number across the index's shards. Read
units are shards (or runs of ``unit_records`` samples of one); a read takes the offsets of its
samples, then the one byte range they span (a compressed shard is read and decompressed whole:
zstd, as ``streaming`` writes it). The token column (``sources[].tokens``) may be encoded
``ndarray[:dtype[:shape]]``, ``bytes`` (raw ids of ``sources[].dtype``, int64 if not given, as
LLM Foundry wrote them) or ``json`` (a list); a text column (``sources[].text``) ``str``. A mask
column (``sources[].mask``) is read beside the ids from an integer or boolean ``ndarray`` or a
``json`` list (:mod:`.token_masks`).
Discovery checks that every shard the index lists is there, and the columns; where each
sample's token count follows exactly from the shard headers (:mod:`.mds_lengths`), it gives
them up front, as Megatron's ``.idx`` does.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import numpy as np

from omniload_dask.errors import SourceError
from omniload_dask.plan import SourceSpec
from omniload_dask.sources.base import RawRecords, Units
from omniload_dask.sources.files import open_file
from omniload_dask.sources.mds_lengths import shard_lengths
from omniload_dask.sources.token_masks import masked_records

__all__ = ["FORMAT", "MosaicShards"]

# ``streaming``'s NDArray dtype codes (a dynamic dtype is one byte before the values)
_VALUE_DTYPES = {8: "uint8", 9: "int8", 16: "uint16", 17: "int16", 18: "float16", 32: "uint32",
                 33: "int32", 34: "float32", 64: "uint64", 65: "int64", 66: "float64"}  # fmt: skip
_TOKEN_ENCODINGS = ("ndarray", "bytes", "json")


class MosaicShards:
    """The MDS format: units are runs of samples of one shard."""

    name: str = "mds"
    extensions: tuple[str, ...] = ("index.json",)

    def units(
        self,
        spec: SourceSpec,
        fs: Any,
        files: list[str],
        sizes: list[int],
        skip_unreadable: bool = False,
    ) -> Units:
        """Every shard of every index, in runs of ``unit_records`` samples where set."""
        rows: list[tuple[int, int, int]] = []
        lengths: list[np.ndarray] | None = []
        for i, url in enumerate(files):
            shards = _index(fs, url, spec.name)
            base = url.rsplit("/", 1)[0]
            for k, shard in enumerate(shards.shards):
                _check_columns(spec, url, k, shard)
                name = _shard_file(shard)
                if not fs.exists(fs._strip_protocol(f"{base}/{name}")):
                    raise SourceError(
                        f"source {spec.name!r}: file {url!r}: shard {k} is {name!r}, which "
                        f"is not in {base!r} (a missing or partly copied dataset?)"
                    )
                if lengths is not None:  # every sample's tokens, where the header tells
                    known = shard_lengths(spec, fs, fs._strip_protocol(base), shard)
                    lengths = None if known is None else [*lengths, known]
                first, count = int(shards.firsts[k]), int(shard["samples"])
                step = spec.unit_records or max(count, 1)
                rows.extend(
                    (i, lo, min(lo + step, first + count))
                    for lo in range(first, first + count, step)
                )
        table = np.asarray(rows, dtype=np.int64).reshape(-1, 3)
        counts = table[:, 2] - table[:, 1]
        if not lengths:
            return Units(table, counts, split="rows")
        # rows run through each shard's samples in order, shard after shard: their lengths
        index = np.zeros(len(table) + 1, np.int64)
        np.cumsum(counts, out=index[1:])
        return Units(table, counts, "rows", lengths=np.concatenate(lengths), length_index=index)

    def read(self, spec: SourceSpec, fs: Any, path: str, start: int, stop: int) -> RawRecords:
        """Samples ``[start, stop)`` (of one shard): token ids, or texts for the tokenizer."""
        url = fs.unstrip_protocol(path)
        index = _index(fs, url, spec.name)
        k = int(np.searchsorted(index.firsts, start, side="right")) - 1
        shard = index.shards[k]
        lo, hi = start - int(index.firsts[k]), stop - int(index.firsts[k])
        blob, at = _sample_bytes(fs, path.rsplit("/", 1)[0], shard, lo, hi)
        names = list(shard["column_names"])
        wanted = [spec.tokens or spec.text] + ([spec.mask.column] if spec.mask else [])
        cols = [names.index(c) for c in wanted]
        fixed = shard["column_sizes"]
        variable = [j for j, size in enumerate(fixed) if size is None]
        values: list[list[bytes]] = [[] for _ in cols]
        for s in range(hi - lo):
            a, b = int(at[s]), int(at[s + 1])
            head = np.frombuffer(blob, np.uint32, len(variable), a)
            sizes = list(fixed)
            for j, size in zip(variable, head.tolist(), strict=True):
                sizes[j] = size
            for got, col in zip(values, cols, strict=True):
                begin = a + 4 * len(variable) + sum(sizes[:col])
                end = begin + sizes[col]
                if end > b:
                    raise SourceError(f"sample {start + s}: its columns run past its end")
                got.append(blob[begin:end])
        offsets = np.arange(start, stop, dtype=np.int64)
        if spec.tokens is None:
            return RawRecords([v.decode("utf-8") for v in values[0]], offsets, [])
        encodings = [shard["column_encodings"][col] for col in cols]
        arrays = [_decode_ids(spec, encodings[0], v) for v in values[0]]
        lengths = np.asarray([len(x) for x in arrays], np.int64)
        tokens = np.concatenate(arrays) if arrays else np.zeros(0, np.int64)
        if spec.mask is None:
            return RawRecords.of_tokens(tokens, lengths, offsets)
        masks, reasons = [], {}
        for r, data in enumerate(values[1]):
            mask = _decode_ids(spec, encodings[1], data, mask=True)
            if mask.size and mask.dtype.kind not in "iub":
                reasons[r] = f"mask column {spec.mask.column!r} holds {mask.dtype} values"
                mask = np.zeros(0, np.int64)
            masks.append(mask.astype(np.int64))
        flat = np.concatenate(masks) if masks else np.zeros(0, np.int64)
        counts = np.asarray([len(m) for m in masks], np.int64)
        return masked_records(spec, tokens, lengths, flat, counts, offsets, reasons)


class _Index:
    """The shards an ``index.json`` lists, and each one's first sample number."""

    def __init__(self, shards: list[dict[str, Any]]) -> None:
        self.shards = shards
        counts = [int(s["samples"]) for s in shards]
        self.firsts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


@functools.lru_cache(maxsize=256)
def _index(fs: Any, url: str, source: str) -> _Index:
    """The parsed ``index.json`` at ``url``; a SourceError saying what is wrong with it."""
    try:
        with open_file(fs, fs._strip_protocol(url)) as f:
            data = json.loads(f.read())
        shards = list(data["shards"])
        for shard in shards:
            if shard.get("format") != "mds":
                raise ValueError(f"a shard of format {shard.get('format')!r}, not mds")
            int(shard["samples"])
    except (ValueError, KeyError, TypeError) as exc:
        raise SourceError(
            f"source {source!r}: file {url!r} is not an MDS index.json ({exc})"
        ) from None
    return _Index(shards)


def _shard_file(shard: dict[str, Any]) -> str:
    """The file the shard's bytes are in: compressed where ``streaming`` compressed it."""
    zipped = shard.get("zip_data")
    return str(zipped["basename"] if zipped else shard["raw_data"]["basename"])


def _check_mask_column(spec: SourceSpec, where: str, shard: dict[str, Any]) -> None:
    """The shard has the source's mask column, as an integer/boolean ndarray or json list."""
    assert spec.mask is not None
    names, column = list(shard["column_names"]), spec.mask.column
    if column not in names:
        raise SourceError(
            f"{where} has no mask column {column!r} (columns: {', '.join(names)}); set "
            "sources[].mask.column"
        )
    kind, *args = str(shard["column_encodings"][names.index(column)]).split(":")
    if kind == "json" or (kind == "ndarray" and (not args or np.dtype(args[0]).kind in "iub")):
        return
    raise SourceError(
        f"{where}: mask column {column!r} is encoded {shard['column_encodings'][names.index(column)]!r};"
        " a mask is read from integer or boolean 'ndarray' columns and 'json' lists"
    )


def _check_columns(spec: SourceSpec, url: str, k: int, shard: dict[str, Any]) -> None:
    """The shard has the source's columns, in encodings read here."""
    column = spec.tokens or spec.text
    names = list(shard["column_names"])
    where = f"source {spec.name!r}: file {url!r}: shard {k}"
    if column not in names:
        field = "tokens" if spec.tokens else "text"
        raise SourceError(
            f"{where} has no column {column!r} (columns: {', '.join(names)}); set sources[].{field}"
        )
    encoding = str(shard["column_encodings"][names.index(column)])
    if spec.tokens is not None and encoding.split(":")[0] not in _TOKEN_ENCODINGS:
        raise SourceError(
            f"{where}: column {column!r} is encoded {encoding!r}; token ids are read from "
            f"{', '.join(_TOKEN_ENCODINGS)} columns"
        )
    if spec.tokens is None and encoding != "str":
        raise SourceError(f"{where}: column {column!r} is encoded {encoding!r}, not 'str'")
    if spec.mask is not None:
        _check_mask_column(spec, where, shard)
    compression = shard.get("compression")
    if compression and not str(compression).startswith("zstd"):
        raise SourceError(f"{where}: compression {compression!r}; zstd shards are read here")


def _sample_bytes(
    fs: Any, folder: str, shard: dict[str, Any], lo: int, hi: int
) -> tuple[bytes, np.ndarray]:
    """The bytes of samples ``[lo, hi)`` of a shard, and where each starts in them."""
    path = f"{folder}/{_shard_file(shard)}"
    if shard.get("zip_data"):
        import zstandard

        with open_file(fs, path) as f:
            data = zstandard.ZstdDecompressor().decompressobj().decompress(f.read())
        at = np.frombuffer(data, np.uint32, hi - lo + 1, 4 + 4 * lo).astype(np.int64)
        return data, at
    with open_file(fs, path) as f:
        f.seek(4 + 4 * lo)
        at = np.frombuffer(f.read(4 * (hi - lo + 1)), np.uint32).astype(np.int64)
        f.seek(int(at[0]))
        data = f.read(int(at[-1] - at[0]))
    return data, at - at[0]


def _decode_ids(spec: SourceSpec, encoding: str, data: bytes, mask: bool = False) -> np.ndarray:
    """One sample's token ids (or, ``mask``, its mask values: as stored) from its column bytes."""
    kind, *args = encoding.split(":")
    if kind == "bytes":
        return np.frombuffer(data, np.dtype(spec.dtype or "int64"))
    if kind == "json":
        return np.asarray(json.loads(data), dtype=None if mask else np.int64).reshape(-1)
    at = 0
    if args:
        dtype = args[0]
    else:
        dtype = _VALUE_DTYPES[data[0]]
        at = 1
    if len(args) < 2:  # a dynamic shape: ndim and shape dtype in one byte, then the shape
        ndim, code = data[at] >> 2, data[at] % 4
        at += 1 + ndim * (2**code)
    return np.frombuffer(data, np.dtype(dtype), offset=at)


FORMAT = MosaicShards()

"""Token counts of an MDS shard's samples from its header, where they are exact.

An MDS shard starts with its sample count and each sample's byte offset (see :mod:`.mds`); a
sample holds a ``u32`` size for each variable-size column, then its columns. The header thus
gives each sample's size, not each column's, and a token count follows from it only when:

- the token column has a fixed shape (``ndarray:DTYPE:SHAPE``): every sample holds the
  shape's product of ids, and no byte needs reading;
- the shard is stored uncompressed, the token column is its only variable-size column and is
  encoded ``bytes`` (raw ids of ``sources[].dtype``): its size is the sample's less the one
  ``u32`` and the fixed columns, and its ids that size over the dtype's item size.

A dynamic-shape ``ndarray`` column (``ndarray:uint32``) is not among them: each sample starts
it with its own number of dimensions and the width of their sizes, which no header holds, so
its counts come with its reads. Where a header does not add up (its count is not the index's,
its offsets do not grow, a size is not a whole number of ids) no counts are given either, and
the read reports the error as it would without them.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from omniload_dask.plan import SourceSpec
from omniload_dask.sources.files import open_file

__all__ = ["shard_lengths"]


def shard_lengths(
    spec: SourceSpec, fs: Any, folder: str, shard: dict[str, Any]
) -> np.ndarray | None:
    """Each sample's token count in ``shard`` (of the index in ``folder``), or None where
    only reading the samples would tell (see the module doc)."""
    names = list(shard["column_names"])
    if spec.tokens is None or spec.tokens not in names:
        return None
    col = names.index(spec.tokens)
    samples = int(shard["samples"])
    kind, *args = str(shard["column_encodings"][col]).split(":")
    if kind == "ndarray" and len(args) == 2:
        shape = [int(d) for d in args[1].split(",")]
        return np.full(samples, math.prod(shape), np.int64)
    sizes = list(shard["column_sizes"])
    variable = [j for j, size in enumerate(sizes) if size is None]
    if kind != "bytes" or variable != [col] or shard.get("zip_data"):
        return None
    offsets = _offsets(fs, f"{folder}/{shard['raw_data']['basename']}", samples)
    if offsets is None:
        return None
    fixed = sum(int(s) for j, s in enumerate(sizes) if j != col)
    column = np.diff(offsets) - 4 - fixed
    item = np.dtype(spec.dtype or "int64").itemsize
    if (column < 0).any() or (column % item).any():
        return None
    return column // item


def _offsets(fs: Any, path: str, samples: int) -> np.ndarray | None:
    """The shard's ``samples + 1`` sample offsets, or None where its header is not that."""
    with open_file(fs, path) as f:
        head = f.read(4 * (samples + 2))
    if len(head) != 4 * (samples + 2):
        return None
    values = np.frombuffer(head, np.uint32).astype(np.int64)
    offsets = values[1:]
    if int(values[0]) != samples or (np.diff(offsets) < 0).any():
        return None
    return offsets

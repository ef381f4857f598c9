"""Context-parallel slices: each cp rank gets the zigzag share of every document.

A document of L tokens is cut into 2*cp chunks of near-equal length (chunk j is tokens
``[j*L // (2cp), (j+1)*L // (2cp))``) and cp rank c takes chunks c and 2cp-1-c. Under causal
attention the token at position p attends to p+1 keys, so an early chunk paired with its mirror
late chunk carries the same work on every rank::

    L = 8, cp = 2: chunks [0 1] [2 3] [4 5] [6 7]
    rank 0: chunks 0 and 3 -> positions 0 1 6 7    work (1+2) + (7+8) = 18
    rank 1: chunks 1 and 2 -> positions 2 3 4 5    work (3+4) + (5+6) = 18

A slice keeps its tokens' own ``position_ids`` and ``labels`` (the label of a chunk's last token
is the first token of the next chunk, taken before slicing), ``cu_seqlens`` over its local
documents (each document's two chunks together), and the whole micro-batch's boundaries as
``cu_seqlens_global``, which ring attention needs to know where each document's chunks lie;
``num_loss_tokens`` counts the slice's own labels that are not -100.
With images, ``image_token_map`` is sliced like the tokens (each cp rank scatters the encoder
outputs of the image tokens it holds); the per-image fields (patches, grids, positions) stay
those of the whole micro-batch.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from omniload_dask.batching.formats import IGNORE_INDEX, GroupBatch
from omniload_dask.batching.wire import expand

__all__ = ["slice_batch", "slice_micro_batch", "zigzag_index"]


def zigzag_index(cu_seqlens: np.ndarray, cp: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """Token positions (in the packed micro-batch) of cp rank ``rank``, and local lengths.

    Returns ``(index, local)``: ``index`` lists the slice's tokens in order, document by
    document (chunk ``rank`` then chunk ``2cp-1-rank``); ``local[d]`` is how many of document
    d's tokens the slice holds.
    """
    if not 0 <= rank < cp:
        raise ValueError(f"cp rank must be in [0, {cp}), got {rank}")
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    lengths = np.diff(cu)
    n = 2 * cp
    chunk = np.array([rank, n - 1 - rank], dtype=np.int64)
    lo = cu[:-1, None] + (chunk[None, :] * lengths[:, None]) // n
    hi = cu[:-1, None] + ((chunk[None, :] + 1) * lengths[:, None]) // n
    sizes = (hi - lo).ravel()
    before = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    index = np.repeat(lo.ravel() - before, sizes) + np.arange(int(sizes.sum()), dtype=np.int64)
    return index, (hi - lo).sum(axis=1)


def slice_micro_batch(mb: dict[str, Any], cp: int, rank: int) -> dict[str, Any]:
    """Slice ``rank`` of one packed micro-batch (see the module docstring); a slice is in full
    form (:func:`~.wire.expand`), as its labels and positions no longer follow from its
    tokens."""
    mb = expand(mb)
    index, local = zigzag_index(mb["cu_seqlens"], cp, rank)
    out = dict(mb)
    cu = np.zeros(len(local) + 1, dtype=np.int32)
    np.cumsum(local, out=cu[1:])
    per_token = ("input_ids", "labels", "position_ids", "image_token_map")
    for key in per_token:
        if key in mb:
            out[key] = mb[key][index]
    width = len(mb["input_ids"])
    if width > int(mb["num_tokens"]):  # padded to seq_len: pad each slice to one width
        peers = [int(zigzag_index(mb["cu_seqlens"], cp, c)[1].sum()) for c in range(cp)]
        local_width = max(-(-width // cp), *peers)
        out["input_ids"] = _pad(out["input_ids"], local_width, int(mb["input_ids"][-1]))
        out["labels"] = _pad(out["labels"], local_width, IGNORE_INDEX)
        out["position_ids"] = _pad(out["position_ids"], local_width, 0)
        if "image_token_map" in mb:
            out["image_token_map"] = _pad(out["image_token_map"], local_width, -1)
    out.update(
        cu_seqlens=cu,
        cu_seqlens_global=mb["cu_seqlens"],
        max_seqlen=int(local.max()) if len(local) else 0,
        max_seqlen_global=mb["max_seqlen"],
        num_tokens=int(local.sum()),
        num_loss_tokens=int((out["labels"] != IGNORE_INDEX).sum()),
        cp_rank=rank,
        cp_size=cp,
    )
    return out


def slice_batch(batch: GroupBatch, cp: int, rank: int) -> GroupBatch:
    """Slice ``rank`` of every micro-batch of a group's batch."""
    return GroupBatch(
        step=batch.step,
        group=batch.group,
        micro_batches=[slice_micro_batch(mb, cp, rank) for mb in batch.micro_batches],
    )


def _pad(values: np.ndarray, width: int, fill: int) -> np.ndarray:
    out = np.full(width, fill, dtype=values.dtype)
    out[: len(values)] = values
    return out

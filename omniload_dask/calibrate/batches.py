"""One packed micro-batch as arrays in the feeder's layout, with random tokens and pixels.

The runner times the model on these; only the shapes matter (the layout is that of
:mod:`omniload_dask.batching.formats`)::

    MicroBatch((6, 3), images=(8,), image_piece=(0,)), merge 2
    cu_seqlens       [0 6 9]
    position_ids     [0 1 2 3 4 5 0 1 2]
    image_token_map  [-1 0 1 -1 -1 -1 -1 -1 -1]     8 patches = 2 tokens, after the first token
    labels           -100 at the image tokens and at each document's last token
"""

from __future__ import annotations

import numpy as np

from omniload_dask.calibrate.grid import MicroBatch
from omniload_dask.errors import CalibrationError

__all__ = ["IGNORE_INDEX", "packed_arrays"]

IGNORE_INDEX = -100


def packed_arrays(
    mb: MicroBatch, vocab: int, rng: np.random.Generator, patch_size: int = 14, merge: int = 2
) -> dict[str, np.ndarray]:
    """Numpy arrays of one packed micro-batch (the feeder's layout, random content).

    Image i's tokens (``patches / merge**2``) sit right after the first token of piece
    ``image_piece[i]`` (or of the image before it in the same piece).
    """
    lengths = np.asarray(mb.pieces, dtype=np.int64)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    n = int(cu[-1])
    ids = rng.integers(0, vocab, n, dtype=np.int64)
    labels = np.append(ids[1:], IGNORE_INDEX)
    labels[cu[1:] - 1] = IGNORE_INDEX  # no target across a document's end
    position = np.arange(n, dtype=np.int64) - np.repeat(cu[:-1].astype(np.int64), lengths)
    out = {"input_ids": ids, "labels": labels, "position_ids": position, "cu_seqlens": cu}
    if not mb.images:
        return out
    window = merge * merge
    token_map = np.full(n, -1, dtype=np.int64)
    cu_patches, cu_tokens, grid = [0], [0], []
    next_at = {p: int(cu[p]) + 1 for p in set(mb.image_piece)}
    for patches, piece in zip(mb.images, mb.image_piece, strict=True):
        tokens = patches // window
        if patches % window or tokens < 1:
            raise CalibrationError(f"images: {patches} patches is not a multiple of {window}")
        at = next_at[piece]
        if at + tokens > cu[piece + 1]:
            raise CalibrationError(f"images: {tokens} image tokens do not fit piece {piece}")
        token_map[at : at + tokens] = np.arange(cu_tokens[-1], cu_tokens[-1] + tokens)
        next_at[piece] = at + tokens
        cu_patches.append(cu_patches[-1] + patches)
        cu_tokens.append(cu_tokens[-1] + tokens)
        grid.append((merge, patches // merge))
    labels[token_map >= 0] = IGNORE_INDEX
    out["pixel_patches"] = rng.integers(
        0, 256, (cu_patches[-1], patch_size, patch_size, 3), dtype=np.uint8
    )
    out["image_grid_hw"] = np.asarray(grid, dtype=np.int32)
    out["image_cu_patches"] = np.asarray(cu_patches, dtype=np.int32)
    out["image_cu_tokens"] = np.asarray(cu_tokens, dtype=np.int32)
    out["image_token_map"] = token_map
    return out

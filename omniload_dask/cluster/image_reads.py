"""Images of a read: decoded into patch grids, and their placeholders put into the documents.

A read task of an image-text source decodes every record's images (:func:`decode_images`; a
record with an image that cannot be used becomes a bad record), then patchifies them and puts
their placeholder tokens into the tokenized documents (:func:`place`): right after each BOS for
image-text records (:func:`~omniload_dask.preprocess.interleave.place_images`), where the turns
mark them for conversations (their runs are already in the tokens,
:mod:`omniload_dask.preprocess.chat_images`). The result is the shard's
:class:`~omniload_dask.batching.formats.ImageTable`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from omniload_dask.batching.formats import ImageTable
from omniload_dask.plan import ImageSpec, TokenizerSpec
from omniload_dask.preprocess.image import BadImage, decode, patchify
from omniload_dask.preprocess.interleave import place_images
from omniload_dask.sources import RawRecords

__all__ = ["decode_images", "place"]


def decode_images(
    records: RawRecords, spec: ImageSpec
) -> tuple[RawRecords, list[list[np.ndarray]]]:
    """Decode every record's images into patch grids; a record with a bad image becomes bad."""
    assert records.images is not None
    texts: list[str] = []
    offsets: list[int] = []
    pixels: list[list[np.ndarray]] = []
    bad = list(records.bad)
    chats = records.chats if records.chats is not None else records.texts  # (carried along)
    kept: list[Any] = []
    for text, offset, blobs, chat in zip(
        records.texts, records.offsets.tolist(), records.images, chats, strict=True
    ):
        decoded = []
        for j, blob in enumerate(blobs):
            try:
                decoded.append(decode(blob, spec))
            except BadImage as exc:
                label = f"image {j}" if len(blobs) > 1 else "image"
                bad.append((offset, f"{label}: {exc}"))
                break
        else:
            texts.append(text)
            offsets.append(offset)
            pixels.append(decoded)
            kept.append(chat)
    bad.sort(key=lambda b: b[0])
    out = RawRecords(texts=texts, offsets=np.asarray(offsets, dtype=np.int64), bad=bad,
                     chats=kept if records.chats is not None else None)  # fmt: skip
    return out, pixels


def place(
    tokens: np.ndarray,
    offsets: np.ndarray,
    pixels: list[list[np.ndarray]],
    spec: ImageSpec,
    placeholder: int,
    tokenizer: TokenizerSpec,
    runs: list[np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray, ImageTable]:
    """Patchify the decoded images and put their placeholder tokens into the documents (after
    each BOS; conversations have them already, starting at ``runs``, per record)."""
    p, m = spec.patch_size, spec.merge
    images = [img for imgs in pixels for img in imgs]
    grid = np.asarray(
        [(img.shape[0] // p, img.shape[1] // p) for img in images], dtype=np.int32
    ).reshape(-1, 2)
    record = np.repeat(np.arange(len(pixels), dtype=np.int64), [len(i) for i in pixels])
    count = grid[:, 0].astype(np.int64) * grid[:, 1]
    image_tokens = count // (m * m)
    if runs is not None:
        starts = np.concatenate([np.zeros(0, np.int64), *runs])
    else:
        skip = 1 if tokenizer.add_bos else 0
        tokens, offsets, starts = place_images(
            tokens, offsets, record, image_tokens, placeholder, skip
        )
    cu = np.zeros(len(count) + 1, dtype=np.int64)
    np.cumsum(count, out=cu[1:])
    patches = np.empty((int(cu[-1]), p, p, 3), dtype=np.uint8)  # filled in place: one copy
    for i, img in enumerate(images):
        patchify(img, p, m, out=patches[cu[i] : cu[i + 1]])
    table = ImageTable(
        patches=patches,
        cu_patches=cu,
        grid=grid,
        record=record,
        token_start=starts,
        tokens=image_tokens,
    )
    return tokens, offsets, table

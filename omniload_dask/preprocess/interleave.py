"""Place image placeholder tokens into tokenized documents.

A record's images go, in order, right after its BOS token (at the very start without BOS), each
as ``tokens`` copies of the placeholder id; its text follows::

    text "a b" -> [BOS a b EOS]; two images of 3 and 2 tokens, placeholder I
    document   [BOS I I I I I a b EOS]
    images     token_start 1 and 4 (offsets inside the document), tokens 3 and 2

That is the image-then-caption layout most vision-language training uses; the batch says where
every image's tokens sit, so a model can scatter the encoder's outputs into the sequence.
"""

from __future__ import annotations

import numpy as np

__all__ = ["place_images"]


def place_images(
    tokens: np.ndarray,
    offsets: np.ndarray,
    image_record: np.ndarray,
    image_tokens: np.ndarray,
    placeholder: int,
    skip: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Insert each image's placeholders into its record's tokens (vectorised).

    ``image_record[i]`` is the record (index into ``offsets``) of image i, nondecreasing;
    ``skip`` tokens (1 with a BOS, else 0) stay in front of a record's images. Returns the new
    ``tokens`` and ``offsets``, and each image's first token inside its document.
    """
    offsets = np.asarray(offsets, dtype=np.int64)
    image_record = np.asarray(image_record, dtype=np.int64)
    image_tokens = np.asarray(image_tokens, dtype=np.int64)
    n = len(offsets) - 1
    lengths = np.diff(offsets)
    per_record = np.bincount(image_record, weights=image_tokens, minlength=n).astype(np.int64)
    new_offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths + per_record, out=new_offsets[1:])
    out = np.full(int(new_offsets[-1]), placeholder, dtype=np.uint32)
    record = np.repeat(np.arange(n, dtype=np.int64), lengths)
    within = np.arange(len(tokens), dtype=np.int64) - offsets[:-1][record]
    lead = np.minimum(skip, lengths)  # tokens kept before the images
    shifted = within >= lead[record]
    out[new_offsets[:-1][record] + within + np.where(shifted, per_record[record], 0)] = tokens
    # Start of each image: its record's lead, plus the tokens of its earlier images there.
    before = (
        np.concatenate([[0], np.cumsum(image_tokens)[:-1]]) if len(image_tokens) else image_tokens
    )
    record_first = np.concatenate([[0], np.cumsum(per_record)[:-1]]) if n else per_record
    starts = (
        lead[image_record] + before - record_first[image_record] if len(image_tokens) else before
    )
    return out, new_offsets, np.asarray(starts, dtype=np.int64)

"""Labels of a packed micro-batch: the one place that decides which positions the loss counts.

A position's label is the next token of its document piece when that token is a target, else
-100 (:data:`IGNORE_INDEX`). Not targets: a document's first token (nothing predicts it), image
placeholders, the tokens a chat source's ``train_on`` rule leaves out (the shard's ``target``
mask), and nothing past a piece's last token (the next token lies in another micro-batch)::

    input_ids     [5 6 7 | 8 9 10]      two pieces, cu_seqlens [0 3 6]
    target        [T T T | T F T]        (9 is a prompt token of a chat)
    labels        [6 7 -100 -100 10 -100]
    positions     [T T F F T F]          loss_positions: where labels are not -100

Every path a micro-batch takes (wire form and :func:`expand`, context-parallel slices, the
fan-out, the DataLoader adapter, resume) gets its labels from :func:`derived`, so a mask holds
on each of them; pre-tokenized sources with masks go through the same function.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["IGNORE_INDEX", "derived", "expand", "loss_positions"]

IGNORE_INDEX = -100


def expand(mb: dict[str, Any]) -> dict[str, Any]:
    """The full packed layout of a micro-batch in wire form (a full one is returned as is)::

    wire   input_ids [5 6 7 8 9] (uint32)   cu_seqlens [0 3 5]   num_tokens 5
    full   input_ids [5 6 7 8 9] (int64)    labels [6 7 -100 9 -100]   position_ids [0 1 2 0 1]
    """
    if "labels" in mb:
        return mb
    out = dict(mb)
    input_ids = mb["input_ids"].astype(np.int64)
    out["input_ids"] = input_ids
    bits = out.pop("target_bits", None)
    target = None if bits is None else np.unpackbits(bits, count=len(input_ids)).astype(bool)
    out["position_ids"], out["labels"] = derived(
        input_ids, mb["cu_seqlens"], int(mb["num_tokens"]), mb.get("image_token_map"), target
    )
    return out


def derived(
    input_ids: np.ndarray,
    cu: np.ndarray,
    total: int,
    token_map: np.ndarray | None,
    target: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """``position_ids`` and ``labels`` of a packed micro-batch (padding: 0 and -100)."""
    width = len(input_ids)
    bounds = cu.astype(np.int64)
    starts = np.repeat(bounds[:-1], bounds[1:] - bounds[:-1])
    position_ids = np.zeros(width, dtype=np.int64)
    position_ids[:total] = np.arange(total, dtype=np.int64) - starts
    labels = np.full(width, IGNORE_INDEX, dtype=np.int64)
    counts = loss_positions(cu, total, token_map, target)
    at = np.flatnonzero(counts)  # (never a piece's last token: at + 1 stays inside)
    labels[at] = input_ids[at + 1]
    return position_ids, labels


def loss_positions(
    cu: np.ndarray, total: int, token_map: np.ndarray | None, target: np.ndarray | None
) -> np.ndarray:
    """Which of a micro-batch's ``total`` positions have a label the loss counts: not a
    piece's last token, not before an image placeholder or a token that is no target."""
    counts = np.zeros(total, dtype=bool)
    if total:
        counts[: total - 1] = True
        counts[cu[1:] - 1] = False
        if token_map is not None:  # image placeholders are never targets
            counts[: total - 1] &= token_map[1:total] < 0
        if target is not None:
            counts[: total - 1] &= target[1:total]
    return counts

"""Images in conversations: where a chat source's images go, and their runs of placeholders.

A chat source with images (``sources[].image`` and ``sources[].chat``) marks each image of a
record in its conversation, in one of two ways; the record's images fill the marks in order::

    content list (Hugging Face)  {"role": "user", "content": [{"type": "image"},
                                                             {"type": "text", "text": "What?"}]}
    marker (LLaVA / ShareGPT)    {"from": "human", "value": "<image>\\nWhat?"}

A marker in a text turn is turned into the content-list form before rendering (``"<image>\\n
What?"`` -> ``[{"type": "image"}, {"type": "text", "text": "\\nWhat?"}]``), so the template
renders every image as its model expects (Qwen2-VL's writes ``<|vision_start|><|image_pad|>
<|vision_end|>``). The rendered text is tokenized whole; each ``images.placeholder`` token in it
stands for the next image and becomes that image's run of ``patches / merge**2`` placeholders,
as the Qwen2-VL processor expands it; none of them is a target::

    tokens   ... <|vision_start|> <|image_pad|>      <|vision_end|> What ...
    image    4 x 4 patches, merge 2: 4 tokens
    out      ... <|vision_start|> <|image_pad|> x 4  <|vision_end|> What ...
    target   ...  (as rendered)   False x 4           (as rendered)

A record whose marks, or whose rendered placeholders, are not as many as its images is a bad
record (:class:`~omniload_dask.preprocess.chat.ChatError`), named or skipped and counted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from omniload_dask.plan import ImageSpec
from omniload_dask.preprocess.chat import ChatError

__all__ = ["MARKER", "expand_images", "image_token_counts", "mark_images"]

MARKER = "<image>"  # LLaVA's mark of an image in a text turn


def mark_images(conversation: list[Any], images: int) -> list[Any]:
    """The conversation with every image in content-list form; a :class:`ChatError` unless it
    marks exactly ``images`` images (the record's)."""
    out = []
    marks = 0
    for turn in conversation:
        content = turn.get("content")
        if isinstance(content, str) and MARKER in content:
            pieces = content.split(MARKER)
            parts: list[dict[str, Any]] = []
            for k, piece in enumerate(pieces):
                if k:
                    parts.append({"type": "image"})
                if piece:
                    parts.append({"type": "text", "text": piece})
            marks += len(pieces) - 1
            turn = {**turn, "content": parts}
        elif isinstance(content, list):
            # (Parquet structs give every part every key: drop the null ones a template tests)
            parts = [
                {k: v for k, v in p.items() if v is not None} if isinstance(p, Mapping) else p
                for p in content
            ]
            marks += sum(isinstance(p, Mapping) and p.get("type") == "image" for p in parts)
            turn = {**turn, "content": parts}
        out.append(turn)
    if marks != images:
        raise ChatError(
            f"the conversation marks {marks} image(s) ({{'type': 'image'}} parts or {MARKER!r} "
            f"in a text turn) but the record has {images}"
        )
    return out


def expand_images(
    ids: np.ndarray, target: np.ndarray, tokens: Sequence[int], placeholder: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each placeholder token of ``ids`` as its image's run of ``tokens[i]`` placeholders, not
    targets; the new ids and targets, and where each run starts. A :class:`ChatError` unless
    the rendering holds one placeholder per image."""
    at = np.flatnonzero(ids == placeholder)
    if len(at) != len(tokens):
        raise ChatError(
            f"the rendered conversation holds {len(at)} image placeholder(s) (token {placeholder}) "
            f"for {len(tokens)} image(s): the template must write images.placeholder once for "
            "each image part, and no text may hold it"
        )
    if not len(at):
        return ids, target, at.astype(np.int64)
    counts = np.asarray(tokens, dtype=np.int64)
    repeats = np.ones(len(ids), dtype=np.int64)
    repeats[at] = counts
    starts = at + np.concatenate([[0], np.cumsum(counts - 1)[:-1]])
    out_ids = np.repeat(ids, repeats)
    out_target = np.repeat(target, repeats)
    run = np.repeat(starts - (np.cumsum(counts) - counts), counts) + np.arange(int(counts.sum()))
    out_target[run] = False
    return out_ids, out_target, starts.astype(np.int64)


def image_token_counts(pixels: list[list[np.ndarray]], spec: ImageSpec) -> list[list[int]]:
    """Each record's images' placeholder counts: patches / merge**2 of each resized image."""
    p, m = spec.patch_size, spec.merge
    return [
        [(img.shape[0] // p) * (img.shape[1] // p) // (m * m) for img in imgs] for imgs in pixels
    ]

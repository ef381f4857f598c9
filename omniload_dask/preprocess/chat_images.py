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

OpenAI's ``{"type": "image_url", ...}`` parts and parts that carry their image (``{"type":
"image", "image": ...}``) mark images too; every mark becomes a plain ``{"type": "image"}``
part (the pixels come from the record's image column). A prompt/completion record marks its
images in its prompt's, then its completion's, messages.

A Hugging Face tokenizer reads the placeholder's text as its id; a byte or tiktoken one reads
all text as plain text, so the rendering is cut at the placeholder's text and each copy
becomes the id (:func:`encode_marked`)::

    rendering  "<|im_start|>user\n<image>What?"       images.placeholder "<image>" (byte)
    tokens     [60 124 ... 10] [258] [87 104 97 116 63]

A record whose marks, or whose rendered placeholders, are not as many as its images is a bad
record (:class:`~omniload_dask.preprocess.chat.ChatError`), named or skipped and counted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from omniload_dask.errors import SourceError
from omniload_dask.plan import ImageSpec, TokenizerSpec
from omniload_dask.preprocess.chat import ChatError

__all__ = [
    "IMAGE_TYPES",
    "MARKER",
    "encode_marked",
    "expand_images",
    "image_token_counts",
    "mark_images",
    "placeholder_text",
]

MARKER = "<image>"  # LLaVA's mark of an image in a text turn
# the content parts that mark an image: Hugging Face's ({"type": "image"}, also with the
# image or its url in the part) and OpenAI's ({"type": "image_url", "image_url": {"url": ...}})
IMAGE_TYPES = ("image", "image_url")


def mark_images(conversation: Any, images: int) -> Any:
    """The conversation with every image mark as a ``{"type": "image"}`` part; a
    :class:`ChatError` unless it marks exactly ``images`` images (the record's).

    A prompt/completion record (a mapping) is marked in its prompt, then its completion; one of
    plain strings has no template to write an image's tokens, so images there are an error."""
    if isinstance(conversation, Mapping):
        if isinstance(conversation["prompt"], str):
            if not images:
                return conversation
            raise ChatError(
                f"the record has {images} image(s) but its prompt and completion are plain "
                "strings, which no chat template renders, so nothing would write the image's "
                "tokens: give prompt and completion as lists of messages with image parts"
            )
        prompt, before = _marked(conversation["prompt"])
        completion, after = _marked(conversation["completion"])
        _check(before + after, images)
        return {**conversation, "prompt": prompt, "completion": completion}
    out, marks = _marked(conversation)
    _check(marks, images)
    return out


def _marked(conversation: list[Any]) -> tuple[list[Any], int]:
    """The turns with their marks as image parts, and how many there are."""
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
            parts = [_part(p) for p in content]
            marks += sum(isinstance(p, Mapping) and p.get("type") == "image" for p in parts)
            turn = {**turn, "content": parts}
        out.append(turn)
    return out, marks


def _part(part: Any) -> Any:
    """One content part: an image mark of any layout as ``{"type": "image"}`` (the pixels come
    from the image column, so a url or the image in the part is not rendered), else the part
    without its null keys (Parquet structs give every part every key, and a template tests
    them)."""
    if not isinstance(part, Mapping):
        return part
    if part.get("type") in IMAGE_TYPES:
        return {"type": "image"}
    return {k: v for k, v in part.items() if v is not None}


def _check(marks: int, images: int) -> None:
    if marks != images:
        kinds = " or ".join(f"{{'type': {t!r}}}" for t in IMAGE_TYPES)
        raise ChatError(
            f"the conversation marks {marks} image(s) ({kinds} parts or {MARKER!r} in a text "
            f"turn) but the record has {images}"
        )


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


def placeholder_text(tokenizer: TokenizerSpec, placeholder: str | int) -> str | None:
    """The text a rendering is cut at so that each of its copies becomes the placeholder id
    (:func:`encode_marked`): a byte or tiktoken tokenizer reads a special token's text as plain
    text; None for a Hugging Face one, whose added tokens' text is read as their ids."""
    if tokenizer.kind == "huggingface":
        return None
    if isinstance(placeholder, str):
        return placeholder
    for token, token_id in tokenizer.special_tokens.items():
        if token_id == placeholder:
            return token
    raise SourceError(  # (the plan's parser refuses such a plan: see check_chat_placeholder)
        f"images.placeholder: id {placeholder} has no text a chat template could write"
    )


def encode_marked(
    encoder: Any, text: str, mark: str, placeholder: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``text``'s tokens and each one's first and past-last character, as the tokenizer's
    ``encode_offsets`` gives them (``encoder``, :func:`~omniload_dask.preprocess.tokenize.
    load_tokenizer`'s), except that each copy of ``mark`` is the one token
    ``placeholder``: the text between copies is tokenized piece by piece, as ``tiktoken``'s
    ``encode(text, allowed_special={mark})`` does (no token spans a special token)."""
    ids: list[np.ndarray] = []
    starts: list[np.ndarray] = []
    ends: list[np.ndarray] = []
    at = 0
    for k, piece in enumerate(text.split(mark)):
        if k:
            ids.append(np.asarray([placeholder], dtype=np.uint32))
            starts.append(np.asarray([at], dtype=np.int64))
            ends.append(np.asarray([at + len(mark)], dtype=np.int64))
            at += len(mark)
        if piece:
            got, lo, hi = encoder.encode_offsets(piece)
            ids.append(np.asarray(got, dtype=np.uint32))
            starts.append(np.asarray(lo, dtype=np.int64) + at)
            ends.append(np.asarray(hi, dtype=np.int64) + at)
            at += len(piece)
    if not ids:
        return np.zeros(0, np.uint32), np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(ids), np.concatenate(starts), np.concatenate(ends)


def image_token_counts(pixels: list[list[np.ndarray]], spec: ImageSpec) -> list[list[int]]:
    """Each record's images' placeholder counts: patches / merge**2 of each resized image."""
    p, m = spec.patch_size, spec.merge
    return [
        [(img.shape[0] // p) * (img.shape[1] // p) // (m * m) for img in imgs] for imgs in pixels
    ]

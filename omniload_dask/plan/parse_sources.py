"""Parsers of what is read and how it becomes tokens: ``sources[]``, ``tokenizer``, ``images``.

A source's ``path`` is one path/URL or a list of them (globs allowed); ``image`` names the image
column of a Parquet source or the image files' extensions of a WebDataset source::

    - {name: captions, format: parquet, path: data/cap/*.parquet, image: jpeg, text: caption}
    - {name: laion, format: webdataset, path: data/laion/*.tar, image: [jpg, png], text: txt}

A source with both ``image`` and ``chat`` holds conversations whose turns mark where its images
go (a WebDataset record's conversation is its ``.json`` file; :mod:`omniload_dask.preprocess.
chat_images`).
"""

from __future__ import annotations

import os
import re
from typing import Any

from omniload_dask.plan.chat import read_chat
from omniload_dask.plan.choices import SOURCE_FORMATS, TOKENIZER_KINDS
from omniload_dask.plan.fields import Fields, fail, resolve_path
from omniload_dask.plan.limits import (
    MAX_EPOCHS,
    MAX_INPUT_PIXELS,
    MAX_PIXELS,
    MAX_TOKEN_ID,
    MAX_UNIT_BYTES,
    MAX_UNIT_RECORDS,
    MAX_WEIGHT,
    MIN_UNIT_BYTES,
)
from omniload_dask.plan.parse_tokens import read_token_fields
from omniload_dask.plan.specs import BYTE_IMAGE_TOKEN, ImageSpec, SourceSpec, TokenizerSpec

__all__ = [
    "FORMATS",
    "IMAGE_EXTENSIONS",
    "NAME_PATTERN",
    "TOKENIZER_KINDS",
    "parse_source",
    "read_images",
    "read_source",
    "read_tokenizer",
]

FORMATS = SOURCE_FORMATS
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")
NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}"  # plan and source names


def parse_source(data: Any, path: str = "source") -> SourceSpec:
    """Validate one source mapping (paths must already be absolute or URLs)."""
    return read_source(Fields(data, path), None)


def read_source(f: Fields, base_dir: str | os.PathLike[str] | None) -> SourceSpec:
    """One ``sources[]`` entry; relative local paths are taken from ``base_dir``."""
    name = f.text("name", pattern=NAME_PATTERN)
    fmt = f.choice("format", None, SOURCE_FORMATS)
    raw_path = f.required("path")
    if isinstance(raw_path, str):
        raw_paths = [raw_path]
    elif (
        isinstance(raw_path, (list, tuple))
        and raw_path
        and all(isinstance(p, str) and p for p in raw_path)
    ):
        raw_paths = list(raw_path)
    else:
        fail(
            f.at("path"), "must be a path/URL (globs allowed) or a non-empty list of them", raw_path
        )
    paths = tuple(resolve_path(p, base_dir, field=f.at("path")) for p in raw_paths)
    if fmt == "megatron":  # a Megatron prefix (``.../web_text_document``) names its .idx
        paths = tuple(_megatron_index(p) for p in paths)
    weight = f.number("weight", 1.0, min=0, max=MAX_WEIGHT)
    chat = read_chat(f.mapping("chat"), base_dir) if f.has("chat") else None
    if chat is not None and fmt not in ("jsonl", "parquet", "webdataset"):
        where, why = f.at("chat"), "conversations come from jsonl, parquet or webdataset sources"
        fail(where, why, f.raw("chat"))
    text = (
        chat.field if chat is not None else f.text("text", "txt" if fmt == "webdataset" else "text")
    )
    if chat is not None and f.has("text"):
        fail(f.at("text"), "a chat source names its fields in chat (chat.field)", f.raw("text"))
    image = _image_field(f, fmt)
    if fmt == "parquet" and image and image[0] in (chat.columns if chat else (text,)):
        what = "sources[].text" if chat is None else "the conversation's (sources[].chat)"
        fail(f.at("image"), f"must be another column than {what}", image[0])
    unit_records = f.optional_int("unit_records", min=1, max=MAX_UNIT_RECORDS)
    if unit_records is not None and fmt in ("jsonl", "flat"):
        fail(
            f.at("unit_records"),
            "only applies to parquet, webdataset, arrow, mds and megatron sources",
            unit_records,
        )
    if fmt == "webdataset" and unit_records is None:
        unit_records = 64
    # JSON Lines: the byte ranges a file is cut into; every format: with merge_bytes, up to how
    # many bytes of small whole files one read unit holds (sources.catalog.merge_small_files)
    unit_bytes = f.size("unit_bytes", 4 * 2**20, min=MIN_UNIT_BYTES, max=MAX_UNIT_BYTES)
    merge_bytes = f.size("merge_bytes", 2**20, min=0, max=MAX_UNIT_BYTES)
    opts = f.storage_options()
    epochs = f.optional_int("epochs", min=1, max=MAX_EPOCHS)
    token_fields = read_token_fields(f, fmt)
    if image and token_fields.get("tokens"):
        fail(f.at("tokens"), "a token source has no images", token_fields["tokens"])
    if chat is not None and token_fields.get("tokens"):
        fail(f.at("chat"), "a token source's records are token ids, not conversations")
    f.done()
    return SourceSpec(
        name=name,
        epochs=epochs,
        format=fmt,
        paths=paths,
        weight=weight,
        text=text,
        unit_bytes=unit_bytes,
        merge_bytes=merge_bytes,
        storage_options=opts,
        image=image,
        unit_records=unit_records,
        **token_fields,
        chat=chat,
    )


def _megatron_index(path: str) -> str:
    """The .idx of a Megatron path given as its prefix or its .bin (folders and globs as
    given)."""
    if path.endswith(".bin"):
        return path[: -len(".bin")] + ".idx"
    if path.endswith(("/", ".idx")) or set("*?[") & set(path) or os.path.isdir(path):
        return path
    return path + ".idx"


def _image_field(f: Fields, fmt: str) -> tuple[str, ...]:
    """``sources[].image``: a column (parquet) or the image files' extensions (webdataset)."""
    raw = f.raw("image")
    if raw is None:
        return IMAGE_EXTENSIONS if fmt == "webdataset" else ()
    if fmt not in ("parquet", "webdataset"):
        fail(f.at("image"), "images come from parquet or webdataset sources", raw)
    if fmt == "parquet":
        if isinstance(raw, (list, tuple)) and len(raw) == 1:
            raw = raw[0]
        if not isinstance(raw, str) or not raw:
            fail(f.at("image"), "must be the name of the image column", raw)
        return (raw,)
    items = raw.split(";") if isinstance(raw, str) else raw
    if (
        not isinstance(items, (list, tuple))
        or not items
        or not all(isinstance(x, str) and re.fullmatch(r"[A-Za-z0-9_.-]+", x) for x in items)
    ):
        fail(f.at("image"), "must be file extensions, e.g. [jpg, png] or 'jpg;png'", raw)
    return tuple(x.lower().lstrip(".") for x in items)


def read_tokenizer(f: Fields, base_dir: str | os.PathLike[str] | None) -> TokenizerSpec:
    """The ``tokenizer`` section: ``byte``; ``huggingface`` with its tokenizer.json; or
    ``tiktoken`` with its BPE file, pre-tokenizer ``pattern`` and ``special_tokens``::

        tokenizer: {kind: huggingface, path: tokenizer.json, bos: <s>, eos: </s>}
        tokenizer:
          kind: tiktoken
          path: tokenizer.model            # base64 token and rank per line
          pattern: <the pre-tokenizer regex published with the file>
          special_tokens: {"<|begin_of_text|>": 128000, "<|end_of_text|>": 128001}
          bos: "<|begin_of_text|>"
          eos: "<|end_of_text|>"
    """
    kind = f.choice("kind", "byte", TOKENIZER_KINDS)
    path = None
    if kind != "byte":
        path = resolve_path(f.text("path"), base_dir, field=f.at("path"))
    elif f.has("path"):
        fail(f.at("path"), "only applies to kind: huggingface or tiktoken", f.raw("path"))
    pattern, specials = _tiktoken_fields(f, kind)
    bos = f.raw("bos")
    eos = f.raw("eos")
    for key, value in (("bos", bos), ("eos", eos)):
        if value is not None and not isinstance(value, str):
            fail(f.at(key), "must be a token string such as '<s>'", value)
        if value is not None and kind == "byte":
            fail(f.at(key), "the byte tokenizer has fixed BOS (256) and EOS (257)", value)
        if value is not None and kind == "tiktoken" and value not in specials:
            known = ", ".join(map(repr, specials)) or "none"
            fail(f.at(key), f"must be one of tokenizer.special_tokens (have {known})", value)
    add_bos = f.flag("add_bos", kind == "byte" or bos is not None)
    add_eos = f.flag("add_eos", kind == "byte" or eos is not None)
    if kind != "byte" and add_bos and bos is None:
        fail(f.at("bos"), "is required when add_bos is true (name the BOS token, e.g. '<s>')")
    if kind != "byte" and add_eos and eos is None:
        fail(f.at("eos"), "is required when add_eos is true (name the EOS token, e.g. '</s>')")
    opts = f.storage_options()
    f.done()
    return TokenizerSpec(
        kind=kind,
        path=path,
        bos=bos,
        eos=eos,
        add_bos=add_bos,
        add_eos=add_eos,
        storage_options=opts,
        pattern=pattern,
        special_tokens=specials,
    )


def _tiktoken_fields(f: Fields, kind: str) -> tuple[str | None, dict[str, int]]:
    """``pattern`` (required) and ``special_tokens`` (token -> id) of a tiktoken tokenizer."""
    if kind != "tiktoken":
        for key in ("pattern", "special_tokens"):
            if f.has(key):
                fail(f.at(key), "only applies to kind: tiktoken", f.raw(key))
        return None, {}
    if not f.has("pattern"):
        fail(
            f.at("pattern"),
            "is required with kind: tiktoken (the pre-tokenizer regex that comes with the "
            "BPE file, e.g. Llama 3's)",
        )
    pattern = f.text("pattern")
    raw = f.plain_mapping("special_tokens")
    specials: dict[str, int] = {}
    for token, token_id in raw.items():
        where = f"{f.at('special_tokens')}[{token!r}]"
        if not isinstance(token, str) or not token:
            fail(f.at("special_tokens"), "keys must be non-empty token strings", token)
        if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
            fail(where, "must be a token id (an integer >= 0)", token_id)
        if token_id in specials.values():
            fail(where, "repeats the id of another special token", token_id)
        specials[token] = token_id
    return pattern, specials


def read_images(f: Fields, tokenizer: TokenizerSpec) -> ImageSpec:
    """The ``images`` section; the placeholder token must suit the tokenizer's kind."""
    d = ImageSpec()
    patch = f.integer("patch_size", d.patch_size, min=1, max=1024)
    merge = f.integer("merge", d.merge, min=1, max=16)
    factor = patch * merge
    min_pixels = f.integer(
        "min_pixels", max(d.min_pixels, factor * factor), min=factor * factor, max=MAX_PIXELS
    )
    max_pixels = f.integer(
        "max_pixels", max(d.max_pixels, min_pixels), min=min_pixels, max=MAX_PIXELS
    )
    max_input = f.integer("max_input_pixels", d.max_input_pixels, min=1, max=MAX_INPUT_PIXELS)
    raw = f.raw("placeholder")
    if tokenizer.kind == "byte":
        # (a string is the text a chat template writes for an image: it becomes the token)
        if raw is not None and raw != BYTE_IMAGE_TOKEN and not (isinstance(raw, str) and raw):
            fail(
                f.at("placeholder"),
                f"the byte tokenizer's image token is {BYTE_IMAGE_TOKEN} (or give the text a "
                "chat template writes for an image, which becomes that token)",
                raw,
            )
        placeholder: str | int = raw if isinstance(raw, str) else BYTE_IMAGE_TOKEN
    elif raw is None:
        fail(
            f.at("placeholder"),
            f"is required with a {tokenizer.kind} tokenizer (the image token, e.g. "
            "'<|image_pad|>')",
        )
    elif (
        isinstance(raw, bool)
        or not isinstance(raw, (str, int))
        or raw == ""
        or (isinstance(raw, int) and not 0 <= raw <= MAX_TOKEN_ID)
    ):
        fail(
            f.at("placeholder"), f"must be a token string or a token id in [0, {MAX_TOKEN_ID}]", raw
        )
    else:
        placeholder = raw
    f.done()
    return ImageSpec(
        patch_size=patch,
        merge=merge,
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        max_input_pixels=max_input,
        placeholder=placeholder,
    )


def check_chat_placeholder(images: ImageSpec, tokenizer: TokenizerSpec, source: str) -> None:
    """Conversations with images need the placeholder's text, which their template writes, to
    be one token id: a Hugging Face tokenizer reads its added token's text as that id; a byte
    or tiktoken one reads text as plain text, so the rendering is cut at the placeholder's text
    (:mod:`omniload_dask.preprocess.chat_images`), which the plan must give as a string (for
    tiktoken, or as the id of one of its ``special_tokens``)."""
    raw = images.placeholder
    if tokenizer.kind == "byte" and not isinstance(raw, str):
        fail("images.placeholder", f"source {source!r} holds conversations with images: with "
             f"the byte tokenizer give the text its chat template writes for an image (e.g. "
             f"'<image>'), which becomes token {BYTE_IMAGE_TOKEN}", raw)  # fmt: skip
    named = raw in tokenizer.special_tokens.values()
    if tokenizer.kind == "tiktoken" and isinstance(raw, int) and not named:
        fail("images.placeholder", f"source {source!r} holds conversations with images: give "
             "the placeholder as the text of a token (one of tokenizer.special_tokens, which "
             "its chat template writes), not an id without a text", raw)  # fmt: skip

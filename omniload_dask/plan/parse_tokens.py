"""The fields of a ``sources[]`` entry that token sources and user code add.

A token source holds token ids already (no tokenizer runs on it): Megatron ``IndexedDataset``
pairs and flat token arrays always, Arrow, Parquet and MDS sources when ``tokens`` names their
token-id column. It names the vocabulary its tokens were written with, which must agree with
the plan's tokenizer (checked when a job starts and by ``omniload validate``)::

    - name: web
      format: megatron
      path: data/web_text_document          # the .idx (or its prefix), a folder or a glob
      vocabulary: {size: 50257, eos_id: 50256}
    - name: code
      format: flat                          # nanoGPT-style uint16/uint32 .bin or .npy
      path: data/code/*.bin
      dtype: uint16
      eod: 50256                            # ends each document (kept as its last token)
      vocabulary: {size: 50257}
      transform: my_pkg.fim:apply           # run on the workers, see preprocess.transforms
    - name: sft
      format: arrow                         # save_to_disk folder of a pre-tokenized SFT set
      path: data/sft
      tokens: input_ids
      mask: {column: labels, kind: labels}  # -100 where the loss skips a token (or loss_mask)
      vocabulary: {size: 50257}

``transform`` / ``filter`` name ``package.module:function`` and apply to every source.
"""

from __future__ import annotations

import re
from typing import Any

from omniload_dask.plan.choices import FLAT_DTYPES, TOKEN_DTYPES
from omniload_dask.plan.fields import Fields, fail
from omniload_dask.plan.limits import MAX_TOKEN_ID
from omniload_dask.plan.specs import TOKEN_FORMATS, TokenMaskSpec

__all__ = [
    "FLAT_DTYPES",
    "FUNCTION_PATTERN",
    "MASK_KINDS",
    "TOKEN_COLUMN_FORMATS",
    "read_token_fields",
]

TOKEN_COLUMN_FORMATS = ("arrow", "parquet", "mds")  # a token-id column by name (``tokens``)
FUNCTION_PATTERN = r"[A-Za-z_][\w.]*:[A-Za-z_]\w*"
MASK_KINDS = ("loss_mask", "labels")


def read_token_fields(f: Fields, fmt: str) -> dict[str, Any]:
    """``tokens``, ``vocabulary``, ``dtype``, ``eod``, ``transform`` and ``filter`` of one
    source of format ``fmt``, as :class:`~omniload_dask.plan.specs.SourceSpec` keywords."""
    out: dict[str, Any] = {}
    if f.has("tokens"):
        if fmt not in TOKEN_COLUMN_FORMATS:
            fail(
                f.at("tokens"),
                f"names a token-id column of {'/'.join(TOKEN_COLUMN_FORMATS)} sources "
                f"({fmt} sources {'are token ids already' if fmt in TOKEN_FORMATS else 'have none'})",
                f.raw("tokens"),
            )
        out["tokens"] = f.text("tokens")
    is_tokens = fmt in TOKEN_FORMATS or "tokens" in out
    if f.has("mask"):
        out["mask"] = _mask(f, fmt, out.get("tokens"))
    else:
        f.raw("mask")
    out.update(_vocabulary(f, is_tokens))
    if f.has("eod") and fmt != "flat":
        fail(f.at("eod"), "only applies to format: flat (a flat token array)", f.raw("eod"))
    if f.has("dtype") and fmt not in ("flat", "mds"):
        fail(f.at("dtype"), "only applies to flat sources and MDS 'bytes' columns", f.raw("dtype"))
    if fmt == "mds" and f.has("dtype"):
        out["dtype"] = f.choice("dtype", None, TOKEN_DTYPES)
    if fmt == "flat":
        out["dtype"] = f.choice("dtype", "uint16", FLAT_DTYPES)
        eod = f.optional_int("eod", min=0, max=MAX_TOKEN_ID)
        if eod is None:
            eod = out.get("eos_id")
        if eod is None:
            fail(
                f.at("eod"),
                "is required with format: flat (the id that ends each document, e.g. "
                "GPT-2's <|endoftext|> 50256), or give vocabulary.eos_id",
            )
        out["eod"] = eod
    for key in ("transform", "filter"):
        if f.has(key):
            value = f.raw(key)
            if not isinstance(value, str) or not re.fullmatch(FUNCTION_PATTERN, value):
                fail(f.at(key), "must name a function as 'package.module:function'", value)
            out[key] = value
        else:
            f.raw(key)
    return out


def _vocabulary(f: Fields, is_tokens: bool) -> dict[str, Any]:
    """``vocabulary: {size, bos_id, eos_id}``: required of token sources, refused elsewhere."""
    if not f.has("vocabulary"):
        f.raw("vocabulary")
        if is_tokens:
            fail(
                f.at("vocabulary"),
                "is required of a token source: the vocabulary its tokens were written with, "
                "e.g. {size: 50257, eos_id: 50256} (checked against the plan's tokenizer)",
            )
        return {}
    if not is_tokens:
        fail(f.at("vocabulary"), "only applies to token sources", f.raw("vocabulary"))
    v = f.mapping("vocabulary")
    size = v.integer("size", min=1, max=MAX_TOKEN_ID + 1)
    out: dict[str, Any] = {"vocab_size": size}
    for key in ("bos_id", "eos_id"):
        value = v.optional_int(key, min=0, max=size - 1)
        if value is not None:
            out[key] = value
    v.done()
    return out


def _mask(f: Fields, fmt: str, tokens: str | None) -> TokenMaskSpec:
    """``mask: {column, kind, ignore_index}``: a per-token target mask beside the token ids,
    for the formats with columns."""
    if tokens is None:
        why = (
            "have no column beside their ids"
            if fmt in TOKEN_FORMATS
            else "need sources[].tokens (a token-id column) for a mask column"
        )
        fail(
            f.at("mask"),
            f"names a mask column of {'/'.join(TOKEN_COLUMN_FORMATS)} token sources "
            f"({fmt} sources {why})",
            f.raw("mask"),
        )
    m = f.mapping("mask")
    column = m.text("column")
    if column == tokens:
        fail(m.at("column"), "must be another column than sources[].tokens", column)
    kind = m.text("kind", "loss_mask", choices=MASK_KINDS)
    if m.has("ignore_index") and kind != "labels":
        fail(m.at("ignore_index"), "only applies to kind: labels", m.raw("ignore_index"))
    ignore = m.integer("ignore_index", -100, min=-(2**31), max=-1) if kind == "labels" else -100
    m.done()
    return TokenMaskSpec(column, kind, ignore)

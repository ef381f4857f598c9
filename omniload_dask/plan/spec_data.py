"""Specs as plan data: what ``Plan.to_dict`` writes for a source and the tokenizer, read back
by the parser to the same specs (fields left at their defaults are left out, so the plan data
of a plan, and its stream fingerprint, do not change when a field is added)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from omniload_dask.plan.specs import SourceSpec, TokenizerSpec

__all__ = ["source_dict", "tokenizer_dict"]


def source_dict(spec: SourceSpec) -> dict[str, Any]:
    """A source spec as plan data (``parse_source`` reads it back)."""
    data = asdict(spec)
    data["path"] = list(data.pop("paths"))
    data["storage_options"] = dict(spec.storage_options)
    if spec.format != "jsonl" and spec.unit_bytes == SourceSpec.unit_bytes:
        data.pop("unit_bytes")  # (other formats use it only to merge small files)
    if spec.merge_bytes == SourceSpec.merge_bytes:
        data.pop("merge_bytes")
    if spec.epochs is None:
        data.pop("epochs")
    if not spec.image:
        data.pop("image")
    elif spec.format == "parquet":
        data["image"] = spec.image[0]
    else:
        data["image"] = list(spec.image)
    if spec.unit_records is None:
        data.pop("unit_records")
    vocabulary = {"size": data.pop("vocab_size"), "bos_id": data.pop("bos_id")}
    vocabulary["eos_id"] = data.pop("eos_id")
    if vocabulary["size"] is not None:
        data["vocabulary"] = {k: v for k, v in vocabulary.items() if v is not None}
    for key in ("tokens", "dtype", "eod", "transform", "filter"):
        if data[key] is None:
            data.pop(key)  # (absent: the plan data, and so the stream fingerprint, as before)
    if spec.mask is None:
        data.pop("mask")
    elif spec.mask.kind != "labels":
        data["mask"].pop("ignore_index")
    if spec.chat is None:
        data.pop("chat")
    else:
        data.pop("text")  # (the chat section names its fields)
        data["chat"] = {k: v for k, v in data["chat"].items() if v is not None}
        if spec.chat.layout != "prompt_completion":
            data["chat"].pop("completion")
    return data


def tokenizer_dict(spec: TokenizerSpec) -> dict[str, Any]:
    """``spec`` as plan data; the tiktoken-only fields only for that kind (``parse_plan`` reads
    it back to the same spec)."""
    data = asdict(spec)
    data["storage_options"] = dict(spec.storage_options)
    data["special_tokens"] = dict(spec.special_tokens)
    if spec.kind != "tiktoken":
        data.pop("pattern")
        data.pop("special_tokens")
    return data

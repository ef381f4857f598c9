"""Per-source user code: ``sources[].transform`` and ``sources[].filter``, run on the workers.

Both name a function ``package.module:function``. It gets one record as a dict and, if it takes
a second argument, a ``numpy.random.Generator`` seeded from (plan seed, source name, sample
id, epoch), so what it does is a pure function of the record and those four numbers: the
stream stays the same across workers, faults and resume::

    text source   {"text": "def f(x): ...", "source": "code", "id": 1234}
    token source  {"tokens": array([...], uint32), "source": "web", "id": 5678}
    with a mask   {"tokens": ..., "mask": array([F, F, T, ...]), "source": "sft", "id": 9}

A transform returns the record (changed or not; a text record's ``text`` a string, a token
record's ``tokens`` a 1-d array of ids and, where the source has a mask column
(``sources[].mask``), its ``mask``: one bool a token, true where the token is a target, as long
as ``tokens`` and with a target after the first token) or ``None`` to drop it; a filter returns
true to keep it. They run before tokenizing (text) or before the data plane hears of the record (tokens).
Dropped records are counted per source as ``filtered``; a function that raises or returns
something else makes the record a bad record (source, file, record, what happened), which the
plan's ``on_error`` raises or skips and counts::

    def keep_long(record):                      # filter: drop short documents
        return len(record["text"]) >= 200
"""

from __future__ import annotations

import functools
import importlib
import inspect
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from omniload_dask.errors import PlanError
from omniload_dask.plan import SourceSpec
from omniload_dask.sources.base import RawRecords
from omniload_dask.sources.ids import encode_sample_ids

__all__ = ["UserCode", "apply_user_code", "record_rng", "resolve"]


@dataclass(frozen=True)
class UserCode:
    """A resolved function and whether it takes the record's generator."""

    name: str
    fn: Callable[..., Any]
    wants_rng: bool


@functools.lru_cache(maxsize=64)
def resolve(name: str, field: str = "transform") -> UserCode:
    """Import ``package.module:function``; a PlanError naming ``field`` if it does not resolve
    to a function of one or two positional arguments."""
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise PlanError(
            f"{field}: cannot import module {module_name!r} of {name!r} "
            f"({type(exc).__name__}: {exc}); is it installed where the workers run?"
        ) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise PlanError(f"{field}: module {module_name!r} has no function {attr!r}")
    try:
        params = [
            p
            for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
        ]
    except (TypeError, ValueError):
        params = []
    if not params:
        raise PlanError(f"{field}: {name!r} must take the record as its first argument")
    wants_rng = len(params) >= 2 or params[0].kind == params[0].VAR_POSITIONAL
    return UserCode(name, fn, wants_rng)


def record_rng(seed: int, source: str, sample_id: int, epoch: int) -> np.random.Generator:
    """The generator a record's transform gets: the same for the same four values anywhere."""
    return np.random.default_rng([int(seed), zlib.crc32(source.encode()), int(sample_id), epoch])


def apply_user_code(
    spec: SourceSpec,
    source_index: int,
    records: RawRecords,
    files: np.ndarray,
    seed: int,
    epoch: int,
) -> tuple[RawRecords, np.ndarray, int, list[int]]:
    """Run the source's filter, then its transform, on every record of one read.

    Returns the records kept (in file order), each one's file index, how many were dropped,
    and the file index of each record that made the user code fail: those are appended to
    ``records.bad`` with the reason (a token id a transform put outside the source's
    vocabulary is one of them).
    """
    filt = resolve(spec.filter, "filter") if spec.filter else None
    trans = resolve(spec.transform, "transform") if spec.transform else None
    is_tokens = records.tokens is not None
    is_chat = records.chats is not None
    ids = encode_sample_ids(source_index, files, records.offsets).tolist()
    masks: list[Any] = []
    if is_tokens:
        assert records.tokens is not None and records.lengths is not None
        ends = np.cumsum(records.lengths)
        items: list[Any] = np.split(records.tokens, ends[:-1]) if len(ends) else []
        if records.mask is not None:
            masks = np.split(records.mask, ends[:-1]) if len(ends) else []
    elif is_chat:  # a chat source's conversations, rendered after the user code
        items = list(records.chats or [])
    else:
        items = list(records.texts)
    kept: list[Any] = []
    kept_masks: list[np.ndarray] = []
    rows: list[int] = []
    bad = list(records.bad)
    bad_files: list[int] = []
    vocab = spec.vocab_size or 2**32
    dropped = 0
    field = "tokens" if is_tokens else "chat" if is_chat else "text"
    for row, (value, sample_id) in enumerate(zip(items, ids, strict=True)):
        offset = int(records.offsets[row])
        record: Any = {field: value, "source": spec.name, "id": sample_id}
        if masks:
            record["mask"] = masks[row]
        rng = None
        try:
            for code, is_filter in ((filt, True), (trans, False)):
                if code is None:
                    continue
                if code.wants_rng and rng is None:
                    rng = record_rng(seed, spec.name, sample_id, epoch)
                out = code.fn(record, rng) if code.wants_rng else code.fn(record)
                if is_filter:
                    if not out:
                        record = None
                        break
                    continue
                record = out
                if record is None:
                    break
            if record is None:
                dropped += 1
                continue
            kept.append(_checked(record, field, trans, vocab))
            if masks:
                kept_masks.append(_checked_mask(record, kept[-1], trans))
            rows.append(row)
        except _Wrong as exc:
            bad.append((offset, str(exc)))
            bad_files.append(int(files[row]))
        except Exception as exc:
            which = spec.transform if trans is not None else spec.filter
            bad.append((offset, f"{which} raised {type(exc).__name__}: {exc}"))
            bad_files.append(int(files[row]))
    at = np.asarray(rows, dtype=np.int64)
    offsets = records.offsets[at] if len(at) else np.zeros(0, np.int64)
    if is_tokens:
        lengths = np.asarray([len(t) for t in kept], np.int64)
        flat = np.concatenate(kept) if kept else np.zeros(0, np.int64)
        mask = None
        if records.mask is not None:
            mask = np.concatenate(kept_masks) if kept_masks else np.zeros(0, bool)
        out_records = RawRecords.of_tokens(flat, lengths, offsets, bad, mask)
    elif is_chat:
        out_records = RawRecords([""] * len(kept), offsets, bad, chats=kept)
    else:
        out_records = RawRecords(kept, offsets, bad)
    if records.images is not None:  # (a record's images stay with it; the code sees none)
        out_records.images = [records.images[r] for r in rows]
    return out_records, files[at] if len(at) else files[:0], dropped, bad_files


class _Wrong(Exception):
    """A transform returned something that is not a record of its source's kind."""


def _checked(record: Any, field: str, trans: UserCode | None, vocab: int) -> Any:
    """The text (a str) or token ids (a 1-d integer array) of a transform's output."""
    name = trans.name if trans is not None else "the filter"
    if not isinstance(record, dict) or field not in record:
        raise _Wrong(
            f"{name} returned {type(record).__name__}; expected the record (a dict with "
            f"{field!r}) or None"
        )
    value = record[field]
    if field == "chat":  # checked where it is rendered: a bad one is a bad record there
        return value
    if field == "text":
        if not isinstance(value, str):
            raise _Wrong(f"{name} returned {field!r} of type {type(value).__name__}, not str")
        return value
    array = np.asarray(value)
    if array.size == 0:
        return np.zeros(0, np.uint32)  # (an empty record: skipped and counted as empty)
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise _Wrong(
            f"{name} returned {field!r} as {array.dtype} of shape {array.shape}; expected a "
            "1-d array of integer ids"
        )
    if len(array) and (int(array.min()) < 0 or int(array.max()) >= vocab):
        raise _Wrong(
            f"{name} returned token ids in [{int(array.min())}, {int(array.max())}], outside "
            f"the vocabulary of {vocab} ids (sources[].vocabulary.size)"
        )
    return array.astype(np.uint32)


def _checked_mask(record: dict[str, Any], tokens: np.ndarray, trans: UserCode | None) -> Any:
    """The target mask of a transform's output: 1-d bools or 0/1 integers, as long as its
    ``tokens``, with a target after the first token (as a mask column must)."""
    name = trans.name if trans is not None else "the filter"
    if "mask" not in record:
        raise _Wrong(f"{name} returned no 'mask' (the source has a mask column: keep it)")
    mask = np.asarray(record["mask"])
    binary = mask.dtype.kind == "b" or (
        mask.dtype.kind in "iu" and bool(np.isin(mask, (0, 1)).all())
    )
    if mask.ndim != 1 or not binary:
        raise _Wrong(
            f"{name} returned 'mask' as {mask.dtype} of shape {mask.shape}; expected one bool "
            "a token (true: a target)"
        )
    if len(mask) != len(tokens):
        raise _Wrong(f"{name} returned {len(tokens)} tokens and a 'mask' of {len(mask)}")
    if len(tokens) and not mask[1:].any():
        raise _Wrong(f"{name} returned a 'mask' with no target token after the first")
    return mask.astype(bool)

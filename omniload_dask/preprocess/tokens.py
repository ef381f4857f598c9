"""Token sources against the plan: one vocabulary, and what each token source holds.

A token source names the vocabulary its ids were written with (``sources[].vocabulary``). The
plan's tokenizer decides the vocabulary of the whole stream (and of its text sources), so the
two must agree: same size, and the same BOS/EOS ids where the source names them. A mismatch
is a :class:`~omniload_dask.errors.PlanError` when the job starts (and in ``omniload
validate``), never a silent mix of two vocabularies::

    tokenizer: byte (258 ids, EOS 257)    source vocabulary {size: 50257}
    -> sources[0].vocabulary.size: 50257, but the plan's tokenizer has 258 ids

:func:`describe_token_source` is what ``validate`` lists per token source: vocabulary, dtype,
documents and tokens (from the index where the format has one), its mask column where it has
one, and the user code it imports.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omniload_dask.errors import PlanError
from omniload_dask.plan import Plan, SourceSpec

__all__ = [
    "check_user_code",
    "check_user_code_of",
    "check_vocabularies",
    "describe_token_source",
    "validate_notes",
]


def check_vocabularies(plan: Plan, tokenizer: Mapping[str, Any]) -> None:
    """Every token source's vocabulary against the tokenizer's description
    (:func:`~omniload_dask.preprocess.tokenize.describe`): a PlanError naming the first
    field that differs."""
    for i, spec in enumerate(plan.sources):
        if not spec.has_tokens:
            continue
        where = f"sources[{i}].vocabulary"
        size = tokenizer.get("vocab_size")
        if size is not None and spec.vocab_size != size:
            raise PlanError(
                f"{where}.size: {spec.vocab_size}, but the plan's tokenizer has {size} ids; "
                f"source {spec.name!r} was written with another vocabulary (tokenize it with "
                "the plan's tokenizer, or use the tokenizer it was written with)"
            )
        for key in ("bos_id", "eos_id"):
            mine, theirs = getattr(spec, key), tokenizer.get(key)
            if mine is not None and theirs is not None and mine != theirs:
                raise PlanError(
                    f"{where}.{key}: {mine}, but the plan's tokenizer has {theirs} "
                    f"(source {spec.name!r} was written with other special ids)"
                )


def check_user_code(plan: Plan) -> None:
    """Import every source's transform and filter: a PlanError naming the one that does not
    resolve (at start-up, before a worker meets it)."""
    for i, spec in enumerate(plan.sources):
        for key in ("transform", "filter"):
            if getattr(spec, key) is not None:
                check_user_code_of(spec, key, f"sources[{i}].{key}")


def describe_token_source(spec: SourceSpec) -> dict[str, Any]:
    """What a token source holds, as discovery finds it: vocabulary, dtype, documents and
    tokens (None where only reading every record would tell), and its mask column."""
    from dataclasses import replace

    from omniload_dask.sources.registry import discover_source

    # (the index's lengths, which a job with user code or a mask does not plan with, are
    # still there)
    catalog = discover_source(replace(spec, transform=None, filter=None, mask=None), "raise")
    if spec.mask is not None:  # (its files' mask columns checked, as a job's discovery does)
        discover_source(spec, "raise")
    rows = catalog.rows
    documents = int(rows.sum()) if len(rows) and (rows >= 0).all() else None
    tokens = int(catalog.lengths.sum()) if catalog.lengths is not None else None
    vocabulary = {"size": spec.vocab_size, "bos_id": spec.bos_id, "eos_id": spec.eos_id}
    out: dict[str, Any] = {
        "vocabulary": {k: v for k, v in vocabulary.items() if v is not None},
        "dtype": _dtype(spec, catalog.files[0]) if catalog.files else None,
        "files": len(catalog.files),
        "documents": documents,
        "tokens": tokens,
    }
    if spec.mask is not None:  # (discovery checked that every file has it)
        mask: dict[str, Any] = {"column": spec.mask.column, "kind": spec.mask.kind}
        if spec.mask.kind == "labels":
            mask["ignore_index"] = spec.mask.ignore_index
        out["mask"] = mask
    return out


def _dtype(spec: SourceSpec, url: str) -> str | None:
    """The dtype the ids are stored in (its first file's), where the format says."""
    from omniload_dask.sources.files import filesystem

    if spec.format == "flat":
        return spec.dtype
    if spec.format == "megatron":
        from omniload_dask.sources.megatron import read_index

        fs, _ = filesystem(spec, url)
        return str(read_index(spec, fs, url)[0])
    return None


def validate_notes(plan: Plan, files: bool = True) -> tuple[list[str], list[str]]:
    """What ``omniload validate`` says of token sources and user code: notes (each token
    source's vocabulary, dtype, documents and tokens; each function imported) and problems
    (a vocabulary that differs from the tokenizer's, a function that does not import, a token
    source whose files cannot be read). ``files=False``: nothing is opened."""
    import json

    from omniload_dask.errors import OmniloadError

    notes: list[str] = []
    problems: list[str] = []
    for i, spec in enumerate(plan.sources):
        for key in ("transform", "filter"):
            name = getattr(spec, key)
            if name is None:
                continue
            try:
                check_user_code_of(spec, key, f"sources[{i}].{key}")
                notes.append(f"sources[{i}].{key}: {name} imports")
            except OmniloadError as exc:
                problems.append(str(exc))
    tokens = [(i, s) for i, s in enumerate(plan.sources) if s.has_tokens]
    if not tokens or not files:
        return notes, problems
    from omniload_dask.preprocess.tokenize import describe

    try:
        check_vocabularies(plan, describe(plan.tokenizer))
    except OmniloadError as exc:
        problems.append(str(exc))
    for i, spec in tokens:
        try:
            info = describe_token_source(spec)
        except OmniloadError as exc:
            problems.append(f"sources[{i}]: {exc}")
            continue
        notes.append(f"token source {spec.name!r}: {json.dumps(info)}")
    return notes, problems


def check_user_code_of(spec: SourceSpec, key: str, field: str) -> None:
    """Import one source's ``transform`` or ``filter`` (a PlanError naming ``field``)."""
    from omniload_dask.preprocess.transforms import resolve

    resolve(getattr(spec, key), field)

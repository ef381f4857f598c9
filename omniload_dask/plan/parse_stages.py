"""``batch.stages``: the global batch budget and sequence length changed at declared steps.

A pretraining run ramps its global batch up and ends with a long-context stage; each stage
gives what changes from its start on, the rest stays as the plan's batch says::

    batch:
      seq_len: 4096
      global_tokens: 1048576                                 # steps 0 .. 999
      stages:
        - {at_step: 1000, global_tokens: 4194304}           # the ramp-up's next stage
        - {at_tokens: 2.0e11, seq_len: 32768, micro_batches: 1}   # long context

A stage gives its start as ``at_step`` or ``at_tokens`` and any of ``global_tokens``,
``global_documents``, ``seq_len`` with ``micro_batches``, or ``buckets`` (which replace
``seq_len``/``micro_batches``, as a budget of one kind replaces the other). Each stage is read
as a whole batch section (the plan's, with the stage's fields over it), so it is checked as one,
errors naming ``batch.stages[i]``. ``at_tokens`` becomes a step here, which needs every step
before it to be filled exactly (``global_tokens`` with ``long_documents: split``). Stages start
in order, each after the one before.
"""

from __future__ import annotations

import math
from dataclasses import replace

from omniload_dask.plan.fields import Fields, fail
from omniload_dask.plan.limits import MAX_SCHEDULE_AT
from omniload_dask.plan.parse_batch import read_batch
from omniload_dask.plan.specs import BatchSpec, LayoutSpec, StageSpec

__all__ = ["STAGE_FIELDS", "read_stages"]

# What a stage may change (beside where it starts); the rest is the plan's for every step.
STAGE_FIELDS = ("global_tokens", "global_documents", "seq_len", "micro_batches", "buckets")
_REPLACES = {  # a field given by a stage, and the plan's fields it stands in for
    "global_tokens": ("global_documents",),
    "global_documents": ("global_tokens",),
    "seq_len": ("buckets",),
    "micro_batches": ("buckets",),
    "buckets": ("seq_len", "micro_batches"),
}
MAX_STAGES = 64


def read_stages(f: Fields, batch: BatchSpec, layout: LayoutSpec) -> BatchSpec:
    """``batch`` with the stages of the ``batch`` section ``f`` (already read by
    :func:`~.parse_batch.read_batch`, which leaves ``stages`` to this)."""
    raw = f.data.get("stages")
    if raw is None:
        return batch
    where = f.at("stages")
    if not isinstance(raw, (list, tuple)) or not raw:
        fail(where, "must be a non-empty list of {at_step or at_tokens, and what changes}", raw)
    if len(raw) > MAX_STAGES:
        fail(where, f"at most {MAX_STAGES} stages", len(raw))
    base = {k: v for k, v in f.data.items() if k != "stages"}
    stages: list[StageSpec] = []
    step, tokens = 0, 0  # where the stage before starts
    for i, item in enumerate(raw):
        s = Fields(item, f"{where}[{i}]")
        at_step = s.optional_int("at_step", min=1, max=MAX_SCHEDULE_AT)
        at_tokens = s.optional_int("at_tokens", min=1, max=MAX_SCHEDULE_AT)
        if (at_step is None) == (at_tokens is None):
            fail(s.at("at_step"), "give at_step or at_tokens (one of them)", item)
        # (read here, not through ``s``: the stage's batch below reads them, named the same)
        changes = {k: s.data[k] for k in STAGE_FIELDS if s.has(k)}
        for key in sorted(set(s.data) - {"at_step", "at_tokens", *STAGE_FIELDS}, key=str):
            if s.data[key] is not None:
                fail(
                    s.at(str(key)),
                    f"a stage gives at_step or at_tokens and any of {', '.join(STAGE_FIELDS)}; "
                    "the rest of the batch stays as the plan gives it",
                )
        if not changes:
            fail(s.path, f"a stage changes at least one of {', '.join(STAGE_FIELDS)}", item)
        before = stages[-1].batch if stages else batch
        if at_tokens is not None:
            at_step = _step_of_tokens(s, at_tokens, before, step, tokens)
        assert at_step is not None
        if at_step <= step:
            fail(
                s.at("at_step" if at_tokens is None else "at_tokens"),
                f"stages must start in order: this one starts at step {at_step}, not after the "
                f"one before (step {step})",
                at_tokens if at_tokens is not None else at_step,
            )
        merged = dict(base)
        for key in changes:
            for other in _REPLACES[key]:
                merged.pop(other, None)
        merged.update(changes)
        spec = read_batch(Fields(merged, s.path), layout)
        _check_kept(s, spec, batch)
        if before.global_tokens is not None:
            tokens += (at_step - step) * before.global_tokens
        step = at_step
        stages.append(StageSpec(at_step=at_step, batch=spec, at_tokens=at_tokens))
    return replace(batch, stages=tuple(stages))


def _step_of_tokens(s: Fields, at: int, before: BatchSpec, step: int, tokens: int) -> int:
    """The first step that starts with at least ``at`` tokens drawn, from the stage before
    (it starts at ``step`` with ``tokens`` drawn): known only where it fills steps exactly."""
    if before.global_tokens is None or before.whole_documents:
        fail(
            s.at("at_tokens"),
            "needs every step before it filled exactly: global_tokens with long_documents: "
            "split and documents that may be cut (or give at_step)",
            at,
        )
    return step + max(0, math.ceil((at - tokens) / before.global_tokens))


def _check_kept(s: Fields, stage: BatchSpec, batch: BatchSpec) -> None:
    """What a stage may not change: with ``truncate``, documents are cut to the plan's
    ``seq_len`` for the whole run, so a stage keeps its context shape."""
    if batch.long_documents == "truncate" and stage.context_buckets != batch.context_buckets:
        fail(
            s.path,
            "with long_documents: truncate a stage keeps seq_len, micro_batches and buckets "
            "(documents are truncated to the plan's seq_len); change the budget only",
            {k: s.data[k] for k in ("seq_len", "micro_batches", "buckets") if k in s.data},
        )

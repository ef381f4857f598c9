"""Training stages changed while the job runs: ``update_plan`` with another ``batch``.

A live change of the batch takes effect at a step not built yet, ``S`` (by default the first
step not built; steps drawn and not built are drawn again, :mod:`.rewind`). Steps before ``S``
keep the shape they had; from ``S`` on the new plan version's batch rules. The job's batch
becomes one that a plan could have declared from the start::

    job:     global_tokens 512, stages [{at_step: 3, global_tokens: 1024}]
    update at S = 10, the version adds {at_step: 40, seq_len: 512, micro_batches: 1}
        ->   stages [{at_step: 3, ...}, {at_step: 40, seq_len: 512, ...}]   (a stage added)
    update at S = 10, the version says global_tokens 2048 and no stages
        ->   stages [{at_step: 3, ...}, {at_step: 10, global_tokens: 2048, ...}]
                                                          (the stage in force changed at S)

What came before ``S`` stays: a stage of the new version that starts before ``S`` must be one
the job has (a new one there is refused: its step is built), and the fields no stage may change
(``long_documents``, ``max_document_tokens``, ``pad_to_seq_len``) must be the job's. The
merged stages are read as a plan's ``batch.stages`` are
(:func:`~omniload_dask.plan.parse_stages.read_stages`), so each check of a declared stage holds
(a budget under one document's minimum, a context change with ``truncate``...), and
``at_tokens`` resolves over the merged stages.

Each change is logged as ``{"step": S, "kind": "stages", "stages": [...]}``, the stages from
``S`` on as a plan gives them; :meth:`LiveStages.replay` reads the log over the plan again (a
resume), so the stream stays a pure function of plan, seed, step and log.

The count of stage changes logged is the stages' ``version`` (0: the plan's own). Every step
cut after a change carries it (``stages_version`` in its micro-batches, where not 0), so a
feeder knows its copy of the job's batch is out of date before the step a changed stage
starts at, even when the change kept every stage's start (only a later stage's values
changed). It is a count over the log, so a resume (a replay) gives every step the same one.

Pure: no I/O and no Dask.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from omniload_dask.core.live import future_step
from omniload_dask.errors import JobError, PlanError
from omniload_dask.plan import BatchSpec, Plan, StageSpec
from omniload_dask.plan.fields import Fields
from omniload_dask.plan.parse_batch import read_batch
from omniload_dask.plan.parse_stages import STAGE_FIELDS, read_stages

__all__ = ["KEPT_FIELDS", "LiveStages", "StageChange"]

# The batch fields that hold for the whole run: no stage, declared or live, changes them.
KEPT_FIELDS = ("long_documents", "max_document_tokens", "pad_to_seq_len")


@dataclass(frozen=True)
class StageChange:
    """A checked stage change: the step it takes effect at, the job's batch with it, and the
    stages from that step on (what the log keeps)."""

    step: int
    batch: BatchSpec
    stages: list[dict[str, Any]]


class Cutter(Protocol):
    """A component of the data plane that cuts steps as the batch's stages say."""

    def restage(self, batch: BatchSpec, version: int = 0) -> None:
        """Cut the steps from now on as ``batch`` and its stages say (``version``: the count
        of stage changes that led to it)."""


class LiveStages:
    """The job's batch as live changes leave it, and the check and merge of a new one.

    ``record`` logs a change (:meth:`.LiveSources.record`: the job's one log of live
    changes); ``cutters`` (the draw, the dealer, read-ahead) take the batch after each, with
    :attr:`version`, the count of stage changes logged.
    """

    def __init__(
        self, plan: Plan, record: Callable[[dict[str, Any]], None], *cutters: Cutter
    ) -> None:
        self._plan = plan
        self._record = record
        self._cutters = cutters
        self.batch = plan.batch
        self.version = 0

    def change(self, new: BatchSpec, at_step: int | None, next_step: int) -> StageChange | None:
        """Check a plan version's batch ``new`` from ``at_step`` (default: ``next_step``, the
        first step a change may reach); None when it changes nothing from there on."""
        step = future_step(at_step, next_step, "update_plan")
        old = self.batch
        for name in KEPT_FIELDS:
            if getattr(new, name) != getattr(old, name):
                raise JobError(
                    f"update_plan: batch.{name} holds for the whole run ({getattr(old, name)!r}"
                    f", the new version gives {getattr(new, name)!r}); stages change "
                    f"{', '.join(STAGE_FIELDS)}"
                )
        before = {(s.at_step, _shape(s.batch)) for s in old.stages if s.at_step < step}
        for i, stage in enumerate(new.stages):
            if stage.at_step < step and (stage.at_step, _shape(stage.batch)) not in before:
                raise JobError(
                    f"update_plan: batch.stages[{i}] starts at step {stage.at_step}, which is "
                    f"already built or drawn (a change takes effect at step {step} or later); "
                    f"give it at_step >= {step}"
                )
        if _schedule(new, step) == _schedule(old, step):
            return None
        prefix = replace(old, stages=tuple(s for s in old.stages if s.at_step < step))
        stages = []
        if _shape(new.at(step)) != _shape(prefix.at(step)):
            stages.append(StageSpec(step, new.at(step)).to_dict())
        stages += [s.to_dict() for s in new.stages if s.at_step > step]
        return StageChange(step, _merged(self._plan, old, step, stages), stages)

    def apply(self, change: StageChange, next_step: int) -> int:
        """Put ``change`` in effect and log it (``next_step``: the first step a change may
        reach now); returns the step it takes effect at."""
        if change.step < next_step:  # (steps were built since it was checked)
            raise JobError(
                f"update_plan: step {change.step} is built now; the stage change would take "
                f"effect at step {next_step} or later"
            )
        self._restage(change.batch, self.version + 1)
        self._record({"step": change.step, "kind": "stages", "stages": change.stages})
        return change.step

    def replay(self, log: Sequence[dict[str, Any]]) -> BatchSpec:
        """The plan's batch with the stage changes of ``log`` (a snapshot's) in effect."""
        batch, version = self._plan.batch, 0
        for entry in log:
            if entry["kind"] == "stages":
                batch = _merged(self._plan, batch, int(entry["step"]), list(entry["stages"]))
                version += 1
        self._restage(batch, version)
        return batch

    def _restage(self, batch: BatchSpec, version: int) -> None:
        self.batch, self.version = batch, version
        for cutter in self._cutters:
            cutter.restage(batch, version)


def _shape(batch: BatchSpec) -> tuple[Any, ...]:
    """What a stage may change of ``batch``."""
    return (
        batch.global_tokens,
        batch.global_documents,
        batch.context_buckets,
    )


def _schedule(batch: BatchSpec, step: int) -> tuple[Any, ...]:
    """The shapes of ``batch`` from ``step`` on: the one in force then, and later stages."""
    later = tuple((s.at_step, _shape(s.batch)) for s in batch.stages if s.at_step > step)
    return _shape(batch.at(step)), later


def _merged(plan: Plan, batch: BatchSpec, step: int, stages: list[dict[str, Any]]) -> BatchSpec:
    """``batch``'s stages before ``step``, then ``stages`` (plan form), read as a plan's."""
    kept = [s.to_dict() for s in batch.stages if s.at_step < step]
    base = replace(batch, stages=())
    raw = replace(plan, batch=base).to_dict()["batch"]
    if stages and stages[0].get("at_step") == 0:  # (a change before step 0 is built)
        for key in STAGE_FIELDS:
            raw.pop(key, None)
        raw.update({k: v for k, v in stages[0].items() if k != "at_step"})
        stages = stages[1:]
    try:
        base = read_batch(Fields(raw, "batch"), plan.layout)
        if not kept + stages:
            return base
        out = read_stages(Fields({**raw, "stages": kept + stages}, "batch"), base, plan.layout)
    except PlanError as exc:
        raise JobError(f"update_plan: the job's batch with the change: {exc}") from None
    late = [s.at_step for s in out.stages[len(kept) :] if s.at_step < step]
    if late:
        raise JobError(
            f"update_plan: a stage of the change starts at step {late[0]} (its at_tokens "
            f"over the job's stages), before step {step}, where the change takes effect"
        )
    return out

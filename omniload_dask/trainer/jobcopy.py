"""A feeder's copy of its job: the plan (its batch as live stage changes left it) and the
source names, kept up to date from what the micro-batches say.

Live changes reach a running job while its feeders hold a copy read when they started. Two
reach the trainer through that copy, so the feeder reads the job's info again when a
micro-batch shows its copy is out of date:

- a source that joined: a document of a source the copy does not name;
- a change of the stages (``Job.update_plan``, :mod:`omniload_dask.core.stages`): each is
  counted, and every step cut after one carries the count (``stages_version``, where not 0).
  The copy keeps the count of the micro-batch it was last read for; a micro-batch with another
  count (a step cut after a change, or before one, for a feeder started after it) has it read
  again, so it is read once each time the count changes along the stream, never per
  micro-batch::

      steps      ... 11 (v0)  12 (v0)  13 (v1)  14 (v1) ...   change logged, from step 13 on
      the copy       v0       v0       read: v1  v1           :attr:`Feeder.stage` of step 40
                                                              (a stage the change altered)
                                                              right from step 13 on

  The copy read is the job's batch now, which gives every step its stage (steps before a
  change keep theirs: :mod:`omniload_dask.core.stages`). A change altering only a later
  stage's values, with its start kept, is seen this way too: the stage numbers do not change.
  One that takes effect at the very step it alters is seen with that step's first
  micro-batch (which carries the stage, ``seq_len`` and count it was cut with): no micro-batch
  before it was cut after the change.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from omniload_dask.plan import BatchSpec, Plan, parse_plan

__all__ = ["JobCopy", "output_of", "stage_of"]


@dataclass(frozen=True)
class JobCopy:
    """The plan and source names a feeder goes by, and the count of stage changes
    (``stages_version``) of the micro-batch they were last read for."""

    plan: Plan
    names: tuple[str, ...]
    stages_version: int = 0

    @classmethod
    def of(cls, info: dict[str, Any]) -> JobCopy:
        """The copy the job's ``info`` gives."""
        plan = parse_plan(info["plan"])
        return cls(plan, tuple(info["sources"]), int(info.get("stages_version", 0)))

    def seen(self, mb: dict[str, Any], info: Callable[[], dict[str, Any]]) -> JobCopy:
        """This copy, or the job's ``info()`` now where ``mb`` shows this one out of date (the
        module docstring): a source it does not name, another count of stage changes."""
        sources = mb["doc_source"]
        joined = bool(len(sources)) and int(sources.max()) >= len(self.names)
        version = int(mb.get("stages_version", 0))
        if not joined and version == self.stages_version:
            return self
        now = info()
        plan = parse_plan(now["plan"]) if version != self.stages_version else self.plan
        return JobCopy(plan, tuple(now["sources"]), version)


def stage_of(batch: BatchSpec, step: int) -> dict[str, Any]:
    """The training stage that rules ``step`` (``batch.stages``): its number (0: the plan's
    batch, i: from stage i-1's start), the step it began at, and the batch shape and budget
    it gives: what a trainer watches to re-plan its micro-batches or learning rate."""
    index, shape = batch.stage_index(step), batch.at(step)
    return {
        "stage": index,
        "at_step": batch.stages[index - 1].at_step if index else 0,
        "seq_len": shape.seq_len,
        "micro_batches": shape.micro_batches,
        "global_tokens": shape.global_tokens,
        "global_documents": shape.global_documents,
        "buckets": [b.to_dict() for b in shape.buckets],
    }


def output_of(mb: dict[str, Any], copy: JobCopy, output: str) -> dict[str, Any]:
    """``mb`` (full form) with each document's source name and, where the plan has stages,
    its step's ``stage`` (see :func:`stage_of`), its arrays as torch tensors for "torch"."""
    out = dict(mb)
    out["doc_source_name"] = [copy.names[int(s)] for s in mb["doc_source"]]
    batch = copy.plan.batch
    if batch.stages and "stage" not in mb:  # (the data plane says it where it has stages)
        out["stage"] = batch.stage_index(int(mb["step"]))
    if output == "torch":
        import torch

        for key, value in mb.items():
            if isinstance(value, np.ndarray):
                out[key] = torch.from_numpy(value)
    return out

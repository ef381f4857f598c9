"""How a step's batches are cut into construction tasks: groups per task, steps per task.

A construction task (a *block*) builds the batches of ``groups_per_task`` DP groups of a step;
where one block holds every group of a step and a step is small, one builds
``steps_per_task`` consecutive steps (a task costs the scheduler and a worker a few ms of CPU
whatever its size)::

    dp 8, 8,192 tokens a group     one block a step (8 groups) ... of 16 steps (1 M tokens)
    dp 1,024                       128 groups a block, 8 blocks a step, one step each

A block of several steps is gathered as its steps are drawn (:class:`OpenBlock`): a job's first
step is a block of its own (its first batch waits for one step, not a block's), the blocks of
``steps_per_task`` follow from the step after it. The steps of a block are not fetchable until
its last one is drawn and the block is built; the releases of the reads its steps use wait for
that build.

Pure: no I/O and no Dask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from omniload_dask.batching.formats import RecipeTable
from omniload_dask.core.actions import ReadSpec, Release
from omniload_dask.plan import Plan

__all__ = [
    "BLOCKS_PER_STEP",
    "BLOCK_TOKENS",
    "MAX_BLOCK_STEPS",
    "STEP_BLOCK_TOKENS",
    "OpenBlock",
    "fetch_depth",
    "groups_per_task",
    "steps_per_task",
    "together_end",
]

BLOCKS_PER_STEP = 8  # with loader.groups_per_task 0 (auto): at most about this many a step
# ... and each auto block holds at least this many tokens (or every group): a task costs the
# scheduler and a worker a few ms of CPU whatever its size, about what packing 0.5 M tokens does
BLOCK_TOKENS = 1 << 19
# Where one block holds a whole step, an auto block holds steps of about this many tokens, at
# most MAX_BLOCK_STEPS (the ranks' prefetch follows it): 16 steps at dp 8 with one 8,192-token
# micro-batch a group. Larger blocks mean fewer construction tasks, standby copies and ranks'
# requests a step (each costs the scheduler the same whatever its size) and more steps dealt
# side by side; the cap bounds what a rank prefetches and a worker holds.
STEP_BLOCK_TOKENS = 1 << 20
MAX_BLOCK_STEPS = 16


def groups_per_task(plan: Plan) -> int:
    """DP groups per block task: ``loader.groups_per_task``, or (0) enough for at most about
    :data:`BLOCKS_PER_STEP` blocks a step, each of :data:`BLOCK_TOKENS` tokens or more (one
    block a step for 8,192-token groups up to dp 64)."""
    given = plan.loader.groups_per_task
    if given > 0:
        return given
    dp = plan.layout.dp
    group_tokens = max(1, plan.batch.seq_len * plan.batch.micro_batches)
    return min(dp, max(math.ceil(dp / BLOCKS_PER_STEP), math.ceil(BLOCK_TOKENS / group_tokens)))


def steps_per_task(plan: Plan) -> int:
    """Consecutive steps one block task builds: ``loader.steps_per_task``, or (0) enough for
    :data:`STEP_BLOCK_TOKENS` tokens (at most :data:`MAX_BLOCK_STEPS`) where one block holds
    every DP group of a step, else 1 (16 steps at dp 8 and 8 at dp 16 with one 8,192-token
    micro-batch a group); with ``loader.live_lead``, at most half the lead."""
    given = plan.loader.steps_per_task
    if given > 0:
        return given
    if groups_per_task(plan) < plan.layout.dp:
        return 1
    step_tokens = max(1, plan.layout.dp * plan.batch.seq_len * plan.batch.micro_batches)
    steps = max(1, min(MAX_BLOCK_STEPS, STEP_BLOCK_TOKENS // step_tokens))
    # a bounded lead (loader.live_lead) holds two blocks: one built, one being drawn
    return min(steps, max(1, plan.loader.live_lead // 2)) if plan.loader.live_lead else steps


def fetch_depth(plan: Plan) -> int:
    """A rank's default prefetch: ``loader.prefetch``, and at least two blocks' steps when a
    block task builds several (so that one request brings a whole block)."""
    k = steps_per_task(plan)
    return plan.loader.prefetch if k == 1 else max(plan.loader.prefetch, 2 * k)


def block_of(step: int, origin: int, steps: int) -> tuple[int, int]:
    """The first step and the end of the block of ``steps`` steps that holds ``step``, for a
    job that started (or resumed) at ``origin``: the origin's step alone, then blocks of
    ``steps`` from the step after it."""
    if step <= origin:
        return step, step + 1
    first = origin + 1 + (step - origin - 1) // steps * steps
    return first, first + steps


def together_end(first: int, most: int, origin: int, steps: int) -> int:
    """The step after the last of at most ``most`` steps from ``first`` dealt together: where
    blocks hold several ``steps``, the last block end within them (a block longer than
    ``most`` steps goes ``most`` at a time)."""
    limit = first + most
    end = block_of(first, origin, steps)[1]
    if end > limit:
        return limit
    while (after := block_of(end, origin, steps)[1]) <= limit:
        end = after
    return end


@dataclass
class OpenBlock:
    """The steps of a block of several drawn so far (built when its last step is drawn)."""

    first: int
    end: int  # the step after its last
    tables: list[RecipeTable] = field(default_factory=list)  # one per step, reads renumbered
    specs: list[ReadSpec] = field(default_factory=list)  # each read of the block once
    holds: list[tuple[int, list[int]]] = field(default_factory=list)  # (step, its groups)
    deferred: list[Release] = field(default_factory=list)  # releases after the build
    _index: dict[str, int] = field(default_factory=dict)  # read key -> index in specs

    def add(self, step: int, table: RecipeTable, reads: list[ReadSpec]) -> None:
        """Step ``step``'s recipes ``table`` (its ``slot_reads`` index ``reads``)."""
        index = np.empty(len(reads), dtype=np.int64)
        for j, spec in enumerate(reads):
            at = self._index.setdefault(spec.key, len(self.specs))
            if at == len(self.specs):
                self.specs.append(spec)
            index[j] = at
        self.tables.append(replace(table, slot_reads=index[table.slot_reads]))
        self.holds.append((step, table.groups.tolist()))

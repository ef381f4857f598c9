"""Which batch each rank gets: ranks' positions, the blocks held for them, rebuilds.

One block task builds the batches of ``groups_per_task`` DP groups of a step (see
:mod:`.keys`); every tensor- and pipeline-parallel rank of a group fetches its group's part of
the block, and context-parallel rank c its slice c. A group's share of a block is held until
every rank of the group has fetched the step; the block is released when no group holds it.
A rank that comes back for a released step gets its group's batch rebuilt, alone, from the
step's kept recipe (the last ``loader.retain_steps`` steps are kept)::

    dp=2, tp=2, one group per block: ranks 0, 1 -> group 0, ranks 2, 3 -> group 1
    step 5 drawn          hold block 5/0 (group 0), block 5/1 (group 1)
    rank 0 asks from 6    rank 1 has not fetched step 5 yet: nothing released
    rank 1 asks from 6    every rank of group 0 is past 5: release block 5/0
    rank 1 asks for 5     group 0 rebuilt as omniload-batch-...-5-g0-r1, held again

A request names the ranks one fetching agent serves (one rank, a model-parallel group, or a
node's ranks); its cost follows those ranks, not the job's (see :mod:`.positions`).

Pure: no I/O and no Dask.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from omniload_dask.batching.formats import RecipeTable
from omniload_dask.core.actions import ReadSpec, Release, SubmitConstruct
from omniload_dask.core.keys import Keys
from omniload_dask.core.positions import RankPositions
from omniload_dask.errors import JobError
from omniload_dask.plan import Plan

__all__ = [
    "BLOCKS_PER_STEP",
    "BLOCK_TOKENS",
    "Delivery",
    "Part",
    "RankState",
    "StepRecord",
    "groups_per_task",
]

BLOCKS_PER_STEP = 8  # with loader.groups_per_task 0 (auto): at most about this many a step
# ... and each auto block holds at least this many tokens (or every group): a task costs the
# scheduler and a worker a few ms of CPU whatever its size, about what packing 0.5 M tokens does
BLOCK_TOKENS = 1 << 19

Part = tuple[str, int]  # (block key, part): what one rank fetches for one step


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


@dataclass
class StepRecord:
    """What is kept of a drawn step: recipes to rebuild it, and its figures."""

    recipes: RecipeTable  # every group's, reads as indices into ``reads``
    reads: list[ReadSpec]
    costs: np.ndarray
    tokens: np.ndarray
    source_tokens: np.ndarray
    rebuilds: int = 0


@dataclass
class RankState:
    """Where one trainer rank is: what it has fetched and what it asked for."""

    position: int  # every step below this one is fetched
    requested_end: int  # asked for steps below this one
    last_seen: float = 0.0


class Delivery:
    """Ranks' positions, the block keys held per (step, group), and the steps kept."""

    def __init__(self, plan: Plan, keys: Keys, start_step: int = 0) -> None:
        """Every rank of ``plan.layout`` at ``start_step``; nothing held yet."""
        self.layout = plan.layout
        self._keys = keys
        self._loader = plan.loader
        self.block_size = groups_per_task(plan)
        self.steps: dict[int, StepRecord] = {}
        self.held: dict[tuple[int, int], str] = {}
        self._block_left: Counter[str] = Counter()  # groups a held block still serves
        self._held_steps: list[list[int]] = [[] for _ in range(self.layout.dp)]  # heaps
        self._held_count: Counter[int] = Counter()  # groups holding each step
        self._newest_held = -1  # the latest step any group's heap has had pushed
        self.where = RankPositions(self.layout, start_step)

    @property
    def ranks(self) -> dict[int, RankState]:
        """Each rank's position and request, as plain objects (built on demand: O(ranks))."""
        w = self.where
        return {
            r: RankState(int(p), int(e), float(t))
            for r, (p, e, t) in enumerate(
                zip(w.position.tolist(), w.requested.tolist(), w.last_seen.tolist(), strict=True)
            )
        }

    def slowest(self) -> int:
        """The smallest position of any rank: every rank has fetched every step below it."""
        return self.where.slowest

    def request(
        self, ranks: int | Sequence[int], start: int, count: int, now: float
    ) -> list[Release]:
        """``ranks`` (one agent's) have fetched every step below ``start`` and ask for
        ``count`` more; returns the release of blocks that every rank has now fetched."""
        chosen = self.check_ranks(ranks)
        if start < 0 or count < 1:
            raise JobError(
                f"request for rank {int(chosen[0])}: start must be >= 0 and count >= 1, "
                f"got start={start}, count={count}"
            )
        keys: list[str] = []
        for group in self.where.move(chosen, start, start + count, now):
            keys += self._release_fetched(group)
        return [Release(tuple(keys))] if keys else []

    def draw_target(self) -> int:
        """Draw the steps below this one: the furthest request and the lookahead, but never
        far beyond the slowest rank (held batches take worker memory)."""
        loader = self._loader
        window = 4 * (loader.prefetch + loader.lookahead) + 8
        return min(self.where.furthest + loader.lookahead, self.where.slowest + window)

    def held_back(self, limit: int = 16) -> dict[str, object] | None:
        """Who holds the draw back, when it waits for the slowest ranks (None when not).

        Drawing stops ``window`` steps past the slowest rank (see :meth:`draw_target`); a rank
        that never fetches (no feeder runs for it) stops the job there. Returns the step, how
        many ranks are at it, the first ``limit`` of them, and those never heard from.
        O(ranks): for stats and for replies that found nothing ready, not per request.
        """
        loader = self._loader
        window = 4 * (loader.prefetch + loader.lookahead) + 8
        w = self.where
        if w.slowest + window >= w.furthest + loader.lookahead:
            return None
        behind = np.flatnonzero(w.position == w.slowest)
        never = behind[w.last_seen[behind] == 0]
        return {
            "step": int(w.slowest),
            "count": len(behind),
            "ranks": behind[:limit].tolist(),
            "never_seen": never[:limit].tolist(),
            "never_seen_count": len(never),
        }

    def offer(
        self, step: int, recipes: RecipeTable, reads: list[ReadSpec]
    ) -> list[SubmitConstruct]:
        """Hold and build a drawn step's blocks, for the groups that will fetch it."""
        out: list[SubmitConstruct] = []
        size, dp = self.block_size, self.layout.dp
        # Groups whose ranks are all past the step (replaying towards where they resume) are
        # built on demand only.
        if self.where.slowest > step:
            return out
        wanted = np.flatnonzero(np.asarray(self.where.group_min) <= step)
        bounds = np.searchsorted(wanted, np.append(np.arange(0, dp, size), dp))
        for b in range(len(bounds) - 1):
            groups = wanted[bounds[b] : bounds[b + 1]]
            if not len(groups):
                continue
            key = self._keys.block(step, b)
            self._hold(step, groups.tolist(), key)
            out.append(self._block(key, recipes, groups, reads))
        return out

    def keep(self, step: int, record: StepRecord, next_step: int) -> None:
        """Keep ``record`` of ``step``; forget steps older than ``loader.retain_steps`` before
        ``next_step`` that no group holds."""
        self.steps[step] = record
        for old in [t for t in self.steps if t < next_step - self._loader.retain_steps]:
            if not self._held_count[old]:
                del self.steps[old]
                self._held_count.pop(old, None)

    def coords(self, rank: int) -> tuple[int, int]:
        """``(DP group, cp rank)`` of ``rank`` (checked against the layout)."""
        self.check_ranks(rank)
        return int(self.where.group_of[rank]), int(self.where.cp_of[rank])

    def part_for(
        self, group: int, cp: int, step: int, planned: int
    ) -> tuple[Part | None, SubmitConstruct | None]:
        """What group ``group``'s cp rank ``cp`` fetches for ``step`` (None: not planned yet),
        and the construction that rebuilds it if it was released."""
        if step >= planned:
            return None, None
        key = self.held.get((step, group))
        rebuild = None
        if key is None:
            rebuild = self._rebuild(step, group)
            key = rebuild.key
        return (key, self._keys.part(group, cp)), rebuild

    def restart_at(self, step: int) -> None:
        """Every rank at ``step`` (a resume: the steps before it are fetched)."""
        self.where.reset(step)

    def positions(self) -> dict[int, dict[str, int]]:
        """Each rank's position and requested end (for stats)."""
        w = self.where
        return {
            r: {"position": p, "requested_end": e}
            for r, (p, e) in enumerate(zip(w.position.tolist(), w.requested.tolist(), strict=True))
        }

    def check_ranks(self, ranks: int | Sequence[int]) -> np.ndarray:
        """``ranks`` as an array, each checked against the layout (JobError naming it)."""
        chosen = np.atleast_1d(np.asarray(ranks, dtype=np.int64))
        world = self.layout.world_size
        if chosen.ndim != 1 or not len(chosen):
            raise JobError(f"a request must name at least one rank, got {ranks!r}")
        bad = chosen[(chosen < 0) | (chosen >= world)]
        if len(bad):
            raise JobError(
                f"rank {int(bad[0])} is not in the layout (world size {world}: "
                f"{self._layout_text()})"
            )
        return chosen

    # -- internals ---------------------------------------------------------------------------
    def _block(
        self, key: str, recipes: RecipeTable, rows: np.ndarray, reads: list[ReadSpec]
    ) -> SubmitConstruct:
        """A construction of recipes ``rows`` under ``key``, each read of the block once."""
        table, used = recipes.select_reads(rows)
        specs = tuple(reads[i] for i in used.tolist())
        return SubmitConstruct(key, table, specs, self.layout.cp)

    def _rebuild(self, step: int, group: int) -> SubmitConstruct:
        """Submit a released step's batch for ``group`` again, alone, from its kept recipe."""
        record = self.steps.get(step)
        if record is None:
            raise JobError(
                f"step {step} is no longer held for DP group {group}: the data plane keeps "
                f"the last {self._loader.retain_steps} steps (loader.retain_steps); resume from "
                "a data-plane checkpoint to go further back"
            )
        record.rebuilds += 1
        key = self._keys.rebuild(step, group, record.rebuilds)
        self._hold(step, [group], key)
        return self._block(key, record.recipes, np.asarray([group]), record.reads)

    def _hold(self, step: int, groups: list[int], key: str) -> None:
        """Hold ``key`` for ``groups`` at ``step`` (one block's groups at once)."""
        held, heaps, left = self.held, self._held_steps, self._block_left
        pairs = [(step, group) for group in groups]
        if step >= self._newest_held and held.keys().isdisjoint(pairs):
            # The usual case, a new step: no group holds it yet, and it is at least every
            # step in the heaps, so appending it is what heappush would do.
            held.update(dict.fromkeys(pairs, key))
            for group in groups:
                heaps[group].append(step)
            self._newest_held = step
            self._held_count[step] += len(groups)
            left[key] += len(groups)
            return
        self._newest_held = max(self._newest_held, step)
        new = 0
        for group in groups:
            old = held.get((step, group))
            if old is None:
                heapq.heappush(heaps[group], step)
                new += 1
            else:
                left[old] -= 1  # (a rebuild replaces a lost hold; not in practice)
            held[(step, group)] = key
        self._held_count[step] += new
        left[key] += len(groups)

    def _release_fetched(self, group: int) -> list[str]:
        """The blocks no group holds any more once ``group``'s fetched steps are let go."""
        fetched = self.where.group_min[group]
        heap = self._held_steps[group]
        keys: list[str] = []
        while heap and heap[0] < fetched:
            step = heapq.heappop(heap)
            key = self.held.pop((step, group), None)
            if key is not None:
                self._held_count[step] -= 1
                self._block_left[key] -= 1
                if self._block_left[key] <= 0:
                    del self._block_left[key]
                    keys.append(key)
        return keys

    def _layout_text(self) -> str:
        lay = self.layout
        return f"dp={lay.dp} tp={lay.tp} pp={lay.pp} cp={lay.cp}"

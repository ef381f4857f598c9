"""Which batch each rank gets: ranks' positions, the batches held for them, rebuilds.

One batch is built per (step, DP group); every tensor- and pipeline-parallel rank of the group
fetches that key, and context-parallel rank c fetches slice c of it. A batch is held until
every rank of its group has fetched its step, then released; a rank that comes back for a
released step gets it rebuilt from the step's kept recipe (the last ``loader.retain_steps``
steps are kept)::

    dp=2, tp=2 (default order): ranks 0, 1 -> group 0, ranks 2, 3 -> group 1
    step 5 drawn          hold 5/g0, 5/g1
    rank 0 asks from 6    rank 1 has not fetched step 5 yet: nothing released
    rank 1 asks from 6    every rank of group 0 is past 5: release 5/g0
    rank 1 asks for 5     5/g0 rebuilt as omniload-batch-...-5-0-r1, held again

Pure: no I/O and no Dask.
"""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass

import numpy as np

from omniload_dask.batching.formats import Recipe
from omniload_dask.core.actions import ReadSpec, Release, SubmitConstruct
from omniload_dask.core.keys import Keys
from omniload_dask.errors import JobError
from omniload_dask.plan import Plan

__all__ = ["Delivery", "RankState", "StepRecord"]


@dataclass
class StepRecord:
    """What is kept of a drawn step: recipes to rebuild it, and its figures."""

    recipes: list[Recipe]
    reads: list[tuple[ReadSpec, ...]]
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
    """Ranks' positions, the batch keys held per (step, group), and the steps kept."""

    def __init__(self, plan: Plan, keys: Keys, start_step: int = 0) -> None:
        """Every rank of ``plan.layout`` at ``start_step``; nothing held yet."""
        self.layout = plan.layout
        self._keys = keys
        self._loader = plan.loader
        self.steps: dict[int, StepRecord] = {}
        self.held: dict[tuple[int, int], str] = {}
        self._held_steps: list[list[int]] = [[] for _ in range(self.layout.dp)]  # heaps
        self._held_count: Counter[int] = Counter()  # groups holding each step
        self._group_ranks = [self.layout.group_ranks(g) for g in range(self.layout.dp)]
        self.ranks = {r: RankState(start_step, start_step) for r in range(self.layout.world_size)}

    def request(self, rank: int, start: int, count: int, now: float) -> list[Release]:
        """Rank ``rank`` has fetched every step below ``start`` and asks for ``count`` more;
        returns the release of its group's batches that every rank has now fetched."""
        if rank not in self.ranks:
            raise JobError(
                f"rank {rank} is not in the layout (world size "
                f"{self.layout.world_size}: {self._layout_text()})"
            )
        if start < 0 or count < 1:
            raise JobError(
                f"request for rank {rank}: start must be >= 0 and count >= 1, "
                f"got start={start}, count={count}"
            )
        state = self.ranks[rank]
        state.position = start
        state.requested_end = start + count
        state.last_seen = now
        return self._release_fetched(self.layout.coords(rank)["dp"])

    def draw_target(self) -> int:
        """Draw the steps below this one: the furthest request and the lookahead, but never
        far beyond the slowest rank (held batches take worker memory)."""
        loader = self._loader
        furthest = max(r.requested_end for r in self.ranks.values())
        slowest = min(r.position for r in self.ranks.values())
        window = 4 * (loader.prefetch + loader.lookahead) + 8
        return min(furthest + loader.lookahead, slowest + window)

    def offer(
        self, step: int, recipes: list[Recipe], reads: list[tuple[ReadSpec, ...]]
    ) -> list[SubmitConstruct]:
        """Hold and build the batches of a drawn step for the groups that will fetch it."""
        out = []
        for g, (recipe, group_reads) in enumerate(zip(recipes, reads, strict=True)):
            if all(self.ranks[r].position > step for r in self._group_ranks[g]):
                continue  # replaying towards where the ranks resume: build on demand only
            key = self._keys.batch(step, g)
            self._hold(step, g, key)
            out.append(SubmitConstruct(key, recipe, group_reads, self._keys.slices(key)))
        return out

    def keep(self, step: int, record: StepRecord, next_step: int) -> None:
        """Keep ``record`` of ``step``; forget steps older than ``loader.retain_steps`` before
        ``next_step`` that no group holds."""
        self.steps[step] = record
        for old in [t for t in self.steps if t < next_step - self._loader.retain_steps]:
            if not self._held_count[old]:
                del self.steps[old]
                self._held_count.pop(old, None)

    def batch_for(
        self, rank: int, step: int, next_step: int
    ) -> tuple[str | None, SubmitConstruct | None]:
        """The key ``rank`` fetches for ``step`` (None: not drawn yet), and the construction
        that rebuilds it if it was released.

        That is its DP group's batch, or with context parallelism its cp rank's slice of it.
        """
        coords = self.layout.coords(rank)
        group = coords["dp"]
        if step >= next_step:
            return None, None
        key = self.held.get((step, group))
        rebuild = None
        if key is None:
            rebuild = self._rebuild(rank, step, group)
            key = rebuild.key
        return (self._keys.slices(key)[coords["cp"]] if self.layout.cp > 1 else key), rebuild

    def restart_at(self, step: int) -> None:
        """Every rank at ``step`` (a resume: the steps before it are fetched)."""
        for rank in self.ranks.values():
            rank.position = rank.requested_end = step

    def positions(self) -> dict[int, dict[str, int]]:
        """Each rank's position and requested end (for stats)."""
        return {
            r: {"position": s.position, "requested_end": s.requested_end}
            for r, s in self.ranks.items()
        }

    def _rebuild(self, rank: int, step: int, group: int) -> SubmitConstruct:
        """Submit a released step's batch for ``group`` again, from its kept recipe."""
        record = self.steps.get(step)
        if record is None:
            raise JobError(
                f"step {step} is no longer held for rank {rank}: the data plane keeps the last "
                f"{self._loader.retain_steps} steps (loader.retain_steps); resume from a "
                "data-plane checkpoint to go further back"
            )
        record.rebuilds += 1
        key = self._keys.batch(step, group, record.rebuilds)
        self._hold(step, group, key)
        return SubmitConstruct(
            key, record.recipes[group], record.reads[group], self._keys.slices(key)
        )

    def _hold(self, step: int, group: int, key: str) -> None:
        if (step, group) not in self.held:
            heapq.heappush(self._held_steps[group], step)
            self._held_count[step] += 1
        self.held[(step, group)] = key

    def _release_fetched(self, group: int) -> list[Release]:
        """Release the batches of ``group`` that every rank of the group has fetched."""
        fetched = min(self.ranks[r].position for r in self._group_ranks[group])
        heap = self._held_steps[group]
        keys: list[str] = []
        while heap and heap[0] < fetched:
            step = heapq.heappop(heap)
            key = self.held.pop((step, group), None)
            if key is not None:
                self._held_count[step] -= 1
                keys += [key, *self._keys.slices(key)]
        return [Release(tuple(keys))] if keys else []

    def _layout_text(self) -> str:
        lay = self.layout
        return f"dp={lay.dp} tp={lay.tp} pp={lay.pp} cp={lay.cp}"

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

Where one task builds several steps (:mod:`.blocks`), the steps of a block are offered as
they are drawn and held back (not fetchable) until its last one is; part ``offset * dp * cp +
group * cp + c`` of a block is step ``first + offset``'s (see :mod:`.keys`)::

    dp=2, steps_per_task=4   blocks: step 0 alone, then steps 1-4, 5-8, ...
                             step 3, group 1 -> part 2 * 2 + 1 = 5
    steps 1, 2, 3 drawn      not fetchable (dealt_step 1); step 4 drawn -> one task

Pure: no I/O and no Dask.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from omniload_dask.batching.formats import RecipeTable
from omniload_dask.core.actions import ReadSpec, Release, SubmitConstruct
from omniload_dask.core.blocks import (
    OpenBlock,
    block_of,
    groups_per_task,
    steps_per_task,
    together_end,
)
from omniload_dask.core.keys import Keys
from omniload_dask.core.positions import RankPositions
from omniload_dask.errors import InternalError, JobError
from omniload_dask.plan import Plan

__all__ = ["Delivery", "Holds", "Part", "RankState", "StepRecord"]

Part = tuple[str, int]  # (block key, part): what one rank fetches for one step


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
        self.block_steps = steps_per_task(plan)
        self._stride = self.layout.dp * self.layout.cp  # parts of one step in a block
        self._origin = start_step  # blocks of several steps start here (blocks.block_of)
        self._open: OpenBlock | None = None
        self._first: dict[str, int] = {}  # multi-step block key -> its first step
        self.steps: dict[int, StepRecord] = {}
        self._held = Holds(self.layout.dp)
        self.where = RankPositions(self.layout, start_step)

    @property
    def held(self) -> Mapping[tuple[int, int], str]:
        """The block key each (step, group) is held under (read it, do not change it)."""
        return self._held

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

    def draw_target(self, drawn_to: int | None = None) -> int:
        """Draw the steps below this one: the furthest request and the lookahead, but never
        far beyond the slowest rank (held batches take worker memory), nor past
        ``loader.live_lead`` steps beyond it where the plan sets one. A block of several
        steps that has begun (committed, or drawn: ``drawn_to`` is the first step not drawn)
        is drawn to its end: none of its steps is fetchable before its last one is in."""
        loader = self._loader
        window = 4 * (loader.prefetch + loader.lookahead) + 8
        target = min(self.where.furthest + loader.lookahead, self.where.slowest + window)
        if loader.live_lead:  # a job that expects live changes bounds how far it draws
            target = min(target, self.where.slowest + loader.live_lead)
        if self._open is not None:
            target = max(target, self._open.end)
        if drawn_to is not None:
            target = max(target, self.block_end(drawn_to - 1))
        return target

    def block_end(self, step: int) -> int:
        """The step after the last of the block that holds ``step`` (``step + 1`` where
        every step is a block of its own)."""
        return block_of(step, self._origin, self.block_steps)[1]

    def together_end(self, first: int, most: int) -> int:
        """:func:`.blocks.together_end` for this job's blocks."""
        return together_end(first, most, self._origin, self.block_steps)

    @property
    def offered_step(self) -> int | None:
        """The first step of the multi-step block being drawn (its steps are not fetchable
        until it is built), or None."""
        return None if self._open is None else self._open.first

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
        behind = (w.position == w.slowest).nonzero()[0]
        if len(behind) == len(w.position):  # all at one step: waiting for it, not for a rank
            return None
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
    ) -> list[SubmitConstruct | Release]:
        """Hold and build a drawn step's blocks, for the groups that will fetch it."""
        if self.block_steps > 1:
            return self._offer_steps(step, recipes, reads)
        out: list[SubmitConstruct | Release] = []
        size, dp = self.block_size, self.layout.dp
        # Groups whose ranks are all past the step (replaying towards where they resume) are
        # built on demand only.
        if self.where.slowest > step:
            return out
        wanted = (np.asarray(self.where.group_min) <= step).nonzero()[0]
        edges = np.append(np.arange(0, dp, size), dp)
        if len(wanted) == dp and step > self._held.newest:
            # The usual case, every group wants a new step: its blocks are runs of recipes,
            # held and selected in one pass each.
            keys = [self._keys.block(step, b) for b in range(len(edges) - 1)]
            self._held.hold_new(step, keys, size)
            for key, (table, used) in zip(keys, recipes.select_runs(edges), strict=True):
                specs = tuple(reads[i] for i in used.tolist())
                out.append(SubmitConstruct(key, (table,), specs, self.layout.cp))
            return out
        bounds = wanted.searchsorted(edges)
        for b in range(len(bounds) - 1):
            groups = wanted[bounds[b] : bounds[b + 1]]
            if not len(groups):
                continue
            key = self._keys.block(step, b)
            self._held.hold(step, groups.tolist(), key)
            out.append(self._block(key, recipes, groups, reads))
        return out

    def defer(self, actions: list[Release]) -> list[Release]:
        """Releases of reads after a step's commit: kept until the multi-step block being
        drawn is built (its steps use those reads), else returned as they are."""
        if self._open is None:
            return actions
        self._open.deferred += actions
        return []

    def flush(self) -> list[SubmitConstruct | Release]:
        """Build the multi-step block being drawn now, with the steps it has (the stream
        ended inside it), then the releases it held back."""
        block, self._open = self._open, None
        if block is None:
            return []
        out: list[SubmitConstruct | Release] = []
        if block.tables:
            key = self._keys.steps_block(block.first, block.end - block.first)
            for step, groups in block.holds:
                self._held.hold(step, groups, key)
            # Its first table is its first step that a rank still wanted: steps every rank
            # was past (ranks resuming inside the block) were left out (_offer_steps).
            self._first[key] = block.holds[0][0]
            tables, specs = tuple(block.tables), tuple(block.specs)
            out.append(SubmitConstruct(key, tables, specs, self.layout.cp, self._stride))
        return out + block.deferred

    def keep(self, step: int, record: StepRecord, next_step: int) -> None:
        """Keep ``record`` of ``step``; forget steps older than ``loader.retain_steps`` before
        ``next_step`` that no group holds."""
        self.steps[step] = record
        for old in [t for t in self.steps if t < next_step - self._loader.retain_steps]:
            if not self._held.count[old]:
                del self.steps[old]
                self._held.count.pop(old, None)

    def coords(self, rank: int) -> tuple[int, int]:
        """``(DP group, cp rank)`` of ``rank`` (checked against the layout)."""
        self.check_ranks(rank)
        return int(self.where.group_of[rank]), int(self.where.cp_of[rank])

    def part_for(
        self, group: int, cp: int, step: int, dealt: int
    ) -> tuple[Part | None, SubmitConstruct | None]:
        """What group ``group``'s cp rank ``cp`` fetches for ``step`` (None: not dealt yet),
        and the construction that rebuilds it if it was released."""
        if step >= dealt:
            return None, None
        if self._open is not None and step >= self._open.first:
            return None, None  # its block is still being drawn
        key = self._held.get((step, group))
        rebuild = None
        if key is None:
            rebuild = self._rebuild(step, group)
            key = rebuild.key
        part = self._keys.part(group, cp)
        if self._first:
            part += (step - self._first.get(key, step)) * self._stride
        return (key, part), rebuild

    def unoffer(self, step: int) -> list[Release]:
        """Forget the steps from ``step`` on that are offered and not built (they are drawn
        again, :mod:`.rewind`): the block being drawn, which must begin at ``step`` or later,
        and their records; returns the releases that block held back."""
        for t in [t for t in self.steps if t >= step]:
            del self.steps[t]
        block = self._open
        if block is None:
            return []
        if block.first < step:
            raise InternalError(f"internal error: steps {block.first}-{step - 1} are not built")
        self._open = None
        return block.deferred

    def restart_at(self, step: int) -> None:
        """Every rank at ``step`` (a resume: the steps before it are fetched)."""
        self.where.reset(step)
        self._origin, self._open = step, None

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
    def _offer_steps(
        self, step: int, recipes: RecipeTable, reads: list[ReadSpec]
    ) -> list[SubmitConstruct | Release]:
        """:meth:`offer` with blocks of several steps: add the step to the block being drawn,
        and build the block at its last step."""
        first, end = block_of(step, self._origin, self.block_steps)
        out: list[SubmitConstruct | Release] = []
        if self._open is not None and self._open.first != first:
            out += self.flush()  # (steps come in order: not in practice)
        wanted = (np.asarray(self.where.group_min) <= step).nonzero()[0]
        if self.where.slowest <= step and len(wanted):
            self._open = self._open or OpenBlock(first, end)
            table, used = recipes.select_reads(wanted)
            self._open.add(step, table, [reads[i] for i in used.tolist()])
        if step >= end - 1:
            out += self.flush()
        return out

    def _block(
        self, key: str, recipes: RecipeTable, rows: np.ndarray, reads: list[ReadSpec]
    ) -> SubmitConstruct:
        """A construction of recipes ``rows`` under ``key``, each read of the block once."""
        table, used = recipes.select_reads(rows)
        specs = tuple(reads[i] for i in used.tolist())
        return SubmitConstruct(key, (table,), specs, self.layout.cp)

    def _rebuild(self, step: int, group: int) -> SubmitConstruct:
        """Submit a released step's batch for ``group`` again, alone, from its kept recipe."""
        record = self.steps.get(step)
        if record is None:
            raise JobError(
                f"step {step} is no longer held for DP group {group}: the data plane keeps "
                f"the last {self._loader.retain_steps} steps (loader.retain_steps). A job of "
                "this name that runs on from an earlier start is past it: stop that job "
                "(`omniload stop NAME --address ADDR`) to start again from step 0, or resume "
                "from a data-plane checkpoint to go back"
            )
        record.rebuilds += 1
        key = self._keys.rebuild(step, group, record.rebuilds)
        self._held.hold(step, [group], key)
        return self._block(key, record.recipes, np.asarray([group]), record.reads)

    def _release_fetched(self, group: int) -> list[str]:
        """The blocks no group holds any more once ``group``'s fetched steps are let go."""
        keys = self._held.release(group, self.where.group_min[group])
        for key in keys:
            self._first.pop(key, None)
        return keys

    def _layout_text(self) -> str:
        lay = self.layout
        return f"dp={lay.dp} tp={lay.tp} pp={lay.pp} cp={lay.cp}"


class Holds(Mapping[tuple[int, int], str]):
    """The block key each (step, group) is held under, as one row of keys per held step (a
    step's holds are one list, not an entry per group), each group's held steps (a heap),
    and how many groups each block still serves."""

    def __init__(self, dp: int) -> None:
        self._dp = dp
        self._rows: dict[int, list[str | None]] = {}  # step -> each group's key (None: none)
        self._heaps: list[list[int]] = [[] for _ in range(dp)]
        self.count: Counter[int] = Counter()  # groups holding each step
        self.left: Counter[str] = Counter()  # groups a held block still serves
        self.newest = -1  # the latest step any group's heap has had pushed

    def __getitem__(self, at: tuple[int, int]) -> str:
        key = self.get(at)
        if key is None:
            raise KeyError(at)
        return key

    def get(self, at: tuple[int, int], default: str | None = None) -> str | None:  # type: ignore[override]
        """The key (step, group) is held under, else ``default`` (one row lookup)."""
        step, group = at
        row = self._rows.get(step)
        key = row[group] if row is not None and 0 <= group < self._dp else None
        return default if key is None else key

    def __iter__(self) -> Iterator[tuple[int, int]]:
        for step, row in list(self._rows.items()):
            for group, key in enumerate(row):
                if key is not None:
                    yield step, group

    def __len__(self) -> int:
        return sum(self.count[step] for step in self._rows)

    def hold(self, step: int, groups: list[int], key: str) -> None:
        """Hold ``key`` for ``groups`` at ``step`` (one block's groups at once)."""
        heaps, left = self._heaps, self.left
        row = self._rows.get(step)
        if step >= self.newest and row is None:
            # The usual case, a new step: no group holds it yet, and it is at least every
            # step in the heaps, so appending it is what heappush would do.
            row = self._rows[step] = [None] * self._dp
            for group in groups:
                row[group] = key
                heaps[group].append(step)
            self.newest = step
            self.count[step] += len(groups)
            left[key] += len(groups)
            return
        if row is None:
            row = self._rows[step] = [None] * self._dp
        self.newest = max(self.newest, step)
        new = 0
        for group in groups:
            old = row[group]
            if old is None:
                heapq.heappush(heaps[group], step)
                new += 1
            else:
                left[old] -= 1  # (a rebuild replaces a lost hold; not in practice)
            row[group] = key
        self.count[step] += new
        left[key] += len(groups)

    def hold_new(self, step: int, keys: list[str], size: int) -> None:
        """Hold block ``keys[b]`` for groups ``b * size`` on at ``step``, every group of a
        step later than any held: :meth:`hold`'s usual case for all of a step's blocks."""
        dp = self._dp
        row: list[str | None] = list(itertools.chain.from_iterable([k] * size for k in keys))
        self._rows[step] = row[:dp]
        for heap in self._heaps:
            heap.append(step)  # (at least every step in the heaps: what heappush would do)
        self.newest = step
        self.count[step] += dp
        for b, key in enumerate(keys):
            self.left[key] += min(size, dp - b * size)

    def release(self, group: int, fetched: int) -> list[str]:
        """Let go ``group``'s holds of steps below ``fetched``; returns the blocks that no
        group holds any more."""
        heap = self._heaps[group]
        keys: list[str] = []
        while heap and heap[0] < fetched:
            step = heapq.heappop(heap)
            row = self._rows.get(step)
            key = row[group] if row is not None else None
            if row is None or key is None:
                continue
            row[group] = None
            self.count[step] -= 1
            if not self.count[step]:
                del self._rows[step]
            self.left[key] -= 1
            if self.left[key] <= 0:
                del self.left[key]
                keys.append(key)
        return keys

"""The data plane as a pure state machine: events in, actions out, no I/O and no Dask.

The scheduler plugin feeds it events (a read unit reported its sample lengths, a rank asked for
steps, a task failed) and carries out the actions it returns (submit a read, submit a
construction, release keys). Everything that decides *which* samples form global batch t lives
here and depends only on the plan, the seed, t and the reported lengths, never on timing::

    ranks ask for steps  ->  draw step t when every source's next documents are known
                             (mixing.Mixer picks them, balance.balance splits them by cost)
                         ->  one SubmitConstruct per DP group (plus, with context
                             parallelism, one slice per cp rank: key suffix -cp{c}), keys
                             released once all the ranks of the group have fetched the step

Tensor- and pipeline-parallel ranks of a group fetch the same key; context-parallel rank c
fetches slice c, so no rank loads what a peer already loaded.

The coordinator is assembled from parts, one concern each: live changes (:mod:`.plane_live`),
read-ahead (:mod:`.plane_reads`) and figures (:mod:`.plane_figures`); its state as plain data
for checkpoints is :mod:`.plane_state`, and its actions are in :mod:`.actions`.

Read units are submitted ahead of need (a window per source that covers the steps drawn ahead),
and released as soon as the cursor has passed them and their constructions are submitted. How
they are read is sized from measured costs (:mod:`.autoscale`): a costly unit is read in parts,
and each source keeps at most its quota of reads in flight; neither changes the stream.
"""

from __future__ import annotations

import heapq
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from omniload_dask.batching.balance import Assignment, Bucket, balance, route
from omniload_dask.batching.cost import CostModel
from omniload_dask.batching.formats import Recipe
from omniload_dask.batching.mixing import Mixer, NeedMore, WeightSchedule
from omniload_dask.core.actions import Action, ReadSpec, Release, SubmitConstruct, SubmitRead
from omniload_dask.core.autoscale import Meter
from omniload_dask.core.figures import Figures, StepFigures
from omniload_dask.core.live import LiveChanges
from omniload_dask.core.reads import ReadAhead
from omniload_dask.core.state import StateRecorder, restore, snapshot
from omniload_dask.core.streams import Candidates, SourceStream, Unit, UnitRef
from omniload_dask.errors import JobError
from omniload_dask.plan import Plan
from omniload_dask.sources import Catalog

__all__ = ["Coordinator", "ReadSpec", "Release", "SubmitConstruct", "SubmitRead"]

HISTORY = 4096


@dataclass
class _Step:
    """What is kept of a drawn step: recipes to rebuild it, and its figures."""

    recipes: list[Recipe]
    reads: list[tuple[ReadSpec, ...]]
    costs: np.ndarray
    tokens: np.ndarray
    source_tokens: np.ndarray
    rebuilds: int = 0


@dataclass
class _Rank:
    position: int  # every step below this one is fetched
    requested_end: int  # asked for steps below this one
    last_seen: float = 0.0


class Coordinator(LiveChanges, ReadAhead, Figures):
    """Single source of truth for cursors, the mix, and which batch each rank gets."""

    def __init__(
        self, plan: Plan, catalogs: Sequence[Catalog], run_id: str, start_step: int = 0
    ) -> None:
        """A fresh data plane at step 0; ranks start at ``start_step`` (steps below it are
        drawn to keep the stream exact, but not built)."""
        self.plan = plan
        self.run_id = run_id
        self.layout = plan.layout
        self.cost = CostModel.from_spec(plan.cost)
        names = plan.source_names
        specs = plan.batch.context_buckets
        self.buckets = [Bucket(b.seq_len, b.micro_batches, bool(b.sources)) for b in specs]
        self.pinned = {names.index(n): b for b, spec in enumerate(specs) for n in spec.sources}
        self.caps = [plan.batch.document_cap_for(n) for n in names]
        self.streams = [
            SourceStream(i, spec, cat, plan.seed)
            for i, (spec, cat) in enumerate(zip(plan.sources, catalogs, strict=True))
        ]
        self.schedule = WeightSchedule({s.name: s.weight for s in plan.sources}, plan.mixing)
        self.mixer = Mixer(len(self.streams), plan.mixing_by)
        self.log: list[dict[str, Any]] = []  # every live change, for replay and resume
        self._pending: list[tuple[int, str, Any]] = []  # source changes not yet in effect
        self._active = np.zeros(len(self.streams), dtype=bool)  # weight > 0 last step
        self.end_step: int | None = None  # the stream ends here (every source exhausted)
        self.next_step = 0
        self.steps: dict[int, _Step] = {}
        self.held: dict[tuple[int, int], str] = {}
        self._held_steps: list[list[int]] = [[] for _ in range(self.layout.dp)]  # heaps
        self._held_count: Counter[int] = Counter()  # groups holding each step
        self._group_ranks = [self.layout.group_ranks(g) for g in range(self.layout.dp)]
        self.ranks = {r: _Rank(start_step, start_step) for r in range(self.layout.world_size)}
        self.error: str | None = None
        self.history: deque[StepFigures] = deque(maxlen=HISTORY)
        self.documents = 0
        self.tokens = 0
        self.capacity_tokens = 0
        self.extra_micro_steps = 0
        self.cuts = 0
        self.spilled = 0
        self.steps_drawn = 0
        self.efficiency_sum = 0.0
        self.efficiency_min = 1.0
        self._actions: list[Action] = []
        self._keys: dict[str, tuple[int, UnitRef]] = {}
        self._starved: set[int] = set()  # sources the last draw waited for
        self._starved_seen: tuple[Any, ...] | None = None  # what that draw saw
        self._reads_seen: dict[int, tuple[Any, ...]] = {}
        self.timing: dict[str, float] = {}  # milliseconds of the last step's planning phases
        self.planning_ms: deque[float] = deque(maxlen=256)
        self._step_weights = np.zeros(len(self.streams))
        # Auto-partitioning (how data is read; never which): measured costs, worker threads.
        loader = plan.loader
        self.workers = loader.workers
        self.threads = loader.workers * loader.threads_per_worker
        self.meters = [Meter() for _ in self.streams]
        self.construct_meter = Meter()
        self._part_of: dict[str, tuple[int, int]] = {}  # part key -> (part, its size)
        self._last_parts: dict[int, int] = {}  # source -> parts of its last submitted unit
        self.recorder = StateRecorder(self)

    # ---------------------------------------------------------------- keys and properties
    def read_key(self, source: int, ref: UnitRef) -> str:
        return f"omniload-read-{self.run_id}-{source}-{ref[0]}-{ref[1]}"

    def batch_key(self, step: int, group: int, rebuild: int = 0) -> str:
        suffix = f"-r{rebuild}" if rebuild else ""
        return f"omniload-batch-{self.run_id}-{step}-{group}{suffix}"

    def slice_keys(self, key: str) -> tuple[str, ...]:
        """Keys of a batch's context-parallel slices (none without context parallelism)."""
        cp = self.layout.cp
        return tuple(f"{key}-cp{c}" for c in range(cp)) if cp > 1 else ()

    @property
    def names(self) -> list[str]:
        return [s.spec.name for s in self.streams]

    def weights_at(self, step: int) -> np.ndarray:
        """Target weights at ``step``; 0 for sources exhausted or removed."""
        w = self.schedule.at(self.names, step, self.tokens)
        for i, stream in enumerate(self.streams):
            if stream.retired or stream.exhausted:
                w[i] = 0.0
        return w

    # ---------------------------------------------------------------- live changes

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """The full data-plane state at the first undrawn step (plain data; see plane_state)."""
        return snapshot(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from a snapshot: this coordinator's sources must be the snapshot's, in order.

        Changes logged for later steps (sources joining or leaving) are scheduled again.
        """
        restore(self, state)
        self._pending = []
        for entry in self.log:
            if entry["kind"] in ("add", "remove") and entry["step"] >= self.next_step:
                if entry["kind"] == "add":
                    stream = self.streams[self.names.index(entry["source"])]
                    self._pending.append((entry["step"], "add", (stream.spec, stream.catalog)))
                else:
                    self._pending.append((entry["step"], "remove", entry["source"]))
        self._pending.sort(key=lambda p: p[0])
        self.recorder = StateRecorder(self)

    def take_deltas(self) -> list[dict[str, Any]]:
        """Deltas of the steps drawn (and changes logged) since the last call."""
        return self.recorder.take()

    # ---------------------------------------------------------------- events
    def on_report(
        self,
        key: str,
        lengths: np.ndarray,
        skipped: int,
        *,
        seconds: float | None = None,
        records: int | None = None,
        patches: np.ndarray | None = None,
        patches_sq: np.ndarray | None = None,
    ) -> None:
        """A read task finished: its records' token counts (file order) and skipped count.

        Image sources also report each record's patches (sum, and sum of squares over its
        images) for the encoder cost. ``seconds`` (the task's compute time) and ``records``
        (read, bad ones included) feed the cost meters that size reads; they never change the
        stream.
        """
        where = self._keys.get(key)
        if where is None:
            return
        part, size = self._part_of.get(key, (0, -1))
        extra = None
        if patches is not None and self.cost.has_encoder:
            sq = patches_sq if patches_sq is not None else np.zeros(len(patches))
            extra = self.cost.encoder_of(patches, sq)
        stream = self.streams[where[0]]
        if stream.report(where[1], lengths, skipped, part, extra) and seconds is not None:
            if size < 0:
                size = stream.catalog.size(stream.units[where[1]].catalog_index)
            count = len(lengths) + skipped if records is None else records
            self.meters[where[0]].add(seconds, size, count, float(np.sum(lengths)))

    def on_construct(self, seconds: float) -> None:
        """A batch construction finished after ``seconds`` of compute (for recommendations)."""
        self.construct_meter.add(seconds, 1, 1, 0)

    def on_workers(self, workers: int, threads: int) -> None:
        """The cluster now has ``workers`` workers with ``threads`` threads in all."""
        self.workers = max(0, int(workers))
        self.threads = max(0, int(threads))

    def on_failure(self, key: str, message: str) -> None:
        """A task failed for good (after retries): the job stops with that message."""
        if self.error is None and key.startswith("omniload-"):
            self.error = message

    def on_request(self, rank: int, start: int, count: int, now: float = 0.0) -> None:
        """Rank ``rank`` has fetched every step below ``start`` and asks for ``count`` more."""
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
        self._release_fetched(self.layout.coords(rank)["dp"])

    # ---------------------------------------------------------------- decisions
    def advance(self, max_steps: int | None = None) -> list[Action]:
        """Draw what can be drawn (at most ``max_steps``), keep reads ahead, return actions."""
        if self.error is None:
            try:
                drawn = 0
                while (
                    (max_steps is None or drawn < max_steps)
                    and self.next_step < self._draw_target()
                    and self._draw()
                ):
                    drawn += 1
                self._submit_reads()
            except JobError as exc:
                self.error = str(exc)
        actions, self._actions = self._actions, []
        return actions

    def has_actions(self) -> bool:
        """Whether actions wait for the next :meth:`advance` (e.g. a rebuild just queued)."""
        return bool(self._actions)

    def batch_for(self, rank: int, step: int) -> str | None:
        """The key ``rank`` fetches for ``step`` if drawn (rebuilt if released), else None.

        That is its DP group's batch, or with context parallelism its cp rank's slice of it.
        """
        coords = self.layout.coords(rank)
        group = coords["dp"]
        if step >= self.next_step:
            return None
        key = self.held.get((step, group))
        if key is None:
            key = self._rebuild(rank, step, group)
        return self.slice_keys(key)[coords["cp"]] if self.layout.cp > 1 else key

    def _rebuild(self, rank: int, step: int, group: int) -> str:
        """Submit a released step's batch for ``group`` again, from its kept recipe."""
        record = self.steps.get(step)
        if record is None:
            raise JobError(
                f"step {step} is no longer held for rank {rank}: the data plane keeps the last "
                f"{self.plan.loader.retain_steps} steps (loader.retain_steps); resume from a "
                "data-plane checkpoint to go further back"
            )
        record.rebuilds += 1
        key = self.batch_key(step, group, record.rebuilds)
        self._hold(step, group, key)
        self._actions.append(
            SubmitConstruct(key, record.recipes[group], record.reads[group], self.slice_keys(key))
        )
        return key

    # ---------------------------------------------------------------- internals
    def _layout_text(self) -> str:
        lay = self.layout
        return f"dp={lay.dp} tp={lay.tp} pp={lay.pp} cp={lay.cp}"

    def _draw_target(self) -> int:
        loader = self.plan.loader
        furthest = max(r.requested_end for r in self.ranks.values())
        slowest = min(r.position for r in self.ranks.values())
        window = 4 * (loader.prefetch + loader.lookahead) + 8
        return min(furthest + loader.lookahead, slowest + window)

    def _budget(self) -> tuple[int | None, int | None]:
        b = self.plan.batch
        return b.global_tokens, b.global_documents

    def _wants(self, i: int, weights: np.ndarray, scale: float) -> tuple[int, int]:
        tokens, docs = self._budget()
        share = weights[i] / weights.sum()
        # A little more than the source's share; the mixer asks again (scale x2) if short.
        if tokens is not None:
            return int(share * tokens * 1.25 * scale) + 1, 2
        return 1, int(share * docs * 1.25 * scale) + 2

    def _draw(self) -> bool:
        """Draw global batch ``next_step``; False if some source must report first."""
        started = time.perf_counter()
        self._apply_pending(self.next_step)
        tokens, docs = self._budget()
        weights = self.weights_at(self.next_step)
        if not (weights > 0).any():
            self.end_step = self.next_step  # nothing left to draw from: the stream ends
            return False
        # The last draw of this step waited for reads: until a source reports (or weights,
        # caps or the budget change) it would wait again, so skip the candidates and the mixer.
        seen = (
            self.next_step,
            weights.tobytes(),
            tuple(self.caps),
            (tokens, docs),
            tuple(stream.version for stream in self.streams),
        )
        if self._starved and seen == self._starved_seen:
            return False
        for joining in np.flatnonzero((weights > 0) & ~self._active).tolist():
            self.mixer.activate(joining)  # (re)joining sources start at the virtual time
        empty = Candidates(np.zeros(0, np.int64))
        cands = [
            stream.candidates(self.caps[i], *self._wants(i, weights, 1.0))
            if weights[i] > 0
            else empty
            for i, stream in enumerate(self.streams)
        ]
        scale = np.ones(len(self.streams))
        while True:
            result = self.mixer.select(
                weights,
                [c.lengths for c in cands],
                [not c.complete for c in cands],
                budget_tokens=tokens,
                budget_documents=docs,
            )
            if not isinstance(result, NeedMore):
                break
            waiting = {i for i in result.sources if cands[i].waiting}
            if waiting:
                self._starved = waiting
                self._starved_seen = seen
                return False
            for i in result.sources:  # only the sources that fell short are asked for more
                scale[i] *= 2
                if scale[i] > 1 << 20:
                    raise JobError("cannot fill a global batch: check batch.global_tokens")
                cands[i] = self.streams[i].candidates(
                    self.caps[i], *self._wants(i, weights, float(scale[i]))
                )
        self._starved = set()
        if len(result.order) == 0:  # every source with weight ran out during this step
            self.end_step = self.next_step
            return False
        self._active = weights > 0
        self._step_weights = weights
        self.mixer.commit(result)
        self._commit(result.order, cands)
        self.recorder.after_step(self, self.next_step - 1)
        total = (time.perf_counter() - started) * 1e3
        split = self.timing.get("split_ms", 0.0) + self.timing.get("recipes_ms", 0.0)
        self.timing.update(step_ms=total, draw_ms=total - split)
        self.planning_ms.append(total)
        return True

    def _commit(self, order: np.ndarray, cands: list[Candidates]) -> None:
        step = self.next_step
        counts = (
            np.bincount(order[:, 0], minlength=len(self.streams))
            if len(order)
            else (np.zeros(len(self.streams), np.int64))
        )
        finished: list[Unit] = []
        for i, stream in enumerate(self.streams):
            finished += stream.consume(cands[i], int(counts[i])) if counts[i] else []
        # Documents in tag order: (source, unit, row in file order, effective length).
        src = order[:, 0]
        idx = order[:, 1]
        doc_unit = np.empty(len(order), dtype=np.int64)  # index into units
        rows = np.empty(len(order), dtype=np.int64)
        lengths = np.empty(len(order), dtype=np.int64)
        extra = np.zeros(len(order)) if self.cost.has_encoder else None
        units: list[tuple[Unit, int]] = []  # (unit, part) read by a shard slot
        unit_source: list[int] = []
        by_source = np.argsort(src, kind="stable")  # one pass instead of one scan per source
        sources_in, first = np.unique(src[by_source], return_index=True)
        bounds = [*first.tolist(), len(src)]
        for j, s in enumerate(sources_in.tolist()):
            sel = by_source[bounds[j] : bounds[j + 1]]
            c = cands[s]
            k = idx[sel]
            lengths[sel] = c.lengths[k]
            local = c.unit_of[k]
            for u in np.unique(local).tolist():
                here = sel[local == u]
                unit = c.units[u]
                unit_rows = unit.order[c.row_of[k[local == u]]]
                if extra is not None and unit.extra is not None:
                    extra[here] = unit.extra[unit_rows]
                part, part_rows = unit.locate(unit_rows)
                for p in np.unique(part).tolist():
                    mine = part == p
                    rows[here[mine]] = part_rows[mine]
                    doc_unit[here[mine]] = len(units)
                    units.append((unit, p))
                    unit_source.append(s)
        self._plan_step(step, src, units, unit_source, doc_unit, rows, lengths, extra)
        if finished:
            self._actions.append(Release(tuple(k for u in finished for k in u.keys)))
            for u in finished:
                self._forget(u)
        self.next_step += 1
        for old in [t for t in self.steps if t < self.next_step - self.plan.loader.retain_steps]:
            if not self._held_count[old]:
                del self.steps[old]
                self._held_count.pop(old, None)

    def _plan_step(
        self,
        step: int,
        src: np.ndarray,
        units: list[tuple[Unit, int]],
        unit_source: list[int],
        doc_unit: np.ndarray,
        rows: np.ndarray,
        lengths: np.ndarray,
        extra: np.ndarray | None = None,
    ) -> None:
        """Balance the step's documents over the DP groups; one recipe and construct each."""
        t0 = time.perf_counter()
        plan = self.plan_split(src, lengths, extra)
        t1 = time.perf_counter()
        recipes, reads = self._recipes(step, plan, units, unit_source, doc_unit, rows)
        self.timing.update(split_ms=(t1 - t0) * 1e3, recipes_ms=(time.perf_counter() - t1) * 1e3)
        for g, (recipe, group_reads) in enumerate(zip(recipes, reads, strict=True)):
            if all(self.ranks[r].position > step for r in self._group_ranks[g]):
                continue  # replaying towards where the ranks resume: build on demand only
            key = self.batch_key(step, g)
            self._hold(step, g, key)
            self._actions.append(SubmitConstruct(key, recipe, group_reads, self.slice_keys(key)))
        source_tokens = np.bincount(src, weights=lengths, minlength=len(self.streams))
        self.steps[step] = _Step(recipes, reads, plan.group_costs, plan.group_tokens, source_tokens)
        self._record(step, plan, lengths, source_tokens, src)

    def plan_split(
        self, src: np.ndarray, lengths: np.ndarray, extra: np.ndarray | None = None
    ) -> Assignment:
        """Route a step's documents to buckets and split them among the DP groups (pure).

        ``extra`` is each document's encoder cost (images), balanced with the backbone's.
        """
        bucket, by_length = route(lengths, src, self.buckets, self.pinned)
        return balance(
            lengths,
            bucket,
            self.buckets,
            self.layout.dp,
            self.cost,
            by_length=by_length,
            cut=self.plan.batch.long_documents == "split",
            extra=extra,
        )

    def _recipes(
        self,
        step: int,
        plan: Assignment,
        units: list[tuple[Unit, int]],
        unit_source: list[int],
        doc_unit: np.ndarray,
        rows: np.ndarray,
    ) -> tuple[list[Recipe], list[tuple[ReadSpec, ...]]]:
        """Per group: pieces as (micro-step, shard slot, row, start, stop), and its reads.

        A group's shard slots number the units it reads in order of first use.
        """
        groups, nu = self.layout.dp, max(1, len(units))
        order = plan.output_order()
        piece_unit = doc_unit[plan.doc[order]]
        group = plan.group[order]
        pair, first, inverse = np.unique(
            group * nu + piece_unit, return_index=True, return_inverse=True
        )
        by_use = np.lexsort((first, pair // nu))
        pair_group = (pair // nu)[by_use]
        slot = np.empty(len(pair), dtype=np.int64)
        slot[by_use] = np.arange(len(pair)) - np.searchsorted(pair_group, pair_group, "left")
        start = plan.start[order]
        table = np.stack(
            [
                plan.micro[order],
                slot[inverse.reshape(-1)],
                rows[plan.doc[order]],
                start,
                start + plan.length[order],
            ],
            axis=1,
        )
        used = (pair % nu)[by_use].tolist()
        bounds = np.searchsorted(group, np.arange(groups + 1)).tolist()
        pair_bounds = np.searchsorted(pair_group, np.arange(groups + 1)).tolist()
        specs = [self._read_spec(s, *u) for s, u in zip(unit_source, units, strict=True)]
        capacity = tuple(plan.micro_capacity.tolist())
        batch = self.plan.batch
        recipes, reads = [], []
        for g in range(groups):
            mine = used[pair_bounds[g] : pair_bounds[g + 1]]
            recipes.append(
                Recipe(
                    step=step,
                    group=g,
                    num_micro_steps=plan.num_micro_steps,
                    pieces=table[bounds[g] : bounds[g + 1]],
                    seq_len=batch.seq_len,
                    slot_epochs=tuple(units[u][0].epoch for u in mine),
                    pad_to_seq_len=batch.pad_to_seq_len,
                    micro_seq_lens=capacity,
                    patch_size=self.plan.images.patch_size if self.plan.images else 0,
                )
            )
            reads.append(tuple(specs[u] for u in mine))
        return recipes, reads

    def _hold(self, step: int, group: int, key: str) -> None:
        if (step, group) not in self.held:
            heapq.heappush(self._held_steps[group], step)
            self._held_count[step] += 1
        self.held[(step, group)] = key

    def _release_fetched(self, group: int) -> None:
        """Release the batches of ``group`` that every rank of the group has fetched."""
        fetched = min(self.ranks[r].position for r in self._group_ranks[group])
        heap = self._held_steps[group]
        keys: list[str] = []
        while heap and heap[0] < fetched:
            step = heapq.heappop(heap)
            key = self.held.pop((step, group), None)
            if key is not None:
                self._held_count[step] -= 1
                keys += [key, *self.slice_keys(key)]
        if keys:
            self._actions.append(Release(tuple(keys)))

    # ---------------------------------------------------------------- figures

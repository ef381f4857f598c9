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

Read units are submitted ahead of need (a window per source that covers the steps drawn ahead),
and released as soon as the cursor has passed them and their constructions are submitted. How
they are read is sized from measured costs (:mod:`.autoscale`): a costly unit is read in parts,
and each source keeps at most its quota of reads in flight; neither changes the stream.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import autoscale
from .autoscale import Meter
from .balance import Assignment, Bucket, balance, route
from .batches import Recipe
from .cost import CostModel
from .errors import JobError
from .mixing import Mixer, NeedMore, WeightSchedule
from .plan import Plan, SourceSpec, check_weights, source_dict
from .plane_state import StateRecorder, catalog_fingerprint, restore, snapshot
from .sources import Catalog
from .streams import Candidates, SourceStream, Unit, UnitRef

__all__ = ["Coordinator", "ReadSpec", "Release", "SubmitConstruct", "SubmitRead"]

MAX_UNITS_AHEAD = 256
HISTORY = 4096


@dataclass(frozen=True)
class ReadSpec:
    """Everything a read task needs; the key is deterministic within a run."""

    key: str
    source: int
    file_index: int
    file_url: str
    start: int
    stop: int


@dataclass(frozen=True)
class SubmitRead:
    read: ReadSpec


@dataclass(frozen=True)
class SubmitConstruct:
    """Build one group's batch; with ``slices``, also cut slice c of it under ``slices[c]``."""

    key: str
    recipe: Recipe
    reads: tuple[ReadSpec, ...]  # in shard-slot order
    slices: tuple[str, ...] = ()


@dataclass(frozen=True)
class Release:
    keys: tuple[str, ...]


Action = SubmitRead | SubmitConstruct | Release


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


@dataclass
class StepFigures:
    step: int
    efficiency: float
    num_micro_steps: int
    tokens: int
    documents: int
    source_tokens: list[int] = field(default_factory=list)
    source_documents: list[int] = field(default_factory=list)
    target: list[float] = field(default_factory=list)  # weight shares the step was drawn with
    cuts: int = 0


class Coordinator:
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
    def set_weights(self, weights: dict[str, float], at_step: int | None = None) -> int:
        """Change source weights from ``at_step`` (default: the first step not yet drawn).

        Batches already drawn never change; the change is logged so a replay reproduces it.
        Returns the step it takes effect at.
        """
        step = self._future_step(at_step, "set_weights")
        live = [s.spec.name for s in self.streams if not s.retired]
        clean = (
            check_weights("weights", weights, live)
            if any(v > 0 for v in _finite_values(weights))
            else _zero_weights(weights, live)
        )
        trial = WeightSchedule(dict(self.schedule.base), self.schedule.spec)
        trial.changes = [*self.schedule.changes, (step, clean)]
        w = trial.at(self.names, step, self.tokens)
        usable = [not (s.retired or s.exhausted) for s in self.streams]
        if not any(w[i] > 0 for i in range(len(w)) if usable[i]):
            raise JobError(
                f"set_weights: {clean} would leave no source with a weight > 0 at step {step}"
            )
        self.schedule.change(step, clean)
        self._log({"step": step, "kind": "weights", "weights": clean})
        return step

    def add_source(self, spec: SourceSpec, catalog: Catalog, at_step: int | None = None) -> int:
        """Add (or bring back) a source from ``at_step`` on; returns that step."""
        step = self._future_step(at_step, "add_source")
        known = {s.spec.name: s for s in self.streams}
        old = known.get(spec.name)
        if old is not None and not old.retired:
            raise JobError(f"add_source: source {spec.name!r} is already in the job")
        if old is not None and (old.spec.paths, old.spec.format) != (spec.paths, spec.format):
            raise JobError(
                f"add_source: source {spec.name!r} was in the job with other paths or "
                "format; add it under a new name"
            )
        self._pending.append((step, "add", (spec, catalog)))
        self._pending.sort(key=lambda p: p[0])
        self._log(
            {
                "step": step,
                "kind": "add",
                "source": spec.name,
                "spec": source_dict(spec),
                "catalog": catalog_fingerprint(catalog),
            }
        )
        return step

    def remove_source(self, name: str, at_step: int | None = None) -> int:
        """Stop drawing from ``name`` from ``at_step`` on (its cursor is kept); returns it."""
        step = self._future_step(at_step, "remove_source")
        live = [s.spec.name for s in self.streams if not s.retired]
        if name not in live:
            raise JobError(
                f"remove_source: no source {name!r} in the job (sources: {', '.join(live)})"
            )
        if len(live) == 1:
            raise JobError(f"remove_source: {name!r} is the job's last source")
        self._pending.append((step, "remove", name))
        self._pending.sort(key=lambda p: p[0])
        self._log({"step": step, "kind": "remove", "source": name})
        return step

    def _log(self, entry: dict[str, Any]) -> None:
        self.log.append(entry)
        self.recorder.log(entry)

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

    def _future_step(self, at_step: int | None, what: str) -> int:
        if at_step is None:
            return self.next_step
        if isinstance(at_step, bool) or not isinstance(at_step, int):
            raise JobError(f"{what}: at_step must be an integer, got {at_step!r}")
        if at_step < self.next_step:
            raise JobError(
                f"{what}: step {at_step} is already drawn (the first step not yet "
                f"drawn is {self.next_step}); batches already drawn never change"
            )
        return at_step

    def _apply_pending(self, step: int) -> None:
        while self._pending and self._pending[0][0] <= step:
            _, kind, payload = self._pending.pop(0)
            if kind == "add":
                spec, catalog = payload
                self._add_stream(spec, catalog)
            else:
                stream = self.streams[self.names.index(payload)]
                stream.retired = True
                dropped = list(stream.units.values())
                for unit in dropped:
                    self._forget(unit)
                stream.units.clear()
                stream._cache = None
                stream.version += 1
                stream.next_submit = (stream.epoch, stream.position)
                if dropped:
                    self._actions.append(Release(tuple(k for u in dropped for k in u.keys)))

    def _add_stream(self, spec: SourceSpec, catalog: Catalog) -> None:
        names = self.names
        if spec.name in names:  # coming back: keep its cursor
            stream = self.streams[names.index(spec.name)]
            stream.retired = False
            stream.spec = spec
        else:
            index = len(self.streams)
            if index >= 1024:
                raise JobError("add_source: at most 1024 sources per job")
            self.streams.append(SourceStream(index, spec, catalog, self.plan.seed))
            self.meters.append(Meter())
            self.caps.append(self.plan.batch.document_cap_for(spec.name))
            self.mixer.add_source()
            self._active = np.append(self._active, False)
        self.schedule.add_source(spec.name, spec.weight)

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

    def _record(
        self,
        step: int,
        plan: Assignment,
        lengths: np.ndarray,
        source_tokens: np.ndarray,
        sources: np.ndarray,
    ) -> None:
        efficiency = plan.efficiency
        self.documents += len(lengths)
        self.tokens += int(lengths.sum())
        self.capacity_tokens += self.layout.dp * int(plan.micro_capacity.sum())
        declared = sum(b.micro_batches for b in self.buckets)
        self.extra_micro_steps += max(0, plan.num_micro_steps - declared)
        self.cuts += plan.cuts
        self.spilled += plan.spilled
        self.steps_drawn += 1
        self.efficiency_sum += efficiency
        self.efficiency_min = min(self.efficiency_min, efficiency)
        self.history.append(
            StepFigures(
                step=step,
                efficiency=efficiency,
                num_micro_steps=plan.num_micro_steps,
                tokens=int(lengths.sum()),
                documents=len(lengths),
                source_tokens=source_tokens.astype(int).tolist(),
                source_documents=np.bincount(sources, minlength=len(self.streams)).tolist(),
                target=(self._step_weights / max(self._step_weights.sum(), 1e-300))
                .round(6)
                .tolist(),
                cuts=plan.cuts,
            )
        )

    def _read_spec(self, source: int, unit: Unit, part: int = 0) -> ReadSpec:
        stream = self.streams[source]
        f, lo, hi = (int(v) for v in stream.catalog.units[unit.catalog_index])
        if unit.parts > 1:
            lo, hi = stream.catalog.parts(unit.catalog_index, unit.parts)[part]
        return ReadSpec(unit.keys[part], source, f, stream.catalog.files[f], lo, hi)

    def _forget(self, unit: Unit) -> None:
        for key in unit.keys:
            self._keys.pop(key, None)
            self._part_of.pop(key, None)

    def _submit_reads(self) -> None:
        # Read ahead for sources that take part now or within the lookahead (schedules).
        horizon = self.next_step + self.plan.loader.lookahead
        weights = np.maximum(self.weights_at(self.next_step), self.weights_at(horizon))
        quota = self.read_quotas(weights) if self.plan.loader.quotas else None
        total = float(weights.sum())
        for i, stream in enumerate(self.streams):
            if weights[i] <= 0:
                continue
            pending = stream.pending_reads()
            limit = int(quota[i]) if quota is not None else -1
            seen = (
                stream.version,
                weights[i],
                total,
                i in self._starved,
                len(stream.units),
                pending,  # a part of a unit reported (the quota has room)
                limit,  # costs measured, weights or workers changed
            )
            if self._reads_seen.get(i) == seen:
                continue  # nothing changed for this source since the last look
            self._reads_seen[i] = seen
            window = self._read_window(i, weights)
            # A draw waiting on this source gets its next unknown unit even past the window
            # and the quota.
            need = stream.first_unknown() if i in self._starved else (-1, -1)
            while True:
                ref = stream.next_submit
                ahead = stream.submitted_ahead()
                if not stream.within_epochs(ref):
                    break
                if ahead >= MAX_UNITS_AHEAD or (ahead >= window and ref > need):
                    break
                if limit >= 0 and pending >= limit and ref > need:
                    break
                catalog_index = stream.catalog_index(ref)
                unit = Unit(self.read_key(i, ref), ref[0], ref[1], catalog_index)
                self._split(i, unit)
                stream.units[ref] = unit
                for p, key in enumerate(unit.keys):
                    self._keys[key] = (i, ref)
                    if unit.parts > 1:
                        self._part_of[key] = (p, unit.part_sizes[p])
                stream.next_submit = stream.successor(ref)
                pending += unit.parts
                for p in range(unit.parts):
                    self._actions.append(SubmitRead(self._read_spec(i, unit, p)))

    def _split(self, source: int, unit: Unit) -> None:
        """Read ``unit`` in parts of about ``loader.task_seconds`` each (measured cost)."""
        catalog = self.streams[source].catalog
        u = unit.catalog_index
        size = catalog.size(u)
        parts = autoscale.part_count(
            size, self.meters[source].per_size, self.plan.loader.task_seconds, catalog.max_parts(u)
        )
        self._last_parts[source] = parts
        if parts > 1:
            unit.parts = len(catalog.parts(u, parts))
            n = unit.parts
            unit.part_sizes = tuple((p + 1) * size // n - p * size // n for p in range(n))

    def read_work(self, weights: np.ndarray) -> np.ndarray:
        """Measured read seconds per step of each source at ``weights`` (NaN: not measured)."""
        tokens, docs = self._budget()
        total = weights.sum()
        out = np.full(len(self.streams), np.nan)
        for i, meter in enumerate(self.meters):
            share = weights[i] / total if total > 0 else 0.0
            if share <= 0:
                out[i] = 0.0
                continue
            if tokens is not None and meter.per_token is not None:
                out[i] = share * tokens * meter.per_token
            elif docs is not None and meter.per_record is not None:
                out[i] = share * docs * meter.per_record
        return out

    def read_quotas(self, weights: np.ndarray) -> np.ndarray:
        """In-flight read tasks allowed per source (:func:`.autoscale.quotas`)."""
        slots = max(1, self.plan.loader.reads_per_thread * max(self.threads, 1))
        return autoscale.quotas(self.read_work(weights), slots)

    def work_per_step(self) -> float | None:
        """Measured worker seconds one step costs (reads of every source and constructions)."""
        work = self.read_work(self.weights_at(self.next_step))
        if not np.isfinite(work).all():
            return None
        per_construct = self.construct_meter.per_record or 0.0
        return float(work.sum()) + per_construct * self.layout.dp

    def _read_window(self, i: int, weights: np.ndarray) -> int:
        """Units to keep submitted for source i: enough for the steps drawn ahead."""
        loader = self.plan.loader
        stream = self.streams[i]
        known = [u for u in stream.units.values() if u.lengths is not None]
        tokens, docs = self._budget()
        share = weights[i] / weights.sum()
        if not known:
            return loader.read_ahead
        if tokens is not None:
            sizes = [u.capped_tokens(self.caps[i]) for u in known]
            per_step = share * tokens
        else:
            sizes = [len(u.lengths) for u in known]  # type: ignore[arg-type]
            per_step = share * docs
        per_unit = max(1.0, float(np.mean(sizes)))
        steps_ahead = loader.lookahead + loader.prefetch
        return loader.read_ahead + math.ceil(per_step * steps_ahead / per_unit)

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
    def stats(self) -> dict[str, Any]:
        """Counters for feeders, the report and monitoring (plain data)."""
        steps = self.steps_drawn
        recent = list(self.history)[-64:]
        weights = self.weights_at(self.next_step)
        quotas = self.read_quotas(weights) if self.plan.loader.quotas else None
        return {
            "next_step": self.next_step,
            "end_step": self.end_step,
            "log": list(self.log),
            "error": self.error,
            "documents": self.documents,
            "tokens": self.tokens,
            "capacity_tokens": self.capacity_tokens,
            "extra_micro_steps": self.extra_micro_steps,
            "documents_cut": self.cuts,
            "documents_spilled": self.spilled,
            "steps_drawn": steps,
            "efficiency_mean": self.efficiency_sum / steps if steps else None,
            "efficiency_min": self.efficiency_min if steps else None,
            "efficiency_recent": [round(f.efficiency, 4) for f in recent],
            "planning_ms_p50": float(np.median(self.planning_ms)) if self.planning_ms else None,
            "held_batches": len(self.held),
            "units_in_flight": sum(len(s.units) for s in self.streams),
            "ranks": {
                r: {"position": s.position, "requested_end": s.requested_end}
                for r, s in self.ranks.items()
            },
            "sources": [
                {
                    "name": s.spec.name,
                    "weight": float(weights[i]),
                    "epoch": s.epoch,
                    "epochs": s.spec.epochs,
                    "exhausted": s.exhausted,
                    "retired": s.retired,
                    "documents": s.docs,
                    "tokens": s.tokens,
                    "skipped": s.skipped,
                    "truncated_tokens": s.truncated_tokens,
                    "units_in_flight": len(s.units),
                    "reads_pending": sum(1 for u in s.units.values() if u.lengths is None),
                    "read_window": self._read_window(i, weights) if weights[i] > 0 else 0,
                    "read_tasks_pending": s.pending_reads(),
                    "quota": int(quotas[i]) if quotas is not None else None,
                    "seconds_per_record": self.meters[i].per_record,
                    "read_parts": self._last_parts.get(i, 1),
                }
                for i, s in enumerate(self.streams)
            ],
            "worker_threads": self.threads,
            "work_per_step": self.work_per_step(),
        }

    def step_figures(self, start: int = 0) -> list[StepFigures]:
        return [f for f in self.history if f.step >= start]

    def mixture(self, window: int = 100) -> list[dict[str, Any]]:
        """Per source: target and realised share, over the last ``window`` steps and overall.

        Shares are of tokens or of documents, as the plan's ``mixing.by`` says; the target of a
        window is the mean of its steps' normalised target weights.
        """
        by_tokens = self.plan.mixing_by == "tokens"
        n = len(self.streams)
        recent = list(self.history)[-window:]

        def pad(values: list[Any]) -> np.ndarray:
            return np.asarray(list(values) + [0] * (n - len(values)), dtype=np.float64)

        got = np.zeros(n)
        target = np.zeros(n)
        for f in recent:
            got += pad(f.source_tokens if by_tokens else f.source_documents)
            target += pad(f.target)
        total = np.asarray([s.tokens if by_tokens else s.docs for s in self.streams], float)
        now = self.weights_at(self.next_step)
        out = []
        for i, stream in enumerate(self.streams):
            out.append(
                {
                    "name": stream.spec.name,
                    "target_now": float(now[i] / now.sum()) if now.sum() else 0.0,
                    "target_window": float(target[i] / len(recent)) if recent else 0.0,
                    "realised_window": float(got[i] / got.sum()) if got.sum() else 0.0,
                    "realised_total": float(total[i] / total.sum()) if total.sum() else 0.0,
                    "epoch": stream.epoch,
                    "exhausted": stream.exhausted,
                    "retired": stream.retired,
                }
            )
        return out


def _finite_values(weights: dict[str, Any]) -> list[float]:
    return [
        float(v)
        for v in weights.values()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    ]


def _zero_weights(weights: dict[str, Any], names: list[str]) -> dict[str, float]:
    """Validate a change that only sets weights to 0 (allowed if others stay positive)."""
    from ._validate import check_number

    if not weights:
        raise JobError("set_weights: give at least one source weight")
    out = {}
    for name, value in weights.items():
        if name not in names:
            raise JobError(f"weights.{name}: unknown source (sources: {', '.join(names)})")
        out[str(name)] = check_number(f"weights.{name}", value, min=0)
    return out

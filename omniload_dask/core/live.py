"""The job's sources as they change while it runs: weights, sources joining and leaving.

:class:`LiveSources` owns the source streams, their document caps, the weight schedule and the
log of live changes. A change is checked when it is asked for and takes effect at a step not
built yet (the caller says which steps that leaves: steps drawn and not built are drawn
again, see :mod:`.rewind`); every change is logged, so a replay or a resume reproduces it::

    set_weights({"code": 2.0})            from the first step not built; the schedule answers it
    remove_source("web", at_step=50)      pending until step 50 is drawn: then web stops and
                                          its read units are released (its cursor is kept)
    add_source(spec, catalog, at_step=60) pending until step 60: a new stream, or the old one
                                          back with its cursor

Changes may be queued for future steps back to back. Each one is checked against the job as it
will be at its step (with the changes queued for steps up to it in effect,
:meth:`LiveSources.live_at`), and a new plan version is compared with the plan due at its step,
not the one in force now (:meth:`LiveSources.plan_change`)::

    v2 at step 20 removes c; v3 at step 40 lists a, b, c again
    v3 against the plan due at 40 (a, b):  c is added back at 40      (not "nothing changes")

Sources join or leave in step order: a source change for a step before one already queued is
refused (it would change what that later change was checked against).

Pure: no I/O and no Dask. The coordinator passes in the step and token counts it asks about.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omniload_dask.batching.mixing import WeightSchedule
from omniload_dask.core.streams import SourceStream, Unit
from omniload_dask.errors import JobError
from omniload_dask.plan import Plan, SourceSpec, check_weights, source_dict
from omniload_dask.plan.fields import check_number
from omniload_dask.sources.catalog import Catalog, catalog_fingerprint

__all__ = [
    "MAX_SOURCES_PER_JOB",
    "Applied",
    "LiveSources",
    "PlanChange",
    "adopt_plan",
    "future_step",
    "token_shares",
]

MAX_SOURCES_PER_JOB = 1024  # the sample id has 10 bits for the source


@dataclass
class Applied:
    """What one source change did: the index of a stream new to the job, or the units in
    flight of a source that left (to forget and release)."""

    joined: int | None = None
    dropped: list[Unit] = field(default_factory=list)


@dataclass(frozen=True)
class PlanChange:
    """What a new plan version changes at its step: sources added, removed, and the weights
    (of the sources it keeps or adds) that differ from those due at that step."""

    added: list[SourceSpec]
    removed: list[str]
    weights: dict[str, float]


class LiveSources:
    """The sources of a job, their weights at every step, and the log of live changes.

    ``on_log`` is called with every entry as it is logged (the checkpoint deltas record it).
    """

    def __init__(
        self, plan: Plan, catalogs: Sequence[Catalog], on_log: Callable[[dict[str, Any]], None]
    ) -> None:
        """The plan's sources (with ``catalogs``, in the same order) and its weights."""
        self._seed = plan.seed
        self._batch = plan.batch
        self.streams = [
            SourceStream(i, spec, cat, plan.seed)
            for i, (spec, cat) in enumerate(zip(plan.sources, catalogs, strict=True))
        ]
        self.caps = [plan.batch.document_cap_for(n) for n in plan.source_names]
        self.schedule = WeightSchedule({s.name: s.weight for s in plan.sources}, plan.mixing)
        self.log: list[dict[str, Any]] = []  # every live change, for replay and resume
        self._pending: list[tuple[int, str, Any]] = []  # source changes not yet in effect
        self.applied = 0  # source changes put into effect (a redraw cannot go back past one)
        self._on_log = on_log

    @property
    def names(self) -> list[str]:
        """Source names by index (sources that left keep their index)."""
        return [s.spec.name for s in self.streams]

    def weights_at(self, step: int, tokens: int) -> np.ndarray:
        """Target weights at ``step`` (``tokens`` drawn before it); 0 for sources exhausted
        or removed."""
        w = self.schedule.at(self.names, step, tokens)
        for i, stream in enumerate(self.streams):
            if stream.retired or stream.exhausted:
                w[i] = 0.0
        return w

    def mean_lengths(self) -> np.ndarray:
        """Each source's mean document length in tokens over what it gave so far (0: none
        given yet)."""
        docs = np.asarray([s.docs for s in self.streams], dtype=np.float64)
        toks = np.asarray([s.tokens for s in self.streams], dtype=np.float64)
        return np.where(docs > 0, toks / np.maximum(docs, 1.0), 0.0)

    # -- the job as it will be ----------------------------------------------------------------
    def live_at(self, step: int) -> dict[str, SourceSpec]:
        """The sources taking part at ``step``, by name: those in the job now, with the source
        changes queued for steps up to ``step`` put in effect."""
        live = {s.spec.name: s.spec for s in self.streams if not s.retired}
        for at, kind, payload in self._pending:
            if at > step:
                break
            if kind == "add":
                live[payload[0].name] = payload[0]
            else:
                live.pop(payload, None)
        return live

    def declared_weight(self, name: str, step: int) -> float | None:
        """The weight that plan versions and live changes give ``name`` at ``step`` (the
        plan's mixing schedule aside); None for a source that was never in the job."""
        value = self.schedule.base.get(name)
        for at, kind, payload in self._pending:
            if at > step:
                break
            if kind == "add" and payload[0].name == name:
                value = payload[0].weight
        schedule = self.schedule
        for at, weights in schedule.changes:
            if at > step:
                break
            if at < schedule.reset_step <= step:
                continue
            if name in weights:
                value = weights[name]
        return value

    def plan_change(
        self, sources: Sequence[SourceSpec], at_step: int | None, next_step: int
    ) -> tuple[int, PlanChange]:
        """What a plan version with ``sources`` changes from ``at_step`` (default: the first
        undrawn step), compared with the plan due at that step; returns the step and the change.

        Sources keep their names (and cursors): one that changes its files, format, text or
        image field is refused.
        """
        step = future_step(at_step, next_step, "update_plan")
        live = self.live_at(step)
        for spec in sources:
            old = live.get(spec.name)
            if old is not None and (old.paths, old.format, old.text, old.image) != (
                spec.paths,
                spec.format,
                spec.text,
                spec.image,
            ):
                raise JobError(
                    f"update_plan: source {spec.name!r} changed its path, format, "
                    "text or image field; add it under a new name instead"
                )
        added = [s for s in sources if s.name not in live]
        names = {s.name for s in sources}
        weights = {}
        for spec in sources:
            declared = self.declared_weight(spec.name, step)
            # a source coming back would otherwise keep a weight an older change gave it
            if declared is not None and declared != spec.weight:
                weights[spec.name] = spec.weight
        return step, PlanChange(
            added=added, removed=[n for n in live if n not in names], weights=weights
        )

    def apply_change(
        self,
        change: PlanChange,
        catalogs: Sequence[Catalog],
        at_step: int | None,
        next_step: int,
        tokens: int,
    ) -> int:
        """Queue ``change`` (``catalogs``: of its added sources) from ``at_step`` (default:
        ``next_step``); returns the step it takes effect at."""
        step = future_step(at_step, next_step, "update_plan")
        for spec, catalog in zip(change.added, catalogs, strict=True):
            self.add_source(spec, catalog, step, next_step)
        for name in change.removed:
            self.remove_source(name, step, next_step)
        if change.weights:
            self.set_weights(change.weights, step, next_step, tokens)
        return step

    # -- changes -----------------------------------------------------------------------------
    def set_weights(
        self, weights: dict[str, float], at_step: int | None, next_step: int, tokens: int
    ) -> int:
        """Change source weights from ``at_step`` (default: ``next_step``, the first step not
        drawn yet); returns the step it takes effect at."""
        step = future_step(at_step, next_step, "set_weights")
        live = list(self.live_at(step))
        clean = (
            check_weights("weights", weights, live)
            if any(v > 0 for v in _finite_values(weights))
            else _zero_weights(weights, live)
        )
        trial = WeightSchedule(dict(self.schedule.base), self.schedule.spec)
        trial.changes = [*self.schedule.changes, (step, clean)]
        names = [*self.names, *(n for n in live if n not in self.names)]
        w = trial.at(names, step, tokens)
        exhausted = {s.spec.name for s in self.streams if s.exhausted}
        if not any(w[i] > 0 for i, n in enumerate(names) if n in live and n not in exhausted):
            raise JobError(
                f"set_weights: {clean} would leave no source with a weight > 0 at step {step}"
            )
        self.schedule.change(step, clean)
        self.record({"step": step, "kind": "weights", "weights": clean})
        return step

    def add_source(
        self,
        spec: SourceSpec,
        catalog: Catalog,
        at_step: int | None,
        next_step: int,
        *,
        ordered: bool = True,
    ) -> int:
        """Add (or bring back) a source from ``at_step`` on; returns that step.

        ``ordered=False`` (a resume with a new plan) lets it go before changes queued later.
        """
        step = future_step(at_step, next_step, "add_source")
        if ordered:
            self._in_order(step, "add_source")
        if spec.name in self.live_at(step):
            raise JobError(f"add_source: source {spec.name!r} is already in the job")
        old = next((s for s in self.streams if s.spec.name == spec.name), None)
        if old is not None and (old.spec.paths, old.spec.format) != (spec.paths, spec.format):
            raise JobError(
                f"add_source: source {spec.name!r} was in the job with other paths or "
                "format; add it under a new name"
            )
        self._schedule_change(step, "add", (spec, catalog))
        self.record(
            {
                "step": step,
                "kind": "add",
                "source": spec.name,
                "spec": source_dict(spec),
                "catalog": catalog_fingerprint(catalog),
            }
        )
        return step

    def remove_source(
        self, name: str, at_step: int | None, next_step: int, *, ordered: bool = True
    ) -> int:
        """Stop drawing from ``name`` from ``at_step`` on (its cursor is kept); returns it.

        ``ordered=False`` (a resume with a new plan) lets it go before changes queued later.
        """
        step = future_step(at_step, next_step, "remove_source")
        if ordered:
            self._in_order(step, "remove_source")
        live = list(self.live_at(step))
        if name not in live:
            raise JobError(
                f"remove_source: no source {name!r} in the job (sources: {', '.join(live)})"
            )
        if len(live) == 1:
            raise JobError(f"remove_source: {name!r} is the job's last source")
        self._schedule_change(step, "remove", name)
        self.record({"step": step, "kind": "remove", "source": name})
        return step

    def apply_next(self, step: int) -> Applied | None:
        """Put the next source change due at ``step`` into effect (None: none is due).

        Called until it returns None before ``step`` is drawn; one change at a time, so the
        caller's components follow each one (a failing change leaves the earlier ones in effect).
        """
        if not self._pending or self._pending[0][0] > step:
            return None
        _, kind, payload = self._pending.pop(0)
        self.applied += 1
        if kind == "add":
            spec, catalog = payload
            return Applied(joined=self._add_stream(spec, catalog))
        stream = self.streams[self.names.index(payload)]
        stream.retired = True
        dropped = list(stream.units.values())
        stream.units.clear()
        stream._cache = None
        stream.version += 1
        stream.next_submit = (stream.epoch, stream.position)
        return Applied(dropped=dropped)

    # -- resume ------------------------------------------------------------------------------
    def restore(self, schedule: dict[str, Any], log: list[dict[str, Any]], next_step: int) -> None:
        """Take a snapshot's schedule and log; changes logged for steps from ``next_step`` on
        (sources joining or leaving) are pending again."""
        self.schedule.load_state_dict(schedule)
        self.log = list(log)
        for entry in self.log:
            if entry["kind"] == "weights":
                self.schedule.change(int(entry["step"]), entry["weights"])
        self._pending = []
        for entry in self.log:
            if entry["kind"] in ("add", "remove") and entry["step"] >= next_step:
                if entry["kind"] == "add":
                    stream = self.streams[self.names.index(entry["source"])]
                    self._pending.append((entry["step"], "add", (stream.spec, stream.catalog)))
                else:
                    self._pending.append((entry["step"], "remove", entry["source"]))
        self._pending.sort(key=lambda p: p[0])

    def record(self, entry: dict[str, Any]) -> None:
        """Log a live change (a stage change, :mod:`.stages`, logs here too)."""
        self.log.append(entry)
        self._on_log(entry)

    # -- internals ---------------------------------------------------------------------------

    def _in_order(self, step: int, what: str) -> None:
        """Refuse a source change before one already queued for a later step."""
        later = [at for at, _, _ in self._pending if at > step]
        if later:
            raise JobError(
                f"{what}: a source change is already queued for step {min(later)}; queue "
                f"changes in step order (at step {min(later)} or later)"
            )

    def _schedule_change(self, step: int, kind: str, payload: Any) -> None:
        self._pending.append((step, kind, payload))
        self._pending.sort(key=lambda p: p[0])

    def _add_stream(self, spec: SourceSpec, catalog: Catalog) -> int | None:
        """Bring ``spec`` in; returns the index of a new stream (None: one came back)."""
        names = self.names
        joined = None
        if spec.name in names:  # coming back: keep its cursor
            stream = self.streams[names.index(spec.name)]
            stream.retired = False
            stream.spec = spec
        else:
            joined = len(self.streams)
            if joined >= MAX_SOURCES_PER_JOB:
                raise JobError("add_source: at most 1024 sources per job")
            self.streams.append(SourceStream(joined, spec, catalog, self._seed))
            self.caps.append(self._batch.document_cap_for(spec.name))
        self.schedule.add_source(spec.name, spec.weight)
        return joined


def adopt_plan(sources: LiveSources, plan: Plan, catalogs: Sequence[Catalog], step: int) -> None:
    """Resuming at ``step`` with a changed plan: its weights, schedule and sources rule
    from ``step`` on; ``catalogs`` are the sources', in order."""
    live = set(sources.live_at(step))
    by_name = {s.spec.name: c for s, c in zip(sources.streams, catalogs, strict=False)}
    sources.schedule = WeightSchedule({s.name: s.weight for s in plan.sources}, plan.mixing)
    sources.schedule.reset_at(step)
    for entry in sources.log:
        if entry["kind"] == "weights":
            sources.schedule.change(int(entry["step"]), entry["weights"])
    # (changes logged for later steps stay queued: they go after these)
    for spec in plan.sources:
        if spec.name not in live:
            sources.add_source(spec, by_name[spec.name], step, step, ordered=False)
    for name in sorted(live - set(plan.source_names)):
        sources.remove_source(name, step, step, ordered=False)


def future_step(at_step: int | None, next_step: int, what: str) -> int:
    """The step a change asked for ``at_step`` takes effect at: ``next_step`` is the first
    step a change may still reach (the first not built, :mod:`.rewind`)."""
    if at_step is None:
        return next_step
    if isinstance(at_step, bool) or not isinstance(at_step, int):
        raise JobError(f"{what}: at_step must be an integer, got {at_step!r}")
    if at_step < next_step:
        raise JobError(
            f"{what}: step {at_step} is already built (the first step a change can take "
            f"effect at is {next_step}); batches already built never change"
        )
    return at_step


def _finite_values(weights: dict[str, Any]) -> list[float]:
    return [
        float(v)
        for v in weights.values()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    ]


def _zero_weights(weights: dict[str, Any], names: list[str]) -> dict[str, float]:
    """Validate a change that only sets weights to 0 (allowed if others stay positive)."""
    if not weights:
        raise JobError("set_weights: give at least one source weight")
    out = {}
    for name, value in weights.items():
        if name not in names:
            raise JobError(f"weights.{name}: unknown source (sources: {', '.join(names)})")
        out[str(name)] = check_number(f"weights.{name}", value, min=0)
    return out


def token_shares(weights: np.ndarray, lengths: np.ndarray | None) -> np.ndarray:
    """Each source's expected share of a batch's tokens, for weights that count documents.

    ``lengths`` are the sources' mean document lengths in tokens (None, or any source with
    weight and no length > 0: not known yet, and the shares are the weights'). A source of
    0.1 of the documents and 30 times the mean length of the others holds most tokens::

        weights [0.6, 0.3, 0.1], lengths [240, 3900, 25000]  ->  [0.04, 0.32, 0.64]

    With the lengths' reciprocals (documents per token), weights that count tokens give each
    source's share of a batch's documents.
    """
    shares = weights / weights.sum()
    if lengths is None or (lengths[weights > 0] <= 0).any():
        return shares
    mean = float(np.dot(shares, lengths))
    return shares * lengths / mean if mean > 0 else shares

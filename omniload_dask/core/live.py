"""The job's sources as they change while it runs: weights, sources joining and leaving.

:class:`LiveSources` owns the source streams, their document caps, the weight schedule and the
log of live changes. A change is checked when it is asked for and takes effect at a step not
drawn yet (batches already drawn never change); every change is logged, so a replay or a
resume reproduces it::

    set_weights({"code": 2.0})            from the next undrawn step; the schedule answers it
    remove_source("web", at_step=50)      pending until step 50 is drawn: then web stops and
                                          its read units are released (its cursor is kept)
    add_source(spec, catalog, at_step=60) pending until step 60: a new stream, or the old one
                                          back with its cursor

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

__all__ = ["MAX_SOURCES_PER_JOB", "Applied", "LiveSources"]

MAX_SOURCES_PER_JOB = 1024  # the sample id has 10 bits for the source


@dataclass
class Applied:
    """What one source change did: the index of a stream new to the job, or the units in
    flight of a source that left (to forget and release)."""

    joined: int | None = None
    dropped: list[Unit] = field(default_factory=list)


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

    # -- changes -----------------------------------------------------------------------------
    def set_weights(
        self, weights: dict[str, float], at_step: int | None, next_step: int, tokens: int
    ) -> int:
        """Change source weights from ``at_step`` (default: ``next_step``, the first step not
        drawn yet); returns the step it takes effect at."""
        step = _future_step(at_step, next_step, "set_weights")
        live = [s.spec.name for s in self.streams if not s.retired]
        clean = (
            check_weights("weights", weights, live)
            if any(v > 0 for v in _finite_values(weights))
            else _zero_weights(weights, live)
        )
        trial = WeightSchedule(dict(self.schedule.base), self.schedule.spec)
        trial.changes = [*self.schedule.changes, (step, clean)]
        w = trial.at(self.names, step, tokens)
        usable = [not (s.retired or s.exhausted) for s in self.streams]
        if not any(w[i] > 0 for i in range(len(w)) if usable[i]):
            raise JobError(
                f"set_weights: {clean} would leave no source with a weight > 0 at step {step}"
            )
        self.schedule.change(step, clean)
        self._log({"step": step, "kind": "weights", "weights": clean})
        return step

    def add_source(
        self, spec: SourceSpec, catalog: Catalog, at_step: int | None, next_step: int
    ) -> int:
        """Add (or bring back) a source from ``at_step`` on; returns that step."""
        step = _future_step(at_step, next_step, "add_source")
        known = {s.spec.name: s for s in self.streams}
        old = known.get(spec.name)
        if old is not None and not old.retired:
            raise JobError(f"add_source: source {spec.name!r} is already in the job")
        if old is not None and (old.spec.paths, old.spec.format) != (spec.paths, spec.format):
            raise JobError(
                f"add_source: source {spec.name!r} was in the job with other paths or "
                "format; add it under a new name"
            )
        self._schedule_change(step, "add", (spec, catalog))
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

    def remove_source(self, name: str, at_step: int | None, next_step: int) -> int:
        """Stop drawing from ``name`` from ``at_step`` on (its cursor is kept); returns it."""
        step = _future_step(at_step, next_step, "remove_source")
        live = [s.spec.name for s in self.streams if not s.retired]
        if name not in live:
            raise JobError(
                f"remove_source: no source {name!r} in the job (sources: {', '.join(live)})"
            )
        if len(live) == 1:
            raise JobError(f"remove_source: {name!r} is the job's last source")
        self._schedule_change(step, "remove", name)
        self._log({"step": step, "kind": "remove", "source": name})
        return step

    def apply_next(self, step: int) -> Applied | None:
        """Put the next source change due at ``step`` into effect (None: none is due).

        Called until it returns None before ``step`` is drawn; one change at a time, so the
        caller's parts follow each one (a failing change leaves the earlier ones in effect).
        """
        if not self._pending or self._pending[0][0] > step:
            return None
        _, kind, payload = self._pending.pop(0)
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

    # -- internals ---------------------------------------------------------------------------
    def _log(self, entry: dict[str, Any]) -> None:
        self.log.append(entry)
        self._on_log(entry)

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


def _future_step(at_step: int | None, next_step: int, what: str) -> int:
    """The step a change asked for ``at_step`` takes effect at (it must not be drawn yet)."""
    if at_step is None:
        return next_step
    if isinstance(at_step, bool) or not isinstance(at_step, int):
        raise JobError(f"{what}: at_step must be an integer, got {at_step!r}")
    if at_step < next_step:
        raise JobError(
            f"{what}: step {at_step} is already drawn (the first step not yet "
            f"drawn is {next_step}); batches already drawn never change"
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

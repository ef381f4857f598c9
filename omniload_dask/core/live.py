"""Live changes to a running data plane: weights, sources joining and leaving.

A part of :class:`~omniload_dask.core.coordinator.Coordinator` (it inherits this class); kept
apart so that each file holds one concern. Pure: no I/O and no Dask.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from omniload_dask.batching.mixing import WeightSchedule
from omniload_dask.core.actions import Release
from omniload_dask.core.autoscale import Meter
from omniload_dask.core.base import PlaneBase
from omniload_dask.core.state import catalog_fingerprint
from omniload_dask.core.streams import SourceStream
from omniload_dask.errors import JobError
from omniload_dask.plan import SourceSpec, check_weights, source_dict
from omniload_dask.sources import Catalog


class LiveChanges(PlaneBase):
    """Methods of the coordinator; see its docstring for the state they use."""

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


def _finite_values(weights: dict[str, Any]) -> list[float]:
    return [
        float(v)
        for v in weights.values()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    ]


def _zero_weights(weights: dict[str, Any], names: list[str]) -> dict[str, float]:
    """Validate a change that only sets weights to 0 (allowed if others stay positive)."""
    from omniload_dask.plan.fields import check_number

    if not weights:
        raise JobError("set_weights: give at least one source weight")
    out = {}
    for name, value in weights.items():
        if name not in names:
            raise JobError(f"weights.{name}: unknown source (sources: {', '.join(names)})")
        out[str(name)] = check_number(f"weights.{name}", value, min=0)
    return out

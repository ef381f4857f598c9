"""Which read units the data plane submits, and how: windows, quotas, parts.

A part of :class:`~omniload_dask.core.coordinator.Coordinator` (it inherits this class); kept
apart so that each file holds one concern. Pure: no I/O and no Dask.
"""

from __future__ import annotations

import math

import numpy as np

from omniload_dask.core import autoscale
from omniload_dask.core.actions import ReadSpec, SubmitRead
from omniload_dask.core.base import PlaneBase
from omniload_dask.core.streams import Unit

MAX_UNITS_AHEAD = 256
IN_FLIGHT_STEPS = 2  # a source may always have this many steps' worth of units in flight


class ReadAhead(PlaneBase):
    """Methods of the coordinator; see its docstring for the state they use."""

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
            seen = (
                stream.version,  # a unit reported or the cursor moved (unit sizes known)
                weights[i],
                total,
                i in self._starved,
                len(stream.units),
                pending,  # a part of a unit reported (the quota has room)
                int(quota[i]) if quota is not None else -1,  # costs, weights or workers
            )
            if self._reads_seen.get(i) == seen:
                continue  # nothing changed for this source since the last look
            self._reads_seen[i] = seen
            per_unit = self._steps_per_unit(i, weights)
            steps_per_unit = per_unit or 0.0
            limit = -1
            if quota is not None:
                # Never fewer in flight than the units of IN_FLIGHT_STEPS steps: a source of
                # small units read one at a time would make every step wait for a round trip.
                cover = math.ceil(IN_FLIGHT_STEPS / steps_per_unit) if steps_per_unit else 1
                limit = max(int(quota[i]), cover)
            window = self._window_of(per_unit)
            # A draw waiting on this source gets its next unknown unit even past the window
            # and the quota.
            need = stream.first_unknown() if i in self._starved else (-1, -1)
            # The window counts units read ahead (memory); reads in flight up to the quota come
            # on top, so workers keep reading while trainers consume as fast as they can, and
            # stop once the window is full of read units.
            in_flight = limit if limit >= 0 else self.plan.loader.read_ahead
            while True:
                ref = stream.next_submit
                ahead = stream.submitted_ahead()
                if not stream.within_epochs(ref):
                    break
                if ahead >= MAX_UNITS_AHEAD or (ahead >= window + in_flight and ref > need):
                    break
                if (ahead - pending >= window or (limit >= 0 and pending >= limit)) and ref > need:
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
                # How soon the unit is needed, in steps: the units queued before it feed that
                # many. Workers run reads needed sooner first, whichever source they are of.
                lead = -1.0 if ref <= need else ahead * steps_per_unit
                for p in range(unit.parts):
                    self._actions.append(SubmitRead(self._read_spec(i, unit, p), lead))

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

    def _steps_per_unit(self, i: int, weights: np.ndarray) -> float | None:
        """Steps that one read unit of source i feeds at ``weights`` (None: none measured)."""
        stream = self.streams[i]
        known = [u for u in stream.units.values() if u.lengths is not None]
        if not known:
            return None
        tokens, docs = self._budget()
        share = weights[i] / weights.sum()
        if tokens is not None:
            sizes = [u.capped_tokens(self.caps[i]) for u in known]
            per_step = share * tokens
        else:
            sizes = [len(u.lengths) for u in known]  # type: ignore[arg-type]
            per_step = share * docs
        return max(1.0, float(np.mean(sizes))) / max(per_step, 1e-9)

    def _read_window(self, i: int, weights: np.ndarray) -> int:
        """Units to keep submitted for source i: enough for the steps drawn ahead."""
        return self._window_of(self._steps_per_unit(i, weights))

    def _window_of(self, steps_per_unit: float | None) -> int:
        """The read-ahead window of a source whose units feed ``steps_per_unit`` steps each."""
        loader = self.plan.loader
        if steps_per_unit is None:
            return loader.read_ahead
        steps_ahead = loader.lookahead + loader.prefetch
        return loader.read_ahead + math.ceil(steps_ahead / steps_per_unit)

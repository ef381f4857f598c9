"""Which read units the data plane submits, and how: windows, quotas, portions.

Each source keeps a window of units submitted ahead of its cursor: enough for the steps drawn
ahead (``loader.lookahead + loader.prefetch``), measured in how many steps one of its units
feeds. On top of the window, reads in flight are bounded per source by its quota of the
cluster's read slots (:func:`.autoscale.quotas`), and a unit that costs more than
``loader.task_seconds`` is read in portions (:func:`.autoscale.portion_count`)::

    source web: units feed 0.5 steps each, lookahead 2 + prefetch 2, read_ahead 2
    window = 2 + ceil(4 / 0.5) = 10 units ahead of the cursor; quota 3 in flight
    a draw waiting on web gets its next unknown unit at once, past the window and the quota

None of this changes the stream, only when and in how many tasks units are read. Pure: no
I/O and no Dask.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from omniload_dask.core import autoscale
from omniload_dask.core.actions import ReadSpec, SubmitRead
from omniload_dask.core.autoscale import Meter
from omniload_dask.core.events import ReadReported
from omniload_dask.core.keys import Keys
from omniload_dask.core.live import LiveSources, token_shares
from omniload_dask.core.rereads import FirstReports
from omniload_dask.core.streams import Unit, UnitRef
from omniload_dask.plan import READ_SLOTS_PER_THREAD, BatchSpec, Plan

__all__ = ["IN_FLIGHT_STEPS", "MAX_UNITS_AHEAD", "ReadAhead"]

MAX_UNITS_AHEAD = 256
IN_FLIGHT_STEPS = 2  # a source may always have this many steps' worth of units in flight


class ReadAhead:
    """The read tasks in flight, the cost meters, and the cluster's read capacity.

    It reads the streams and document caps of ``sources``, and adds units to their streams.
    """

    def __init__(self, sources: LiveSources, plan: Plan, keys: Keys) -> None:
        """Meters for ``sources``; the cluster's read slots from ``plan.loader`` (the embedded
        cluster's) until :meth:`on_workers` says otherwise."""
        self._sources = sources
        self._loader = plan.loader
        self._budget = _largest_budget(plan.batch)
        self._by_documents = plan.mixing_by == "documents"
        self._keys = keys
        self.workers = plan.loader.workers
        self.read_slots = (
            plan.loader.workers * plan.loader.threads_per_worker * READ_SLOTS_PER_THREAD
        )
        self.meters = [Meter() for _ in sources.streams]
        self.construct_meter = Meter()
        self._unit_of: dict[str, tuple[int, UnitRef]] = {}  # read key -> (source, unit)
        self._portion_of: dict[str, tuple[int, int]] = {}  # key -> (portion, its size)
        self._first = FirstReports()  # a read made again must give what it gave first
        self._last_portions: dict[int, int] = {}  # source -> its last unit's portions
        self._seen: dict[int, tuple[Any, ...]] = {}  # what the last look at a source saw
        self._quotas: tuple[tuple[bytes, int], np.ndarray] | None = None  # the last ones, by input

    def restage(self, batch: BatchSpec, version: int = 0) -> None:
        """Size read-ahead for ``batch``'s stages (a live stage change, :mod:`.stages`)."""
        self._budget = _largest_budget(batch)

    def add_source(self) -> None:
        """A stream joined the job: a meter for it."""
        self.meters.append(Meter())

    # -- events ------------------------------------------------------------------------------
    def on_report(self, r: ReadReported, extra: np.ndarray | None) -> str | None:
        """A read task reported its records' lengths (:class:`.events.ReadReported`; ``extra``:
        their cost beyond their tokens'). Returns why the job must stop where a later report
        of a read differs from its first (:mod:`.rereads`), else None."""
        where = self._unit_of.get(r.key)
        if where is None:
            return None
        portion, size = self._portion_of.get(r.key, (0, -1))
        stream = self._sources.streams[where[0]]
        changed = self._first.check(r.key, stream, where[1], portion, r.lengths, r.digest)
        if changed is not None:
            return changed
        reported = stream.report(
            where[1], r.lengths, r.skipped, portion, extra, r.filtered, r.holes
        )
        if reported and r.seconds is not None:
            if size < 0:
                size = stream.catalog.size(stream.units[where[1]].catalog_index)
            count = len(r.lengths) + r.skipped if r.records is None else r.records
            self.meters[where[0]].add(r.seconds, size, count, float(np.sum(r.lengths)))
        return None

    def on_construct(self, seconds: float, batches: int = 1) -> None:
        """A block construction finished after ``seconds`` of compute; it built ``batches``
        group batches (its DP groups times its steps)."""
        self.construct_meter.add(seconds, batches, batches, 0)

    def on_workers(self, workers: int, read_slots: int) -> None:
        """The cluster now has ``workers`` workers running ``read_slots`` reads at once in all
        (their ``omniload-read`` resources, else their threads)."""
        self.workers = max(0, int(workers))
        self.read_slots = max(0, int(read_slots))

    def forget(self, unit: Unit) -> None:
        """``unit`` is released: reports of its tasks are ignored from now on."""
        for key in unit.keys:
            self._unit_of.pop(key, None)
            self._portion_of.pop(key, None)
            self._first.forget(key)

    # -- decisions ---------------------------------------------------------------------------
    def read_spec(self, source: int, unit: Unit, portion: int = 0) -> ReadSpec:
        """What the read task of ``unit``'s portion ``portion`` reads (made once per unit:
        every step that draws from the unit names its reads)."""
        if len(unit.specs) != unit.portions:
            catalog = self._sources.streams[source].catalog
            specs = []
            for key, ((f, lo, hi), *rest) in zip(
                unit.keys, catalog.reads(unit.catalog_index, unit.portions), strict=True
            ):
                more = tuple((g, catalog.files[g], a, b) for g, a, b in rest)
                specs.append(ReadSpec(key, source, f, catalog.files[f], lo, hi, more, unit.epoch))
            unit.specs = tuple(specs)
        return unit.specs[portion]

    def submit(self, weights: np.ndarray, starved: set[int]) -> list[SubmitRead]:
        """Reads to submit now for sources with ``weights`` > 0 (the larger of the weights
        now and at the lookahead's end); ``starved`` sources hold up a draw."""
        out: list[SubmitRead] = []
        shares = self.budget_shares(weights)
        quota = self._quotas_at(shares) if self._loader.quotas else None
        total = float(weights.sum())
        for i, stream in enumerate(self._sources.streams):
            if weights[i] <= 0:
                continue
            pending = stream.pending_reads()
            seen = (
                stream.version,  # a unit reported or the cursor moved (unit sizes known)
                weights[i],
                total,
                round(float(shares[i]), 3),  # its share of the budget (mean lengths)
                i in starved,
                len(stream.units),
                pending,  # a portion of a unit reported (the quota has room)
                int(quota[i]) if quota is not None else -1,  # costs, weights or workers
            )
            if self._seen.get(i) == seen:
                continue  # nothing changed for this source since the last look
            self._seen[i] = seen
            per_unit = self._steps_per_unit(i, float(shares[i]))
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
            need = stream.first_unknown() if i in starved else (-1, -1)
            # The window counts units read ahead (memory); reads in flight up to the quota come
            # on top, so workers keep reading while trainers consume as fast as they can, and
            # stop once the window is full of read units.
            in_flight = limit if limit >= 0 else self._loader.read_ahead
            while True:
                ref = stream.next_submit
                ahead = stream.submitted_ahead()
                if not stream.within_epochs(ref):
                    break
                if (ahead >= MAX_UNITS_AHEAD or ahead >= window + in_flight) and ref > need:
                    break
                if (ahead - pending >= window or (limit >= 0 and pending >= limit)) and ref > need:
                    break
                catalog_index = stream.catalog_index(ref)
                unit = Unit(self._keys.read(i, ref), ref[0], ref[1], catalog_index)
                self._size_portions(i, unit)
                stream.units[ref] = unit
                stream.know_up_front(ref)
                for p, key in enumerate(unit.keys):
                    self._unit_of[key] = (i, ref)
                    if unit.portions > 1:
                        self._portion_of[key] = (p, unit.portion_sizes[p])
                stream.next_submit = stream.successor(ref)
                pending += unit.portions
                # How soon the unit is needed, in steps: the units queued before it feed that
                # many. Workers run reads needed sooner first, whichever source they are of.
                lead = -1.0 if ref <= need else ahead * steps_per_unit
                for p in range(unit.portions):
                    out.append(SubmitRead(self.read_spec(i, unit, p), lead))
        return out

    def _size_portions(self, source: int, unit: Unit) -> None:
        """Read ``unit`` in portions of about ``loader.task_seconds`` each (measured cost)."""
        catalog = self._sources.streams[source].catalog
        u = unit.catalog_index
        size = catalog.size(u)
        per_size, target = self.meters[source].per_size, self._loader.task_seconds
        portions = autoscale.portion_count(size, per_size, target, catalog.max_portions(u))
        self._last_portions[source] = portions
        if portions > 1:
            unit.portion_sizes = tuple(catalog.read_sizes(u, portions))
            unit.portions = len(unit.portion_sizes)

    # -- figures -----------------------------------------------------------------------------
    def read_work(self, weights: np.ndarray) -> np.ndarray:
        """Measured read seconds per step of each source at ``weights`` (NaN: not measured)."""
        return self._work_at(self.budget_shares(weights))

    def _work_at(self, shares: np.ndarray) -> np.ndarray:
        """:meth:`read_work` at the sources' shares of the budget (:meth:`budget_shares`)."""
        tokens, docs = self._budget
        out = np.full(len(self._sources.streams), np.nan)
        for i, meter in enumerate(self.meters):
            share = shares[i]
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
        return self._quotas_at(self.budget_shares(weights))

    def _quotas_at(self, shares: np.ndarray) -> np.ndarray:
        """:meth:`read_quotas` at the sources' shares of the budget (:meth:`budget_shares`)."""
        slots = max(1, self._loader.reads_per_slot * max(self.read_slots, 1))
        work = self._work_at(shares)
        key = (work.tobytes(), slots)  # asked a few times a step; changes with a read report
        if self._quotas is None or self._quotas[0] != key:
            self._quotas = (key, autoscale.quotas(work, slots))
        return self._quotas[1].copy()

    def work_per_step(self, weights: np.ndarray, groups: int) -> float | None:
        """Measured worker seconds one step costs at ``weights``: reads of every source and
        the constructions of ``groups`` DP groups (None until every source is measured)."""
        work = self.read_work(weights)
        if not np.isfinite(work).all():
            return None
        per_construct = self.construct_meter.per_record or 0.0
        return float(work.sum()) + per_construct * groups

    def window(self, i: int, share: float) -> int:
        """Units to keep submitted for source i at ``share`` of a step's budget
        (:meth:`budget_shares`): enough for the steps drawn ahead."""
        return self._window_of(self._steps_per_unit(i, share))

    def source_stats(self, weights: np.ndarray) -> list[dict[str, Any]]:
        """Per source: its cursor, counters and reads, as ``PlaneView.stats`` reports them."""
        shares = self.budget_shares(weights)  # once: per source, it was n^2 with n sources
        quotas = self._quotas_at(shares) if self._loader.quotas else None
        return [
            {
                "name": s.spec.name,
                "weight": float(weights[i]),
                "epoch": s.epoch,
                "epochs": s.spec.epochs,
                "exhausted": s.exhausted,
                "retired": s.retired,
                "documents": s.docs,
                "tokens": s.tokens,
                "skipped": s.skipped + s.skipped_ahead(),
                "filtered": s.filtered,
                "truncated_tokens": s.truncated_tokens,
                "units_in_flight": len(s.units),
                "reads_pending": sum(1 for u in s.units.values() if u.lengths is None),
                "read_window": self.window(i, float(shares[i])) if weights[i] > 0 else 0,
                "read_tasks_pending": s.pending_reads(),
                "quota": int(quotas[i]) if quotas is not None else None,
                "seconds_per_record": self.meters[i].per_record,
                "read_portions": self._last_portions.get(i, 1),
            }
            for i, s in enumerate(self._sources.streams)
        ]

    def budget_shares(self, weights: np.ndarray) -> np.ndarray:
        """Each source's share of a step's budget (tokens, or documents) at ``weights``.

        The weights count what ``mixing.by`` says; when that is not what the budget counts,
        the sources' mean document lengths convert one into the other: those of what each
        gave so far, else of what its reads reported. Read by weight alone, a source of 0.1
        of the documents that holds most of the tokens got the read slots and the window of
        a small one (one read in flight), and every draw waited for it.
        """
        total = weights.sum()
        if total <= 0:
            return np.zeros(len(weights))
        tokens = self._budget[0]
        if (tokens is not None) != self._by_documents:
            return weights / total  # the weights count what the budget counts
        lengths = self._sources.mean_lengths()
        for i, meter in enumerate(self.meters):
            if lengths[i] <= 0 and meter.records > 0:
                lengths[i] = meter.tokens / meter.records
        if tokens is None:  # shares of tokens into documents: a document per 1/length tokens
            lengths = np.divide(1.0, lengths, out=np.zeros_like(lengths), where=lengths > 0)
        return token_shares(weights, lengths)

    def _steps_per_unit(self, i: int, share: float) -> float | None:
        """Steps that one read unit of source i feeds at ``share`` of a step's budget (None:
        none measured)."""
        stream = self._sources.streams[i]
        # Units without records (a file's empty tail) say nothing about unit size; counted,
        # they would make a unit seem to feed no steps and the read-ahead run to its cap.
        known = [u for u in stream.units.values() if u.lengths is not None and len(u.lengths)]
        if not known:
            return None
        tokens, docs = self._budget
        if tokens is not None:
            sizes = [u.capped_tokens(self._sources.caps[i]) for u in known]
            per_step = share * tokens
        else:
            sizes = [len(u.lengths) for u in known]  # type: ignore[arg-type]
            per_step = share * (docs or 0)  # a plan sets one of the two budgets
        return max(1.0, float(np.mean(sizes))) / max(per_step, 1e-9)

    def _window_of(self, steps_per_unit: float | None) -> int:
        """The read-ahead window of a source whose units feed ``steps_per_unit`` steps each."""
        loader = self._loader
        if steps_per_unit is None:
            return loader.read_ahead
        steps_ahead = loader.lookahead + loader.prefetch
        return loader.read_ahead + math.ceil(steps_ahead / steps_per_unit)


def _largest_budget(batch: BatchSpec) -> tuple[int | None, int | None]:
    """The largest step budget of ``batch`` and its stages, of the plan's kind (tokens or
    documents): read-ahead sized for it covers every stage (more never changes the stream)."""
    if batch.global_tokens is not None:
        return max(b.global_tokens or 0 for b in batch.every_stage), None
    return None, max(b.global_documents or 0 for b in batch.every_stage)

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

:class:`Coordinator` is the facade over parts that each own one concern and get what they need
passed in: the sources and their live changes (:mod:`.live`), the draw (:mod:`.draw`), the
split into recipes (:mod:`.planning`), which batch each rank gets (:mod:`.delivery`), read-ahead
(:mod:`.reads`) and figures (:mod:`.figures`). Its state as plain data for checkpoints is
:mod:`.state`, its actions are in :mod:`.actions` and task keys in :mod:`.keys`.

Read units are submitted ahead of need (a window per source that covers the steps drawn ahead),
and released as soon as the cursor has passed them and their constructions are submitted. How
they are read is sized from measured costs (:mod:`.autoscale`): a costly unit is read in parts,
and each source keeps at most its quota of reads in flight; neither changes the stream.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from omniload_dask.batching.mixing import WeightSchedule
from omniload_dask.core.actions import Action, ReadSpec, Release, SubmitConstruct, SubmitRead
from omniload_dask.core.delivery import Delivery, RankState, StepRecord
from omniload_dask.core.draw import Documents, Drawer
from omniload_dask.core.figures import Figures, StepFigures
from omniload_dask.core.keys import Keys
from omniload_dask.core.live import LiveSources
from omniload_dask.core.planning import StepPlanner
from omniload_dask.core.reads import ReadAhead
from omniload_dask.core.state import StateRecorder, restore, snapshot
from omniload_dask.core.streams import SourceStream
from omniload_dask.errors import JobError
from omniload_dask.plan import Plan, SourceSpec
from omniload_dask.sources import Catalog

__all__ = ["Coordinator", "ReadSpec", "Release", "StepFigures", "SubmitConstruct", "SubmitRead"]


class Coordinator:
    """Single source of truth for cursors, the mix, and which batch each rank gets.

    Its parts are attributes, for tests and tools that look inside (``sources``, ``drawer``,
    ``planner``, ``delivery``, ``reads``, ``figures``, ``recorder``); the properties are the
    state that the adapter and the checkpoint code read through the facade.
    """

    def __init__(
        self, plan: Plan, catalogs: Sequence[Catalog], run_id: str, start_step: int = 0
    ) -> None:
        """A fresh data plane at step 0; ranks start at ``start_step`` (steps below it are
        drawn to keep the stream exact, but not built)."""
        self.plan = plan
        self.run_id = run_id
        self.layout = plan.layout
        self.keys = Keys(run_id, plan.layout.cp)
        self.sources = LiveSources(plan, catalogs, on_log=self._logged)
        self.planner = StepPlanner(plan)
        self.drawer = Drawer(self.sources, plan, with_extra=self.planner.cost.has_encoder)
        self.reads = ReadAhead(self.sources, plan, self.keys)
        self.delivery = Delivery(plan, self.keys, start_step)
        self.figures = Figures(plan.layout.dp, self.planner.declared_micro_steps)
        self.recorder = StateRecorder(self.sources, self.drawer, self.figures)
        self.end_step: int | None = None  # the stream ends here (every source exhausted)
        self.next_step = 0
        self.error: str | None = None
        self._actions: list[Action] = []

    # -- the parts' state, as other code reads it ----------------------------------------------
    @property
    def streams(self) -> list[SourceStream]:
        """Every source's stream, by source index."""
        return self.sources.streams

    @property
    def names(self) -> list[str]:
        """Source names by index (sources that left keep their index)."""
        return self.sources.names

    @property
    def log(self) -> list[dict[str, Any]]:
        """Every live change so far (weights, sources joining and leaving)."""
        return self.sources.log

    @property
    def schedule(self) -> WeightSchedule:
        """The weight schedule (plan weights, schedule, live changes)."""
        return self.sources.schedule

    @schedule.setter
    def schedule(self, schedule: WeightSchedule) -> None:
        """Replace the schedule (a resume with a new plan does)."""
        self.sources.schedule = schedule

    @property
    def ranks(self) -> dict[int, RankState]:
        """Each trainer rank's position and request."""
        return self.delivery.ranks

    @property
    def history(self) -> deque[StepFigures]:
        """The figures of the last steps drawn."""
        return self.figures.history

    def weights_at(self, step: int) -> np.ndarray:
        """Target weights at ``step``; 0 for sources exhausted or removed."""
        return self.sources.weights_at(step, self.figures.tokens)

    # -- live changes ------------------------------------------------------------------------
    def set_weights(self, weights: dict[str, float], at_step: int | None = None) -> int:
        """Change source weights from ``at_step`` (default: the first step not yet drawn).

        Batches already drawn never change; the change is logged so a replay reproduces it.
        Returns the step it takes effect at.
        """
        return self.sources.set_weights(weights, at_step, self.next_step, self.figures.tokens)

    def add_source(self, spec: SourceSpec, catalog: Catalog, at_step: int | None = None) -> int:
        """Add (or bring back) a source from ``at_step`` on; returns that step."""
        return self.sources.add_source(spec, catalog, at_step, self.next_step)

    def remove_source(self, name: str, at_step: int | None = None) -> int:
        """Stop drawing from ``name`` from ``at_step`` on (its cursor is kept); returns it."""
        return self.sources.remove_source(name, at_step, self.next_step)

    # -- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The full data-plane state at the first undrawn step (plain data; see :mod:`.state`)."""
        return snapshot(self.next_step, self.end_step, self.sources, self.drawer, self.figures)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from a snapshot: this coordinator's sources must be the snapshot's, in order.

        Changes logged for later steps (sources joining or leaving) are scheduled again.
        """
        self.next_step, self.end_step = restore(state, self.sources, self.drawer, self.figures)
        self.delivery.restart_at(self.next_step)
        self.recorder = StateRecorder(self.sources, self.drawer, self.figures)

    def take_deltas(self) -> list[dict[str, Any]]:
        """Deltas of the steps drawn (and changes logged) since the last call."""
        return self.recorder.take()

    # -- events ------------------------------------------------------------------------------
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
        extra = None
        if patches is not None and self.planner.cost.has_encoder:
            sq = patches_sq if patches_sq is not None else np.zeros(len(patches))
            extra = self.planner.cost.encoder_of(patches, sq)
        self.reads.on_report(key, lengths, skipped, extra, seconds, records)

    def on_construct(self, seconds: float) -> None:
        """A batch construction finished after ``seconds`` of compute (for recommendations)."""
        self.reads.on_construct(seconds)

    def on_workers(self, workers: int, threads: int) -> None:
        """The cluster now has ``workers`` workers with ``threads`` threads in all."""
        self.reads.on_workers(workers, threads)

    def on_failure(self, key: str, message: str) -> None:
        """A task failed for good (after retries): the job stops with that message."""
        if self.error is None and key.startswith("omniload-"):
            self.error = message

    def on_request(self, rank: int, start: int, count: int, now: float = 0.0) -> None:
        """Rank ``rank`` has fetched every step below ``start`` and asks for ``count`` more."""
        self._actions += self.delivery.request(rank, start, count, now)

    # -- decisions ---------------------------------------------------------------------------
    def advance(self, max_steps: int | None = None) -> list[Action]:
        """Draw what can be drawn (at most ``max_steps``), keep reads ahead, return actions."""
        if self.error is None:
            try:
                drawn = 0
                while (
                    (max_steps is None or drawn < max_steps)
                    and self.next_step < self.delivery.draw_target()
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
        key, rebuild = self.delivery.batch_for(rank, step, self.next_step)
        if rebuild is not None:
            self._actions.append(rebuild)
        return key

    # -- figures -----------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters for feeders, the report and monitoring (plain data)."""
        weights = self.weights_at(self.next_step)
        return {
            "next_step": self.next_step,
            "end_step": self.end_step,
            "log": list(self.log),
            "error": self.error,
            **self.figures.summary(),
            "held_batches": len(self.delivery.held),
            "units_in_flight": sum(len(s.units) for s in self.streams),
            "ranks": self.delivery.positions(),
            "sources": self.reads.source_stats(weights),
            "worker_threads": self.reads.threads,
            "work_per_step": self.work_per_step(),
        }

    def step_figures(self, start: int = 0) -> list[StepFigures]:
        """The kept figures of steps from ``start`` on."""
        return self.figures.step_figures(start)

    def mixture(self, window: int = 100) -> list[dict[str, Any]]:
        """Per source: target and realised share, over the last ``window`` steps and overall.

        Shares are of tokens or of documents, as the plan's ``mixing.by`` says; the target of a
        window is the mean of its steps' normalised target weights.
        """
        now = self.weights_at(self.next_step)
        return self.figures.mixture(window, self.streams, now, self.plan.mixing_by == "tokens")

    def work_per_step(self) -> float | None:
        """Measured worker seconds one step costs (reads of every source and constructions)."""
        return self.reads.work_per_step(self.weights_at(self.next_step), self.layout.dp)

    # -- internals ---------------------------------------------------------------------------
    def _logged(self, entry: dict[str, Any]) -> None:
        self.recorder.log(entry)

    def _apply_changes(self, step: int) -> None:
        """Put the source changes due at ``step`` into effect, in every part."""
        while (applied := self.sources.apply_next(step)) is not None:
            if applied.joined is not None:
                self.drawer.add_source()
                self.reads.add_source()
            for unit in applied.dropped:
                self.reads.forget(unit)
            if applied.dropped:
                self._actions.append(Release(tuple(k for u in applied.dropped for k in u.keys)))

    def _submit_reads(self) -> None:
        # Read ahead for sources that take part now or within the lookahead (schedules).
        horizon = self.next_step + self.plan.loader.lookahead
        weights = np.maximum(self.weights_at(self.next_step), self.weights_at(horizon))
        self._actions += self.reads.submit(weights, self.drawer.starved)

    def _draw(self) -> bool:
        """Draw global batch ``next_step``; False if some source must report first."""
        started = time.perf_counter()
        self._apply_changes(self.next_step)
        weights = self.weights_at(self.next_step)
        if not (weights > 0).any():
            self.end_step = self.next_step  # nothing left to draw from: the stream ends
            return False
        docs = self.drawer.draw(self.next_step, weights)
        if docs is None:
            return False
        if len(docs.sources) == 0:  # every source with weight ran out during this step
            self.end_step = self.next_step
            return False
        self._commit(docs)
        self.recorder.after_step(self.next_step - 1, self.end_step)
        self.figures.planned((time.perf_counter() - started) * 1e3)
        return True

    def _commit(self, docs: Documents) -> None:
        """Split drawn step ``next_step`` into recipes, submit its constructions, move on."""
        step = self.next_step
        t0 = time.perf_counter()
        split = self.planner.split(docs.sources, docs.lengths, docs.extra)
        t1 = time.perf_counter()
        specs = [
            self.reads.read_spec(s, *u) for s, u in zip(docs.slot_source, docs.slots, strict=True)
        ]
        recipes, reads = self.planner.recipes(step, split, docs, specs)
        self.figures.timing.update(
            split_ms=(t1 - t0) * 1e3, recipes_ms=(time.perf_counter() - t1) * 1e3
        )
        self._actions += self.delivery.offer(step, recipes, reads)
        n = len(self.streams)
        source_tokens = np.bincount(docs.sources, weights=docs.lengths, minlength=n)
        record = StepRecord(recipes, reads, split.group_costs, split.group_tokens, source_tokens)
        self.figures.record(
            step,
            split,
            docs.lengths,
            source_tokens,
            docs.sources,
            self.drawer.weights,
            first=docs.first_pieces,
        )
        if docs.finished:
            self._actions.append(Release(tuple(k for u in docs.finished for k in u.keys)))
            for u in docs.finished:
                self.reads.forget(u)
        self.next_step += 1
        self.delivery.keep(step, record, self.next_step)

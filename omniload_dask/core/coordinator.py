"""The data plane as a pure state machine: events in, actions out, no I/O and no Dask.

The scheduler plugin feeds it events (a read unit reported its sample lengths, a rank asked for
steps, a task failed) and carries out the actions it returns (submit a read, submit a
construction, release keys). Everything that decides *which* samples form global batch t lives
here and depends only on the plan, the seed, t and the reported lengths, never on timing::

    ranks ask for steps  ->  draw step t when every source's next documents are known
                             (mixing.Mixer picks them)                    draw_step
                         ->  split it among the DP groups by cost and     plan_step (pure:
                             write each group's recipe                     may run off the
                                                                           adapter's loop)
                         ->  one SubmitConstruct per block of DP groups   commit_step
                             (with context parallelism each group's cp
                             slices); blocks released once every rank of
                             their groups has fetched the step

Tensor- and pipeline-parallel ranks of a group fetch the same part of a block; context-parallel
rank c fetches slice c, so no rank loads what a peer already loaded.

:class:`Coordinator` is the facade over parts that each own one concern and get what they need
passed in: the sources and their live changes (:mod:`.live`), the draw (:mod:`.draw`), the
split into recipes (:mod:`.planning`), which batch each rank gets (:mod:`.delivery`), read-ahead
(:mod:`.reads`) and figures (:mod:`.figures`). Its state as plain data for checkpoints is
:mod:`.state`, its actions are in :mod:`.actions` and task keys in :mod:`.keys`.

:meth:`Coordinator.advance` runs the three phases of each step inline. An adapter that must not
block (the scheduler plugin) calls them one by one and runs :meth:`Coordinator.plan_step`, the
costly one, in a thread: between a draw and its commit the step is *in flight* (``busy``);
the draw has moved the cursors and ``next_step``, so live changes take effect after it.

Read units are submitted ahead of need (a window per source that covers the steps drawn ahead),
and released as soon as the cursor has passed them and their constructions are submitted. How
they are read is sized from measured costs (:mod:`.autoscale`): a costly unit is read in parts,
and each source keeps at most its quota of reads in flight; neither changes the stream.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from omniload_dask.batching.mixing import WeightSchedule
from omniload_dask.core.actions import Action, ReadSpec, Release, SubmitConstruct, SubmitRead
from omniload_dask.core.delivery import Delivery, Part
from omniload_dask.core.draw import Drawer
from omniload_dask.core.figures import Figures, StepFigures
from omniload_dask.core.keys import Keys
from omniload_dask.core.live import LiveSources
from omniload_dask.core.planning import DrawnStep, PlannedStep, StepPlanner
from omniload_dask.core.reads import ReadAhead
from omniload_dask.core.state import StateRecorder, restore, snapshot
from omniload_dask.core.stepping import StepCycle
from omniload_dask.core.streams import SourceStream
from omniload_dask.errors import JobError
from omniload_dask.plan import Plan, SourceSpec
from omniload_dask.sources import Catalog

__all__ = [
    "Coordinator",
    "DrawnStep",
    "PlannedStep",
    "ReadSpec",
    "Release",
    "StepFigures",
    "SubmitConstruct",
    "SubmitRead",
    "draw_steps",
    "next_batch",
]


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
        self._drawn_deltas: dict[int, dict[str, Any]] = {}  # steps in flight: their draws'
        self.cycle = StepCycle(
            self.sources, self.drawer, self.planner, self.reads, self.delivery, self.figures
        )
        self.error: str | None = None
        self.recording = True  # per-step deltas for a checkpoint (off: none pile up)
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
    def next_step(self) -> int:
        """The first step not drawn."""
        return self.cycle.next_step

    @property
    def end_step(self) -> int | None:
        """The stream ends before this step (every source exhausted), once known."""
        return self.cycle.end_step

    @property
    def planned_step(self) -> int:
        """The first step not planned (committed, and its block built): ranks can fetch the
        steps below it."""
        first = self.delivery.offered_step
        planned = self.cycle.planned_step
        return planned if first is None else min(planned, first)

    @property
    def busy(self) -> bool:
        """A step is drawn but not committed: the state is between two steps (no snapshot)."""
        return bool(self.cycle.in_flight)

    @property
    def history(self) -> deque[StepFigures]:
        """The figures of the last steps drawn."""
        return self.figures.history

    def weights_at(self, step: int) -> np.ndarray:
        """Target weights at ``step``; 0 for sources exhausted or removed."""
        return self.sources.weights_at(step, self.cycle.drawn_tokens)

    # -- live changes ------------------------------------------------------------------------
    def set_weights(self, weights: dict[str, float], at_step: int | None = None) -> int:
        """Change source weights from ``at_step`` (default: the first step not yet drawn).

        Batches already drawn never change; the change is logged so a replay reproduces it.
        Returns the step it takes effect at.
        """
        return self.sources.set_weights(weights, at_step, self.next_step, self.cycle.drawn_tokens)

    def add_source(self, spec: SourceSpec, catalog: Catalog, at_step: int | None = None) -> int:
        """Add (or bring back) a source from ``at_step`` on; returns that step."""
        return self.sources.add_source(spec, catalog, at_step, self.next_step)

    def remove_source(self, name: str, at_step: int | None = None) -> int:
        """Stop drawing from ``name`` from ``at_step`` on (its cursor is kept); returns it."""
        return self.sources.remove_source(name, at_step, self.next_step)

    # -- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The full data-plane state at the first undrawn step (plain data; see :mod:`.state`).

        Not while a step is in flight (``busy``): its figures are not counted yet.
        """
        if self.busy:
            raise JobError("internal error: state_dict() while a step is being planned")
        return snapshot(self.next_step, self.end_step, self.sources, self.drawer, self.figures)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from a snapshot: this coordinator's sources must be the snapshot's, in order.

        Changes logged for later steps (sources joining or leaving) are scheduled again.
        """
        step, end = restore(state, self.sources, self.drawer, self.figures)
        self.cycle.next_step, self.cycle.end_step = step, end
        self.delivery.restart_at(step)
        self.recorder = StateRecorder(self.sources, self.drawer, self.figures)
        self._drawn_deltas = {}

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
        filtered: int = 0,
    ) -> None:
        """A read task finished: its records' token counts (file order) and skipped count.

        Image sources also report each record's patches (sum and sum of squares over its
        images) for the encoder cost; ``seconds`` (compute time) and ``records`` (read, bad
        ones included) feed the cost meters that size reads, never the stream.
        """
        extra = None
        if patches is not None and self.planner.cost.has_encoder:
            sq = patches_sq if patches_sq is not None else np.zeros(len(patches))
            extra = self.planner.cost.encoder_of(patches, sq)
        self.reads.on_report(key, lengths, skipped, extra, seconds, records, filtered)

    def on_construct(self, seconds: float, batches: int = 1) -> None:
        """A block construction of ``batches`` group batches finished after ``seconds`` of
        compute (for recommendations)."""
        self.reads.on_construct(seconds, batches)

    def on_workers(self, workers: int, threads: int) -> None:
        """The cluster now has ``workers`` workers with ``threads`` threads in all."""
        self.reads.on_workers(workers, threads)

    def on_failure(self, key: str, message: str) -> None:
        """A task failed for good (after retries): the job stops with that message."""
        if self.error is None and key.startswith("omniload-"):
            self.error = message

    def on_request(
        self, rank: int | Sequence[int], start: int, count: int, now: float = 0.0
    ) -> None:
        """Rank ``rank`` (or each of the ranks one fetching agent serves) has fetched every
        step below ``start`` and asks for ``count`` more."""
        self._actions += self.delivery.request(rank, start, count, now)

    # -- decisions ---------------------------------------------------------------------------
    def advance(self, max_steps: int | None = None, together: int = 1) -> list[Action]:
        """Draw, plan and commit what can be drawn (at most ``max_steps``), keep reads ahead,
        return actions. Up to ``together`` steps are drawn, then planned side by side and
        committed, as the scheduler plugin's planning thread does: the same stream."""
        _advance(self, max_steps, max(1, together))
        return self.take_actions()

    def draw_step(self) -> DrawnStep | None:
        """Draw the next step if the ranks want it and its documents are known, else None.

        Its cursors move now (and ``next_step``); :meth:`plan_step` and :meth:`commit_step`
        follow, in step order; up to ``cycle.max_in_flight`` steps may be in flight.
        """
        if self.error is not None or len(self.cycle.in_flight) >= self.cycle.max_in_flight:
            return None
        if self.next_step >= self.delivery.draw_target(self.next_step):
            return None
        try:
            drawn, actions = self.cycle.draw()
        except JobError as exc:
            self.error = str(exc)
            return None
        self._actions += actions
        if drawn is not None and self.recording:
            self._drawn_deltas[drawn.step] = self.recorder.drawn(drawn.step)
        return drawn

    def plan_step(self, drawn: DrawnStep) -> PlannedStep | None:
        """Split a drawn step among the DP groups and write the recipes (None on a job error).
        Pure: reads only ``drawn`` and the plan, so it may run in another thread."""
        planned = self.plan_steps([drawn])
        return None if planned is None else planned[0]

    def plan_steps(self, drawn: Sequence[DrawnStep]) -> list[PlannedStep] | None:
        """:meth:`plan_step` of drawn steps (in order) at once, side by side where the
        balancer can (:meth:`.StepPlanner.plan_steps`: the same planned steps)."""
        try:
            return self.planner.plan_steps(drawn)
        except JobError as exc:
            self.error = self.error or str(exc)
            return None

    def commit_step(self, planned: PlannedStep) -> None:
        """Submit a planned step's constructions, count it, and let ranks fetch it."""
        self._actions += self.cycle.commit(planned)
        delta = self._drawn_deltas.pop(planned.drawn.step, None)
        if self.recording:  # (no delta: recording began after its draw)
            self.recorder.committed(delta or self.recorder.drawn(planned.drawn.step), self.end_step)

    def take_actions(self) -> list[Action]:
        """Keep reads ahead, then hand over every action queued since the last call."""
        if self.error is None:
            try:
                self._submit_reads()
            except JobError as exc:
                self.error = str(exc)
        actions, self._actions = self._actions, []
        return actions

    def has_actions(self) -> bool:
        """Whether actions wait for the next :meth:`advance` (e.g. a rebuild just queued)."""
        return bool(self._actions)

    def batch_for(self, rank: int, step: int) -> Part | None:
        """What ``rank`` fetches for ``step`` once planned, ``(block key, part)``, else None
        (a released step is rebuilt): its DP group's batch, or its cp rank's slice of it."""
        group, cp = self.delivery.coords(rank)
        return self.part_for(group, cp, step)

    def part_for(self, group: int, cp: int, step: int) -> Part | None:
        """What DP group ``group``'s cp rank ``cp`` fetches for ``step``, as :meth:`batch_for`."""
        part, rebuild = self.delivery.part_for(group, cp, step, self.planned_step)
        if rebuild is not None:
            self._actions.append(rebuild)
        return part

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
            "held_back": self.delivery.held_back(),
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

    def _submit_reads(self) -> None:
        # Read ahead for sources that take part now or within the lookahead (schedules).
        horizon = self.next_step + self.plan.loader.lookahead
        weights = np.maximum(self.weights_at(self.next_step), self.weights_at(horizon))
        self._actions += self.reads.submit(weights, self.drawer.starved)


def draw_steps(coord: Coordinator, most: int) -> list[DrawnStep]:
    """Draw up to ``most`` steps more, in flight together (:meth:`Coordinator.draw_step`
    each, until one cannot be drawn); they are to be planned and committed in order."""
    batch: list[DrawnStep] = []
    coord.cycle.max_in_flight = len(coord.cycle.in_flight) + most
    coord.cycle.waits_for_reads = False  # (the last draw sets it, if it finds nothing)
    try:
        while len(batch) < most and (step := coord.draw_step()) is not None:
            batch.append(step)
    finally:
        coord.cycle.max_in_flight = 1
    return batch


def next_batch(
    coord: Coordinator, drawn: list[DrawnStep], most: int, hold: bool = True
) -> tuple[list[DrawnStep], list[DrawnStep]]:
    """Draw on after ``drawn`` (steps drawn and not planned yet, in order, at least one) and
    split them: the steps to plan together now (none: wait), and those that wait.

    A batch holds up to ``most`` steps. Where a construction builds several steps (a block),
    it ends at a block's end, and while the draw waits for a read, the whole blocks drawn go
    and the steps of a block drawn in part wait for the rest of it: none of them is
    fetchable before the block's last step is drawn, and a block's steps planned together
    cost less than in two or three batches (BENCHMARKS.md, session 32). With ``hold`` False
    (a checkpoint snapshot waits for the steps in flight) every step drawn goes."""
    delivery = coord.delivery
    first = drawn[0].step
    end = delivery.batch_end(first, most)
    drawn = drawn + draw_steps(coord, end - first - len(drawn))
    if len(drawn) == end - first or not (hold and coord.cycle.waits_for_reads) or coord.error:
        return drawn, []
    ends = [i + 1 for i, d in enumerate(drawn) if d.step + 1 == delivery.block_end(d.step)]
    take = ends[-1] if ends else 0
    return drawn[:take], drawn[take:]


def _advance(coord: Coordinator, max_steps: int | None, together: int) -> None:
    """:meth:`Coordinator.advance`'s steps: batches of up to ``together`` drawn steps."""
    drawn = 0
    while max_steps is None or drawn < max_steps:
        batch = draw_steps(
            coord, together if max_steps is None else min(together, max_steps - drawn)
        )
        if not batch:
            return
        # (one step through plan_step: what benchmarks/planning.py times)
        planned = [coord.plan_step(batch[0])] if len(batch) == 1 else coord.plan_steps(batch)
        for one in planned or []:
            if one is not None:
                coord.commit_step(one)
        drawn += len(batch)
        if planned is None or None in planned:
            return  # a job error: the steps stay in flight, as a failed plan leaves them

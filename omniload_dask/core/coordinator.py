"""The data plane as a pure state machine: events in, actions out, no I/O and no Dask.

The scheduler plugin feeds it events (a read unit reported its sample lengths, a rank asked for
steps, a task failed) and carries out the actions it returns (submit a read, submit a
construction, release keys). Everything that decides *which* samples form global batch t lives
here and depends only on the plan, the seed, t and the reported lengths, never on timing::

    ranks ask for steps  ->  draw step t when every source's next documents are known
                             (mixing.Mixer picks them)                    draw_step
                         ->  split it among the DP groups by cost and     deal_steps (pure:
                             write each group's recipe                     may run off the
                                                                           adapter's loop)
                         ->  one SubmitConstruct per block of DP groups   commit_step
                             (with context parallelism each group's cp
                             slices); blocks released once every rank of
                             their groups has fetched the step

Tensor- and pipeline-parallel ranks of a group fetch the same part of a block; context-parallel
rank c fetches slice c, so no rank loads what a peer already loaded.

:class:`Coordinator` is the one way into the data plane. What may change it, all here::

    handle(event) -> actions       a read reported, a construction done, workers changed,
                                   ranks asked for steps, a task or the job failed (:mod:`.events`)
    set_weights / add_source /     live changes, checked against the stream; each answers the
    remove_source / apply_change / step it takes effect at (a weight change also the weights
    apply_stages / adopt_plan      as checked: :class:`.events.Scheduled`): by default the
                                   first step not built; steps drawn and not built are drawn
                                   again (:mod:`.rewind`); stages: :mod:`.stages`
    draw_step / draw_together /    the step cycle, phase by phase (below), or all of it inline
    deal_steps / commit_step /
    advance
    part_for / batch_for           what a rank fetches (a released step is queued for a rebuild)
    take_actions                   the actions queued by the cycle, reads kept ahead
    state_dict / load_state_dict / checkpoints (:mod:`.state`)
    take_deltas / stop_recording

Everything else reads: :attr:`Coordinator.view` (:class:`.views.PlaneView`) for where the cycle
is, figures and stats. The components behind it each own one concern and get what they need passed
in: the sources and their live changes (:mod:`.live`), the draw (:mod:`.draw`), the split into
recipes (:mod:`.dealer`), which batch each rank gets (:mod:`.delivery`), read-ahead
(:mod:`.reads`) and figures (:mod:`.figures`); :attr:`Coordinator.components` shows them to tests and
tools that look inside, never to the package's modules outside ``core``. Its actions are in
:mod:`.actions` and task keys in :mod:`.keys`.

:meth:`Coordinator.advance` runs the three phases of each step inline. An adapter that must not
block (the scheduler plugin) calls them one by one and runs :meth:`Coordinator.deal_steps`, the
costly one, in a thread: between a draw and its commit the step is *in flight* (``busy``);
the draw has moved the cursors and ``next_step``, so live changes take effect after it.
The job's failure (:class:`.events.Failure`) is state: the first one stays, and no step is
drawn after it.

Read units are submitted ahead of need (a window per source that covers the steps drawn ahead),
and released as soon as the cursor has passed them and their constructions are submitted. How
they are read is sized from measured costs (:mod:`.autoscale`): a costly unit is read in portions,
and each source keeps at most its quota of reads in flight; neither changes the stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from omniload_dask.core.actions import Action, ReadSpec, Release, SubmitConstruct, SubmitRead
from omniload_dask.core.dealer import DealtStep, DrawnStep, StepDealer
from omniload_dask.core.delivery import Delivery, Part
from omniload_dask.core.draw import Drawer
from omniload_dask.core.events import (
    Cause,
    ConstructionDone,
    Event,
    Failure,
    JobFailed,
    ReadReported,
    Scheduled,
    StepsRequested,
    TaskFailed,
    WorkersChanged,
)
from omniload_dask.core.figures import Figures, StepFigures
from omniload_dask.core.keys import Keys, is_data_key
from omniload_dask.core.live import LiveSources, PlanChange, adopt_plan
from omniload_dask.core.reads import ReadAhead
from omniload_dask.core.rewind import Rewinds, redraw
from omniload_dask.core.stages import LiveStages, StageChange
from omniload_dask.core.state import StateRecorder, restore, snapshot
from omniload_dask.core.stepping import StepCycle
from omniload_dask.core.views import PlaneView
from omniload_dask.errors import InternalError, JobError
from omniload_dask.plan import Plan, SourceSpec
from omniload_dask.sources import Catalog

__all__ = [
    "Components",
    "Coordinator",
    "DealtStep",
    "DrawnStep",
    "ReadSpec",
    "Release",
    "StepFigures",
    "SubmitConstruct",
    "SubmitRead",
]


@dataclass(frozen=True)
class Components:
    """The coordinator's components, for tests and tools that look inside (the package's modules
    outside ``core`` never do: they hand in events and read :class:`.PlaneView`)."""

    sources: LiveSources
    drawer: Drawer
    dealer: StepDealer
    reads: ReadAhead
    delivery: Delivery
    figures: Figures
    cycle: StepCycle
    recorder: StateRecorder
    keys: Keys


class Coordinator:
    """Single source of truth for cursors, the mix, and which batch each rank gets.

    Events go in through :meth:`handle`, live changes through their methods, the step cycle
    through its phases; :attr:`view` reads (see the module docstring).
    """

    def __init__(
        self, plan: Plan, catalogs: Sequence[Catalog], run_id: str, start_step: int = 0
    ) -> None:
        """A fresh data plane at step 0; ranks start at ``start_step`` (steps below it are
        drawn to keep the stream exact, but not built)."""
        self._plan = plan
        self._keys = Keys(run_id, plan.layout.cp)
        self._sources = LiveSources(plan, catalogs, on_log=self._logged)
        self._dealer = StepDealer(plan)
        self._drawer = Drawer(self._sources, plan, with_extra=self._dealer.cost.has_encoder)
        self._reads = ReadAhead(self._sources, plan, self._keys)
        self._delivery = Delivery(plan, self._keys, start_step)
        self._figures = Figures(plan.layout.dp, self._dealer.declared_micro_steps)
        self._recorder = StateRecorder(self._sources, self._drawer, self._figures)
        self._cycle = StepCycle(
            self._sources, self._drawer, self._dealer, self._reads, self._delivery, self._figures
        )
        self._rewinds = Rewinds(self._sources, self._drawer, self._figures, self._keys)
        self._stages = LiveStages(
            plan, self._sources.record, self._drawer, self._dealer, self._reads
        )
        components = (self._sources, self._cycle, self._delivery, self._figures, self._reads)
        self._view = PlaneView(plan, *components, self._rewinds, self._stages)
        self._drawn_deltas: dict[int, dict[str, Any]] = {}  # steps in flight: their draws'
        self._recording = True  # per-step deltas for a checkpoint (off: none pile up)
        self._actions: list[Action] = []

    @property
    def view(self) -> PlaneView:
        """Where the step cycle is, figures and stats: read only."""
        return self._view

    @property
    def components(self) -> Components:
        """The components, for tests and tools that look inside (see :class:`Components`)."""
        return Components(*(getattr(self, f"_{c.name}") for c in fields(Components)))

    # -- events ------------------------------------------------------------------------------
    def handle(self, event: Event) -> list[Action]:
        """Take one event; return the actions it calls for now (releases of blocks that every
        rank has fetched). The step cycle's own actions come from :meth:`take_actions`."""
        if isinstance(event, ReadReported):
            extra = None
            if event.patches is not None and self._dealer.cost.has_encoder:
                sq = event.patches_sq
                sq = sq if sq is not None else np.zeros(len(event.patches))
                extra = self._dealer.cost.encoder_of(event.patches, sq)
            if (changed := self._reads.on_report(event, extra)) is not None:
                self._cycle.fail(Failure(changed, Cause.DATA_PLANE))  # (a read made again)
        elif isinstance(event, StepsRequested):
            return list(self._delivery.request(event.ranks, event.start, event.count, event.now))
        elif isinstance(event, ConstructionDone):
            self._reads.on_construct(event.seconds, event.batches)
        elif isinstance(event, WorkersChanged):
            self._reads.on_workers(event.workers, event.read_slots)
        elif isinstance(event, TaskFailed):
            if is_data_key(event.key):
                self._cycle.fail(Failure(event.message, Cause.TASK))
        elif isinstance(event, JobFailed):
            self._cycle.fail(Failure(event.message, event.cause))
        else:
            raise InternalError(f"internal error: the data plane got an unknown event {event!r}")
        return []

    # -- live changes ------------------------------------------------------------------------
    def set_weights(self, weights: dict[str, float], at_step: int | None = None) -> Scheduled:
        """Change source weights from ``at_step`` (default: the first step not built; steps
        drawn from there are drawn again, :mod:`.rewind`); logged, so a replay reproduces it."""
        floor = self._view.earliest_change
        step = self._sources.set_weights(weights, at_step, floor, self._cycle.drawn_tokens)
        self._redraw(floor, step)
        return Scheduled(step, dict(self._sources.log[-1]["weights"]))

    def add_source(self, spec: SourceSpec, catalog: Catalog, at_step: int | None = None) -> int:
        """Add (or bring back) a source from ``at_step`` on; returns that step."""
        floor = self._view.earliest_change
        return self._redraw(floor, self._sources.add_source(spec, catalog, at_step, floor))

    def remove_source(self, name: str, at_step: int | None = None) -> int:
        """Stop drawing from ``name`` from ``at_step`` on (its cursor is kept); returns it."""
        floor = self._view.earliest_change
        return self._redraw(floor, self._sources.remove_source(name, at_step, floor))

    def apply_change(
        self, change: PlanChange, catalogs: Sequence[Catalog], at_step: int | None = None
    ) -> int:
        """Queue a plan version's ``change`` (:meth:`.PlaneView.plan_change`; ``catalogs`` of
        its added sources) from ``at_step`` (default: the first step not built); returns the
        step it takes effect at."""
        floor = self._view.earliest_change
        step = self._sources.apply_change(change, catalogs, at_step, floor, self._figures.tokens)
        return self._redraw(floor, step)

    def apply_stages(self, change: StageChange) -> int:
        """Put a stage change in effect (:meth:`.PlaneView.stage_change`, :mod:`.stages`);
        returns the step it takes effect at (steps drawn from there are drawn again)."""
        floor = self._view.earliest_change
        return self._redraw(floor, self._stages.apply(change, floor))

    def adopt_plan(self, plan: Plan, catalogs: Sequence[Catalog]) -> None:
        """Resuming with a changed plan (after :meth:`load_state_dict`): its weights, schedule
        and sources rule from the restored step on; ``catalogs`` are the sources', in order."""
        adopt_plan(self._sources, plan, catalogs, self._cycle.next_step)

    # -- the step cycle ----------------------------------------------------------------------
    def advance(self, max_steps: int | None = None, together: int = 1) -> list[Action]:
        """Draw, deal and commit what can be drawn (at most ``max_steps``), keep reads ahead,
        return actions. Up to ``together`` steps are drawn, then dealt side by side and
        committed, as the scheduler plugin's dealing thread does: the same stream."""
        together, done = max(1, together), 0
        while max_steps is None or done < max_steps:
            most = together if max_steps is None else min(together, max_steps - done)
            drawn = self._draw_steps(most)
            if not drawn:
                break
            dealt = self.deal_steps(drawn)
            for one in dealt or []:
                self.commit_step(one)
            done += len(drawn)
            if dealt is None:
                break  # the job failed: the steps stay in flight, as a failed deal leaves them
        return self.take_actions()

    def draw_step(self, most_in_flight: int = 1) -> DrawnStep | None:
        """Draw the next step if the ranks want it and its documents are known, else None.

        Its cursors move now (and ``next_step``); :meth:`deal_steps` and :meth:`commit_step`
        follow, in step order. No step is drawn while ``most_in_flight`` are in flight
        (:meth:`draw_together` draws several), nor after the job failed.
        """
        cycle = self._cycle
        if cycle.failure is not None or len(cycle.in_flight) >= most_in_flight:
            return None
        if cycle.next_step >= self._delivery.draw_target(cycle.next_step):
            return None
        if cycle.next_step == 0 or self._delivery.block_end(cycle.next_step - 1) == cycle.next_step:
            self._rewinds.mark(cycle.next_step)  # a block begins: it may be drawn again from here
        try:
            drawn, actions = cycle.draw()
        except JobError as exc:
            cycle.fail(Failure(str(exc), Cause.DATA_PLANE))
            return None
        self._actions += actions
        if drawn is not None:
            self._rewinds.drawn(drawn.step, drawn.docs.finished)
            if self._recording:
                self._drawn_deltas[drawn.step] = self._recorder.drawn(drawn.step)
        return drawn

    def draw_together(
        self, drawn: list[DrawnStep], most: int, hold: bool = True
    ) -> tuple[list[DrawnStep], list[DrawnStep]]:
        """Draw on after ``drawn`` (steps drawn and not dealt yet, in order, at least one) and
        split them: the steps to deal together now (none: wait), and those that wait.

        Up to ``most`` steps go together. Where a construction builds several steps (a
        block), it ends at a block's end, and while the draw waits for a read, the whole blocks
        drawn go and the steps of a block drawn in part wait for the rest of it: none of them
        is fetchable before the block's last step is drawn, and a block's steps dealt
        together cost less than in several hand-offs. With ``hold`` False (a checkpoint
        snapshot waits for the steps in flight) every step drawn goes."""
        delivery = self._delivery
        drawn = [
            d for d in drawn if any(d is f for f in self._cycle.in_flight)
        ] or self._draw_steps(1)
        if not drawn:  # (a redraw dropped those drawn, and nothing can be drawn now)
            return [], []
        first = drawn[0].step
        end = delivery.together_end(first, most)
        drawn = drawn + self._draw_steps(end - first - len(drawn))
        cycle = self._cycle
        if len(drawn) == end - first or not (hold and cycle.waits_for_reads) or cycle.failure:
            return drawn, []
        ends = [i + 1 for i, d in enumerate(drawn) if d.step + 1 == delivery.block_end(d.step)]
        take = ends[-1] if ends else 0
        return drawn[:take], drawn[take:]

    def deal_steps(self, drawn: Sequence[DrawnStep]) -> list[DealtStep] | None:
        """Split drawn steps (in order) among the DP groups and write the recipes, side by side
        where the balancer can (:meth:`.StepDealer.deal_steps`); None when the job fails.
        Pure: reads only ``drawn`` and the plan, so it may run in another thread."""
        try:
            return self._dealer.deal_steps(drawn)
        except JobError as exc:
            self._cycle.fail(Failure(str(exc), Cause.DATA_PLANE))
            return None

    def commit_step(self, dealt: DealtStep) -> None:
        """Submit a dealt step's constructions, count it, and let ranks fetch it."""
        if self._rewinds.was_dropped(dealt.drawn):
            return
        self._rewinds.committing(dealt.drawn.step)
        self._actions += self._cycle.commit(dealt)
        self._rewinds.prune(self._view.dealt_step)
        delta = self._drawn_deltas.pop(dealt.drawn.step, None)
        if self._recording:  # (no delta: recording began after its draw)
            recorder = self._recorder
            recorder.committed(delta or recorder.drawn(dealt.drawn.step), self._cycle.end_step)

    def take_actions(self) -> list[Action]:
        """Keep reads ahead, then hand over every action queued since the last call."""
        if self._cycle.failure is None:
            try:
                self._submit_reads()
            except JobError as exc:
                self._cycle.fail(Failure(str(exc), Cause.DATA_PLANE))
        actions, self._actions = self._actions, []
        return actions

    def has_actions(self) -> bool:
        """Whether actions wait for :meth:`take_actions` (e.g. a rebuild just queued)."""
        return bool(self._actions)

    # -- what ranks fetch --------------------------------------------------------------------
    def batch_for(self, rank: int, step: int) -> Part | None:
        """What ``rank`` fetches for ``step`` once dealt, ``(block key, part)``, else None
        (a released step is rebuilt): its DP group's batch, or its cp rank's slice of it."""
        group, cp = self._delivery.coords(rank)
        return self.part_for(group, cp, step)

    def part_for(self, group: int, cp: int, step: int) -> Part | None:
        """What DP group ``group``'s cp rank ``cp`` fetches for ``step``, as :meth:`batch_for`."""
        part, rebuild = self._delivery.part_for(group, cp, step, self._view.dealt_step)
        if rebuild is not None:
            self._actions.append(rebuild)
        return part

    # -- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The full data-plane state (plain data, :mod:`.state`) at ``view.earliest_change``;
        not while a step is in flight (``view.busy``: its figures are not counted yet)."""
        if self._view.busy:
            raise InternalError("internal error: state_dict() while a step is being dealt")
        cycle = self._cycle
        now = snapshot(cycle.next_step, cycle.end_step, self._sources, self._drawer, self._figures)
        floor = self._view.earliest_change
        return now if floor == cycle.next_step else self._rewinds.snapshot_at(floor, now)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from a snapshot: this coordinator's sources must be the snapshot's, in order.

        Changes logged for later steps (sources joining or leaving) are scheduled again.
        """
        step, end = restore(state, self._sources, self._drawer, self._figures)
        self._cycle.next_step, self._cycle.end_step = step, end
        self._delivery.restart_at(step)
        self._recorder = StateRecorder(self._sources, self._drawer, self._figures)
        self._drawn_deltas = {}
        self._rewinds.reset()
        self._stages.replay(self._sources.log)

    def take_deltas(self) -> list[dict[str, Any]]:
        """Deltas of the steps committed since the last call below ``view.earliest_change``
        (the rest may be drawn again), and the changes logged."""
        return self._recorder.take(below=self._view.earliest_change)

    def stop_recording(self) -> None:
        """Record no more deltas and drop those pending (a job without a checkpoint: they
        would pile up for ever)."""
        self._recording = False
        self._recorder.take()

    # -- internals ---------------------------------------------------------------------------
    def _logged(self, entry: dict[str, Any]) -> None:
        self._recorder.log(entry)

    def _redraw(self, floor: int, step: int) -> int:
        """A change was accepted at ``step``: where that is drawn, draw again from ``floor``
        (:mod:`.rewind`); returns ``step``."""
        if step < self._cycle.next_step and self._cycle.end_step is None:
            self._actions += redraw(self._rewinds, self._cycle, self._delivery, floor)
            self._recorder, self._drawn_deltas = self._recorder.restart(floor), {}
        return step

    def _draw_steps(self, most: int) -> list[DrawnStep]:
        """Draw up to ``most`` steps more, in flight together, until one cannot be drawn."""
        cycle = self._cycle
        limit = len(cycle.in_flight) + most
        cycle.waits_for_reads = False  # (the last draw sets it, if it finds nothing)
        drawn: list[DrawnStep] = []
        while len(drawn) < most and (step := self.draw_step(limit)) is not None:
            drawn.append(step)
        return drawn

    def _submit_reads(self) -> None:
        # Read ahead for sources that take part now or within the lookahead (schedules).
        step = self._cycle.next_step
        horizon = step + self._plan.loader.lookahead
        weights = np.maximum(self._view.weights_at(step), self._view.weights_at(horizon))
        self._actions += self._reads.submit(weights, self._drawer.starved)

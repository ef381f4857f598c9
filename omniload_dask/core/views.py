"""Read-only views of the data plane: where the step cycle is, figures, stats.

:class:`PlaneView` is how every module outside :mod:`omniload_dask.core` reads the data plane
(the adapter, the checkpoint schedule, the dashboard, stats). It only reads: nothing on it
changes a cursor, a hold or a counter, so a reader can call it at any time (also while a step
is being dealt in another thread: what it reads is written only on the adapter's loop)::

    view = coord.view
    view.next_step, view.dealt_step, view.end_step     where the stream is
    view.earliest_change, view.delivered_step             where a live change can land,
                                                          where the ranks are
    view.failure                                          None, or why the job stopped
    view.stats(), view.mixture(100), view.step_figures()  figures, as plain data

Pure: no I/O and no Dask.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from omniload_dask.core.delivery import Delivery
from omniload_dask.core.events import Failure
from omniload_dask.core.figures import Figures, StepFigures
from omniload_dask.core.live import LiveSources, PlanChange
from omniload_dask.core.reads import ReadAhead
from omniload_dask.core.rewind import Rewinds
from omniload_dask.core.stages import LiveStages, StageChange
from omniload_dask.core.stepping import StepCycle
from omniload_dask.core.streams import SourceStream
from omniload_dask.plan import BatchSpec, Plan, SourceSpec

__all__ = ["PlaneView"]


class PlaneView:
    """What the data plane's components say about the job, read only (see the module docstring)."""

    def __init__(
        self,
        plan: Plan,
        sources: LiveSources,
        cycle: StepCycle,
        delivery: Delivery,
        figures: Figures,
        reads: ReadAhead,
        rewinds: Rewinds,
        stages: LiveStages,
    ) -> None:
        self._plan = plan
        self._stages = stages
        self._rewinds = rewinds
        self._sources = sources
        self._cycle = cycle
        self._delivery = delivery
        self._figures = figures
        self._reads = reads

    # -- the step cycle ----------------------------------------------------------------------
    @property
    def next_step(self) -> int:
        """The first step not drawn."""
        return self._cycle.next_step

    @property
    def committed_step(self) -> int:
        """The first step not committed (its constructions not submitted yet)."""
        return self._cycle.dealt_step

    @property
    def dealt_step(self) -> int:
        """The first step ranks cannot fetch yet: every step below it is committed and its
        block is built (a block of several steps only once its last step is committed)."""
        first = self._delivery.offered_step
        dealt = self._cycle.dealt_step
        return dealt if first is None else min(dealt, first)

    @property
    def earliest_change(self) -> int:
        """The first step a live change can take effect at: the first step not built where
        the steps drawn past it can be drawn again (:mod:`.rewind`), else :attr:`next_step`."""
        return self._rewinds.floor(self.dealt_step, self._cycle.next_step)

    @property
    def delivered_step(self) -> int:
        """Every rank has fetched every step below this one (the slowest rank's position)."""
        return self._delivery.slowest()

    @property
    def end_step(self) -> int | None:
        """The stream ends before this step (every source exhausted), once known."""
        return self._cycle.end_step

    @property
    def busy(self) -> bool:
        """A step is drawn but not committed: the state is between two steps (no snapshot)."""
        return bool(self._cycle.in_flight)

    @property
    def failure(self) -> Failure | None:
        """Why the job stopped (the first failure), or None while it runs."""
        return self._cycle.failure

    @property
    def error(self) -> str | None:
        """The failure's message, or None while the job runs."""
        failure = self._cycle.failure
        return None if failure is None else failure.message

    def draw_target(self) -> int:
        """The data plane draws the steps below this one (see :meth:`.Delivery.draw_target`)."""
        return self._delivery.draw_target(self._cycle.next_step)

    # -- sources -----------------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        """Source names by index (sources that left keep their index)."""
        return list(self._sources.names)

    @property
    def streams(self) -> list[SourceStream]:
        """Every source's stream by index, to read (cursors and counters)."""
        return list(self._sources.streams)

    def spec_of(self, source: int) -> SourceSpec:
        """Source ``source``'s spec (sources join later with higher indices)."""
        return self._sources.streams[source].spec

    @property
    def log(self) -> list[dict[str, Any]]:
        """Every live change so far (weights, sources joining and leaving), in order."""
        return list(self._sources.log)

    def weights_at(self, step: int) -> np.ndarray:
        """Target weights at ``step``; 0 for sources exhausted or removed."""
        return self._sources.weights_at(step, self._cycle.drawn_tokens)

    def plan_change(self, sources: Sequence[SourceSpec], at_step: int | None) -> PlanChange:
        """What a plan version with ``sources`` changes from ``at_step`` (default: the first
        step not built, :attr:`earliest_change`), compared with the plan due then (JobError if
        a source changed its files or format). Nothing changes until
        :meth:`.Coordinator.apply_change`."""
        return self._sources.plan_change(sources, at_step, self.earliest_change)[1]

    @property
    def batch(self) -> BatchSpec:
        """The job's batch and its stages, as live changes left them (:mod:`.stages`)."""
        return self._stages.batch

    @property
    def stages_version(self) -> int:
        """The count of stage changes logged: what each step cut since says (:mod:`.stages`)."""
        return self._stages.version

    def stage_change(self, batch: BatchSpec, at_step: int | None) -> StageChange | None:
        """What a plan version's ``batch`` changes of the stages from ``at_step`` (default:
        :attr:`earliest_change`; None: nothing). Nothing changes until
        :meth:`.Coordinator.apply_stages`."""
        return self._stages.change(batch, at_step, self.earliest_change)

    # -- ranks -------------------------------------------------------------------------------
    def slowest(self) -> int:
        """The smallest position of any rank: every rank has fetched every step below it."""
        return self._delivery.slowest()

    def rank_positions(self) -> list[int]:
        """Each rank's position (every step below it fetched), by rank. O(ranks)."""
        return [int(p) for p in self._delivery.where.position.tolist()]

    def held_back(self) -> dict[str, object] | None:
        """Who holds the draw back, when it waits for the slowest ranks (None when not)."""
        return self._delivery.held_back()

    def check_ranks(self, ranks: Sequence[int]) -> None:
        """Raise JobError naming the first of ``ranks`` that is not in the layout."""
        self._delivery.check_ranks(ranks)

    # -- figures -----------------------------------------------------------------------------
    @property
    def history(self) -> deque[StepFigures]:
        """The figures of the last steps drawn (oldest first)."""
        return self._figures.history

    @property
    def timing(self) -> Mapping[str, float]:
        """The last step's dealing times (``assign_ms``, ``recipes_ms``, ...)."""
        return self._figures.timing

    def stats(self) -> dict[str, Any]:
        """Counters for feeders, the report and monitoring (plain data)."""
        weights = self.weights_at(self.next_step)
        return {
            "next_step": self.next_step,
            "earliest_change": self.earliest_change,
            "delivered_step": self.delivered_step,
            "end_step": self.end_step,
            "log": list(self._sources.log),
            "error": self.error,
            **self._figures.summary(),
            "held_batches": len(self._delivery.held),
            "units_in_flight": sum(len(s.units) for s in self._sources.streams),
            "ranks": self._delivery.positions(),
            "held_back": self._delivery.held_back(),
            "sources": self._reads.source_stats(weights),
            "worker_threads": self._reads.read_slots,
            "work_per_step": self.work_per_step(),
        }

    def step_figures(self, start: int = 0) -> list[StepFigures]:
        """The kept figures of steps from ``start`` on."""
        return self._figures.step_figures(start)

    def mixture(self, window: int = 100) -> list[dict[str, Any]]:
        """Per source: target and realised share, over the last ``window`` steps delivered
        (every rank has fetched them: below :attr:`delivered_step`) and over every step
        delivered; ``target_now`` is the weights the data plane draws with now.

        Shares are of tokens or of documents, as the plan's ``mixing.by`` says; the target of a
        window is the mean of its steps' normalised target weights.
        """
        now = self.weights_at(self.next_step)
        by_tokens = self._plan.mixing_by == "tokens"
        return self._figures.mixture(
            window, self._sources.streams, now, by_tokens, before=self.delivered_step
        )

    def work_per_step(self) -> float | None:
        """Measured worker seconds one step costs (reads of every source and constructions)."""
        return self._reads.work_per_step(self.weights_at(self.next_step), self._plan.layout.dp)

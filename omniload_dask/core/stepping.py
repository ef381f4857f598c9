"""The step cycle: draw, deal, commit, in step order.

::

    draw(t)      live changes due at t applied; the mixer picks t's documents, the cursors
                 move past them, next_step = t + 1                    (cheap)
    deal(t)      StepDealer.deal: split by cost, recipes               (pure; may run in a
                                                                         thread meanwhile)
    commit(t)    blocks held and their constructions submitted, figures counted, units the
                 cursors passed released; ranks may fetch t now (dealt_step = t + 1)

Between a draw and its commit the step is *in flight*: live changes then take effect from the
step after it (``next_step`` has moved), and no snapshot is taken (its figures are not
counted yet). Up to ``max_in_flight`` steps may be in flight (1 unless the job says more:
the scheduler plugin draws the steps it can and deals them side by side, see
:meth:`.StepDealer.deal_steps`); they are committed in order. A draw weighs the tokens of
the steps in flight as drawn (:attr:`StepCycle.drawn_tokens`), so the stream is the same
whatever their number. :class:`StepCycle` holds where the cycle is (``next_step``,
``end_step``, the steps in flight) and does the draw and the commit over the coordinator's
components.

Pure: no I/O and no Dask.
"""

from __future__ import annotations

import time

import numpy as np

from omniload_dask.core.actions import Action, Release
from omniload_dask.core.dealer import DealtStep, DrawnStep, StepDealer
from omniload_dask.core.delivery import Delivery, StepRecord
from omniload_dask.core.draw import Drawer
from omniload_dask.core.events import Failure
from omniload_dask.core.figures import Figures
from omniload_dask.core.live import LiveSources
from omniload_dask.core.reads import ReadAhead
from omniload_dask.errors import InternalError

__all__ = ["StepCycle"]


class StepCycle:
    """Where the step cycle is, and its draw and commit phases (see the module docstring)."""

    def __init__(
        self,
        sources: LiveSources,
        drawer: Drawer,
        dealer: StepDealer,
        reads: ReadAhead,
        delivery: Delivery,
        figures: Figures,
    ) -> None:
        """A cycle at step 0 over the coordinator's components."""
        self._sources = sources
        self._drawer = drawer
        self._dealer = dealer
        self._reads = reads
        self._delivery = delivery
        self._figures = figures
        self.next_step = 0  # the first step not drawn
        self.end_step: int | None = None  # the stream ends here (every source exhausted)
        self.in_flight: list[DrawnStep] = []  # drawn, not committed, in step order
        self.max_in_flight = 1
        self.waits_for_reads = False  # the last draw found nothing: a source must report first
        self.failure: Failure | None = None  # the job stopped: nothing more is drawn
        self._flight_tokens = 0  # tokens of the steps in flight

    def fail(self, failure: Failure) -> None:
        """Stop the cycle with ``failure``, unless it stopped already (the first one stays:
        later ones describe what it caused)."""
        if self.failure is None:
            self.failure = failure

    @property
    def dealt_step(self) -> int:
        """The first step not committed."""
        return self.next_step - len(self.in_flight)

    @property
    def drawn_tokens(self) -> int:
        """Tokens of every step drawn so far (committed or in flight)."""
        return self._figures.tokens + self._flight_tokens

    def draw(self) -> tuple[DrawnStep | None, list[Action]]:
        """Draw step ``next_step`` (None: a source must report first, or the stream ended),
        and the releases of units that live changes dropped."""
        self.waits_for_reads = False
        actions = self._apply_changes(self.next_step)
        started = time.perf_counter()
        weights = self._sources.weights_at(self.next_step, self.drawn_tokens)
        # (the stream ends only once the steps in flight are committed: a draw then ends it
        # at the same step, and the last block is built after them)
        if not (weights > 0).any():
            # nothing left to draw from: the stream ends
            return None, actions if self.in_flight else self._end(actions)
        docs = self._drawer.draw(self.next_step, weights)
        if docs is None:
            self.waits_for_reads = True
            return None, actions
        if len(docs.sources) == 0:  # every source with weight ran out during this step
            return None, actions if self.in_flight else self._end(actions)
        specs = [
            self._reads.read_spec(s, *u) for s, u in zip(docs.slot_source, docs.slots, strict=True)
        ]
        epochs = np.asarray([unit.epoch for unit, _ in docs.slots], dtype=np.int64)
        drawn = DrawnStep(self.next_step, docs, specs, epochs, started)
        self.in_flight.append(drawn)
        self._flight_tokens += int(docs.lengths.sum())
        self.next_step += 1
        return drawn, actions

    def commit(self, dealt: DealtStep) -> list[Action]:
        """Hold and build the dealt step's blocks, count it, release the units passed."""
        drawn, split = dealt.drawn, dealt.assignment
        if not self.in_flight or drawn is not self.in_flight[0]:
            raise InternalError(f"internal error: step {drawn.step} committed out of order")
        del self.in_flight[0]
        self._flight_tokens -= int(drawn.docs.lengths.sum())
        step, docs, figures = drawn.step, drawn.docs, self._figures
        figures.timing.update(assign_ms=dealt.assign_ms, recipes_ms=dealt.recipes_ms)
        actions: list[Action] = list(self._delivery.offer(step, dealt.recipes, drawn.specs))
        n = len(self._sources.streams)
        source_tokens = np.bincount(docs.sources, weights=docs.lengths, minlength=n)
        record = StepRecord(
            dealt.recipes, drawn.specs, split.group_costs, split.group_tokens, source_tokens
        )
        figures.record(
            step,
            split,
            docs.lengths,
            source_tokens,
            docs.sources,
            self._drawer.weights,
            first=docs.first_pieces,
        )
        if docs.finished:
            done = Release(tuple(k for u in docs.finished for k in u.keys))
            actions += self._delivery.defer([done])  # after the block that uses them
            for u in docs.finished:
                self._reads.forget(u)
        self._delivery.keep(step, record, self.next_step)
        figures.dealt((time.perf_counter() - drawn.started) * 1e3)
        return actions

    def rewind(self, step: int) -> list[DrawnStep]:
        """Draw ``step`` next (the components are back where they were before it was drawn,
        :mod:`.rewind`); returns the steps in flight, dropped (all from ``step`` on)."""
        dropped, self.in_flight = self.in_flight, []
        if any(d.step < step for d in dropped) or self.end_step is not None:
            raise InternalError(f"internal error: cannot draw step {step} again")
        self._flight_tokens = 0
        self.next_step = step
        self.waits_for_reads = False
        return dropped

    def _end(self, actions: list[Action]) -> list[Action]:
        """The stream ends at ``next_step``: the block being drawn is built as it is."""
        self.end_step = self.next_step
        return actions + list(self._delivery.flush())

    def _apply_changes(self, step: int) -> list[Action]:
        """Put the source changes due at ``step`` into effect, in every component."""
        actions: list[Action] = []
        while (applied := self._sources.apply_next(step)) is not None:
            if applied.joined is not None:
                self._drawer.add_source()
                self._reads.add_source()
            for unit in applied.dropped:
                self._reads.forget(unit)
            if applied.dropped:
                dropped = Release(tuple(k for u in applied.dropped for k in u.keys))
                actions += self._delivery.defer([dropped])
        return actions

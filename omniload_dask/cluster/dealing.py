"""Where a running job deals its steps: inline, in a thread, or in a process of its own.

Dealing a step (the split by cost, then the recipes; :meth:`StepDealer.deal`) is pure and
the costliest thing the data plane does: tens to hundreds of milliseconds at thousands of DP
groups. On the scheduler's event loop it would stall every request meanwhile; in a thread it
still takes the GIL from the loop (every RPC then waits up to a switch interval for it). A
:class:`StepDealing` picks::

    the last step dealt in < INLINE_MS        inline (a hop costs more than the deal)
    dp >= PROCESS_MIN_GROUPS                  a dealing process (spawned once per job); the
                                              step's documents go there as a few arrays, the
                                              recipes come back packed (RecipeTable)
    else                                      the job's dealing thread

The result is the same wherever it is computed. A process that fails (it died, or cannot
start) is replaced by the thread, with a warning. The thread deals the steps drawn since its
last hand-off together, up to ``STEPS_AT_ONCE`` of them (:meth:`.StepDealer.deal_steps`: the
same dealt steps, and at small DP sizes much cheaper, since the per-call work is shared);
where a construction builds several steps, whole blocks of them
(:meth:`~omniload_dask.core.coordinator.Coordinator.draw_together`). The process deals one step
at a time.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import time
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np

from omniload_dask.core.coordinator import Coordinator
from omniload_dask.core.dealer import DealtStep, DrawnStep, StepDealer
from omniload_dask.core.draw import Documents
from omniload_dask.core.events import Cause, JobFailed
from omniload_dask.errors import JobError
from omniload_dask.plan import Plan, parse_plan

__all__ = ["INLINE_MS", "PROCESS_MIN_GROUPS", "STEPS_AT_ONCE", "StepDealing"]

logger = logging.getLogger(__name__)
INLINE_MS = 1.0
PROCESS_MIN_GROUPS = 64
STEPS_AT_ONCE = 16  # steps drawn ahead and dealt together in the thread, at most

_dealer: StepDealer | None = None  # in a dealing process: the job's dealer


class StepDealing:
    """One job's dealing: inline, its thread, or its process (see the module docstring).

    ``cpu_s`` counts the CPU-seconds spent dealing (wherever), ``off_loop`` the steps dealt
    elsewhere than on the loop, ``hand_offs`` the hand-offs they went in (steps dealt together go in one).
    """

    def __init__(self, plan: Plan, coord: Coordinator, *, process: bool | None = None) -> None:
        self.coord = coord
        self.inline_ms = INLINE_MS
        self.cpu_s = 0.0
        self.off_loop = 0
        self.hand_offs = 0
        self._together = 1  # steps dealt together last time
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"omniload-deal-{plan.name}")
        use = process if process is not None else plan.layout.dp >= PROCESS_MIN_GROUPS
        self._process: Executor | None = _start_process(plan) if use else None

    @property
    def where(self) -> str:
        """``"process"`` or ``"thread"``: where steps go that are not dealt inline."""
        return "process" if self._process is not None else "thread"

    @property
    def at_once(self) -> int:
        """Steps dealt off the loop together (side by side): ``STEPS_AT_ONCE`` in the
        thread, one at a time in the process."""
        return STEPS_AT_ONCE if self._process is None else 1

    def inline(self) -> bool:
        """Whether the next step is cheap enough to deal on the loop (a job with a dealing
        process deals its first step there too: at its size that one is not cheap). Steps
        dealt together count as their time together: one of them alone costs more than
        its share."""
        timing = self.coord.view.timing
        if "assign_ms" not in timing and self._process is not None:
            return False
        each = timing.get("assign_ms", 0.0) + timing.get("recipes_ms", 0.0)
        return each * self._together < self.inline_ms

    def deal_here(self, drawn: DrawnStep) -> DealtStep | None:
        """Deal ``drawn`` in this thread (the loop, or the dealing thread)."""
        t0 = time.thread_time()
        try:
            self._together = 1
            dealt = self.coord.deal_steps([drawn])
            return None if dealt is None else dealt[0]
        finally:
            self.cpu_s += time.thread_time() - t0

    def deal_together(self, drawn: list[DrawnStep]) -> list[DealtStep] | None:
        """Deal the steps ``drawn`` (in order) together, in this thread."""
        t0 = time.thread_time()
        try:
            self._together = len(drawn)
            return self.coord.deal_steps(drawn)
        finally:
            self.cpu_s += time.thread_time() - t0

    def start(self, drawn: list[DrawnStep]) -> asyncio.Future[list[DealtStep] | None]:
        """Deal the steps ``drawn`` (in order) off the loop; the future's result is the
        dealt steps (None on a job error)."""
        loop = asyncio.get_running_loop()
        self.off_loop += len(drawn)
        self.hand_offs += 1
        if self._process is None:
            return loop.run_in_executor(self._thread, self.deal_together, drawn)
        return asyncio.ensure_future(self._each_in_process(drawn))

    async def _each_in_process(self, drawn: list[DrawnStep]) -> list[DealtStep] | None:
        out = []
        for one in drawn:
            dealt = await self._in_process(one)
            if dealt is None:
                return None
            out.append(dealt)
        return out

    async def _in_process(self, drawn: DrawnStep) -> DealtStep | None:
        loop = asyncio.get_running_loop()
        docs = drawn.docs
        arrays = (
            drawn.step,
            docs.sources,
            docs.lengths,
            docs.extra,
            docs.rows,
            docs.slot,
            # what the loss-token count reads of each read task: its unit's holes and row bounds
            [(u.holes, u.bounds, p) if u.holes is not None else None for u, p in docs.slots],
            drawn.epochs,
            docs.starts,
        )
        assert self._process is not None
        try:
            split, recipes, split_ms, recipes_ms, cpu = await loop.run_in_executor(
                self._process, _deal_in_process, arrays
            )
        except JobError as exc:
            self.coord.handle(JobFailed(str(exc), Cause.DATA_PLANE))
            return None
        except Exception as exc:  # the process died or could not start: deal in the thread
            logger.warning("omniload: dealing process failed (%r); dealing in a thread", exc)
            self._stop_process()
            return await loop.run_in_executor(self._thread, self.deal_here, drawn)
        self.cpu_s += cpu
        return DealtStep(drawn, split, recipes, split_ms, recipes_ms)

    def close(self) -> None:
        """Stop the thread and the process (steps in flight are dropped)."""
        self._thread.shutdown(wait=False, cancel_futures=True)
        self._stop_process()

    def _stop_process(self) -> None:
        if self._process is not None:
            self._process.shutdown(wait=False, cancel_futures=True)
            self._process = None


def _start_process(plan: Plan) -> Executor | None:
    """A one-process pool whose process holds the job's dealer (None if it cannot start)."""
    try:
        return ProcessPoolExecutor(
            1,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_process,
            initargs=(plan.redacted(),),  # dealing needs no credentials
        )
    except Exception as exc:  # e.g. no processes allowed here: the thread will do
        logger.warning("omniload: no dealing process (%r); dealing in a thread", exc)
        return None


def _init_process(plan: dict[str, Any]) -> None:
    global _dealer
    _dealer = StepDealer(parse_plan(plan))


class _Held(NamedTuple):
    """What of a read unit the dealing process needs (see ``step_loss_tokens``)."""

    holes: Any
    bounds: Any


def _deal_in_process(arrays: tuple[Any, ...]) -> tuple[Any, ...]:
    """In the dealing process: deal one step from its documents' arrays."""
    step, sources, lengths, extra, rows, slot, held, epochs, starts = arrays
    assert _dealer is not None
    t0 = time.thread_time()
    # What the recipes read of the step's documents, the rest of a continued one included, and
    # of each read task what the loss-token count reads (a unit's holes and row bounds).
    slots = [(_Held(*h[:2]), h[2]) if h is not None else (_Held(None, None), 0) for h in held]
    docs = Documents(sources, lengths, extra, rows, slot, slots, [], [], starts)  # type: ignore[arg-type]
    dealt = _dealer.deal(DrawnStep(step, docs, [], np.asarray(epochs), 0.0))
    return (
        dealt.assignment,
        dealt.recipes,
        dealt.assign_ms,
        dealt.recipes_ms,
        time.thread_time() - t0,
    )

"""A job running on the scheduler: its coordinator, its futures, and the loop that drives them.

One :class:`RunningJob` per job. Everything on it runs on the scheduler's event loop (handlers,
plugin hooks, the pump) except the dealing of a step, so nothing needs a lock. Events come in
from the plugin (a read or a construction finished, a task failed, an agent asked for steps);
each one *pokes* the job, and one pump task at a time runs the data plane::

    poke()  ->  pump: draw a step (on the loop: cheap)
                      -> deal it (split + recipes) in the job's dealing process or thread,
                         or inline while that is quick (:mod:`.dealing`); the loop serves
                         requests meanwhile
                      -> commit it: constructions submitted, waiting agents woken
                      -> reads kept ahead, actions executed, checkpoint tick
                      again while something moved, yielding to the loop in between

Fetching agents long-poll in :meth:`RunningJob.batches`; each waits on the one thing it needs
next (a step to be dealt, or a block to reach memory, see :class:`Waiters`), so a step
wakes only the agents it concerns.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from distributed import Client, Future

from omniload_dask.checkpoint import CheckpointWriter
from omniload_dask.cluster.checkpointing import CheckpointSchedule
from omniload_dask.cluster.dealing import StepDealing
from omniload_dask.cluster.executor import ActionExecutor
from omniload_dask.cluster.tasks import ReadReport
from omniload_dask.cluster.waiters import Waiters
from omniload_dask.core.coordinator import Coordinator, DealtStep, DrawnStep
from omniload_dask.core.events import (
    Cause,
    ConstructionDone,
    JobFailed,
    ReadReported,
    StepsRequested,
    TaskFailed,
    WorkersChanged,
)
from omniload_dask.core.keys import read_source
from omniload_dask.errors import JobError, MissingJobError, OmniloadError
from omniload_dask.observe.monitoring import JobMonitor
from omniload_dask.plan import Plan
from omniload_dask.plan.credentials import scrub

__all__ = ["RunningJob"]

logger = logging.getLogger(__name__)


class RunningJob:
    """One job's data plane on the scheduler, and what it holds in the cluster.

    ``info`` is what starting the job replied (run id, resolved plan, files, tokenizer).
    ``executor`` carries out the coordinator's actions and holds the job's futures;
    ``writer``, when the plan has a checkpoint, gets the deltas (see :class:`CheckpointSchedule`).
    """

    def __init__(
        self,
        plan: Plan,
        coord: Coordinator,
        info: dict[str, Any],
        executor: ActionExecutor,
        writer: CheckpointWriter | None = None,
    ) -> None:
        self.plan = plan
        self.coord = coord
        self.info = info
        self.secrets = plan.secrets()  # taken out of every error text the job shows
        self.executor = executor
        self.started = time.time()
        self.monitor = JobMonitor(len(plan.sources), self.started)
        self.checkpoints: CheckpointSchedule | None = None
        if writer is not None:
            assert plan.checkpoint is not None
            self.checkpoints = CheckpointSchedule(writer, plan.checkpoint, coord, self.poke)
        else:
            coord.stop_recording()  # no checkpoint: per-step deltas would pile up for ever
        self.waiters = Waiters()
        self.stopped = False
        self.scheduler_closing = False  # feeders then wait for a new scheduler, not fail
        self.pumps = 0  # data-plane runs (draw/commit + execute), for diagnostics
        self.requests = 0  # agents' calls to ``batches``
        self.dealing = StepDealing(plan, coord)
        self._dealt_soon: asyncio.Future[list[DealtStep] | None] | None = None
        self._drawn: list[DrawnStep] = []  # drawn, waiting for the rest of their block
        self._dirty = False
        self._pump: asyncio.Task[None] | None = None

    @property
    def name(self) -> str:
        """The job's name (the plan's)."""
        return self.plan.name

    @property
    def run_id(self) -> str:
        """This run of the job: part of every task key, new each time the job starts."""
        return str(self.info["run_id"])

    @property
    def futures(self) -> dict[str, Future]:
        """The futures the job holds, by key (reads and blocks in memory or on their way)."""
        return self.executor.futures

    # ------------------------------------------------------------------ events
    def on_read_done(self, key: str, report: ReadReport | None, seconds: float | None) -> None:
        """A read task's shard is in memory; ``report`` carries its records' lengths."""
        if report is not None:
            self._on_report(key, report, seconds)
        self.executor.landed(key, "read")
        self._keep_copy(key)  # shards too: a lost worker then costs no re-read

    def on_batch_done(self, key: str, seconds: float | None) -> None:
        """A constructed block is in memory: wake the agents waiting for it."""
        self.waiters.key_ready(key)
        self.monitor.on_batch_built()
        if seconds is not None:
            self.coord.handle(ConstructionDone(seconds, self.executor.batches_in(key)))
        self.executor.landed(key, "batch")
        self._keep_copy(key)

    def on_task_failed(self, key: str, text: str) -> None:
        """A task of the job failed for good: the job fails with its error."""
        self.coord.handle(TaskFailed(key, scrub(text, self.secrets)))
        self.waiters.wake_all()

    def on_workers(self, workers: int, read_slots: int) -> None:
        """The cluster's workers changed (read quotas count their read slots)."""
        self.coord.handle(WorkersChanged(workers, read_slots))
        self.poke()

    def on_client_lost(self, client: Client) -> int:
        """The data plane's client lost what it held: submit it again on ``client``."""
        count = self.executor.resubmit(client)
        logger.warning(
            "omniload job %s: the data plane's client lost its connection; %d tasks submitted "
            "again",
            self.name,
            count,
        )
        self.poke()
        return count

    # ------------------------------------------------------------------ agents
    async def batches(
        self,
        ranks: Sequence[int],
        needs: Sequence[tuple[int, int]],
        start: int,
        count: int,
        timeout: float,
        report: dict[str, Any] | None,
        locate: Callable[[str], list[str] | None],
    ) -> dict[str, Any]:
        """Long-poll: the parts ``needs`` (``(group, cp)`` each) of the steps from ``start``
        on (up to ``count``) that are in memory, for an agent serving ``ranks``.

        ``locate(key)`` names the workers holding a key in memory (None: not in memory). The
        reply holds, per ready step in order, one ``[block key, part]`` per need, and who has
        each block; the wait ends when at least one step is ready, the stream ended, or
        ``timeout`` seconds passed.
        """
        coord, view = self.coord, self.coord.view
        now = time.time()
        self.requests += 1
        target = view.draw_target()
        self.executor.execute(coord.handle(StepsRequested(ranks, start, count, now)))
        self.monitor.on_progress(now, view.slowest())
        if report:
            self.monitor.on_agent(ranks, now, report)
        if coord.has_actions() or view.draw_target() != target:
            self.poke()  # further to draw, or a rebuild: else nothing can move
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, float(timeout))
        while True:
            if self.scheduler_closing:  # retried by feeders: the job may resume on a new one
                raise MissingJobError(f"job {self.name!r}: the scheduler is shutting down")
            if view.failure is not None:
                raise JobError(f"job {self.name!r} failed: {view.failure.message}")
            if self.stopped:
                raise JobError(f"job {self.name!r} was stopped")
            ready, who_has, blocker = self._ready(needs, start, count, locate)
            remaining = deadline - loop.time()
            ended = view.end_step is not None and start + len(ready) >= view.end_step
            if ready or remaining <= 0 or ended:
                break
            await self.waiters.wait(blocker, remaining)
        reply = {"start": start, "parts": ready, "who_has": who_has, "end": view.end_step}
        if not ready:  # say who holds the job back, if ranks do (feeders warn about it)
            reply["held_back"] = view.held_back()
        return reply

    def _ready(
        self,
        needs: Sequence[tuple[int, int]],
        start: int,
        count: int,
        locate: Callable[[str], list[str] | None],
    ) -> tuple[list[list[list[Any]]], dict[str, list[str]], int | str]:
        """The ready steps' parts, who has their blocks, and what the first step not ready
        waits for (its step number: to be dealt; a key: to reach memory)."""
        coord = self.coord
        ready: list[list[list[Any]]] = []
        who_has: dict[str, list[str]] = {}
        blocker: int | str = start
        for step in range(start, start + count):
            refs = []
            for group, cp in needs:
                part = coord.part_for(group, cp, step)
                if part is None:
                    blocker = step
                    break
                key = part[0]
                if key not in who_has:
                    where = locate(key)
                    if where is None:
                        blocker = key
                        break
                    who_has[key] = where
                refs.append([key, part[1]])
            else:
                ready.append(refs)
                continue
            break
        if coord.has_actions():
            self.poke()  # part_for queued a rebuild of a released step
        return ready, who_has, blocker

    # ------------------------------------------------------------------ the data plane
    def poke(self) -> None:
        """Have the pump run the data plane soon (runs coalesce: one pump at a time)."""
        self._dirty = True
        if self._pump is None or self._pump.done():
            self._pump = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        """The pump: run the data plane while something may have moved."""
        coord, view = self.coord, self.coord.view
        while self._dirty and not self.stopped:
            self._dirty = False
            self.pumps += 1
            # (drawn and committed steps count as moves too: a step of a multi-step block
            # being drawn is not fetchable yet, but the draw must go on)
            before = (view.dealt_step, view.end_step, view.failure, view.committed_step)
            actions: list[Any] = []
            try:
                self._step()
                actions = coord.take_actions()
                self.executor.execute(actions)
            except OmniloadError as exc:
                coord.handle(JobFailed(scrub(str(exc), self.secrets), Cause.ADAPTER))
            except Exception as exc:  # a bug: surface it to feeders instead of stalling them
                logger.exception("omniload data plane failed")
                text = scrub(f"internal error: {exc!r}", self.secrets)
                coord.handle(JobFailed(text, Cause.ADAPTER))
            after = (view.dealt_step, view.end_step, view.failure, view.committed_step)
            if after != before or actions:
                self._dirty = True
            if after[0] != before[0]:
                self.waiters.dealt(after[0])
            if after[1:3] != before[1:3]:
                self.waiters.wake_all()  # the stream ended or the job failed
            if self.checkpoints is not None:
                self.checkpoints.tick()
            await _yield_to_woken()

    def _step(self) -> None:
        """Commit the steps dealt in the thread, or draw the next ones and deal them
        together (:meth:`~omniload_dask.core.coordinator.Coordinator.draw_together`: up to
        :attr:`.StepDealing.at_once`; where blocks hold several steps, whole blocks)."""
        coord = self.coord
        if self._dealt_soon is not None:
            if not self._dealt_soon.done():
                return  # its completion pokes the pump
            dealing, self._dealt_soon = self._dealt_soon, None
            for done in dealing.result() or []:
                coord.commit_step(done)
            # Draw on next: a live change may have dropped every step of this dealing (a
            # redraw), so nothing moved, and no request would poke the pump again.
            self._dirty = True
            return
        if not self._drawn:
            drawn = coord.draw_step()
            if drawn is None:
                return
            if self.dealing.inline():
                dealt = self.dealing.deal_here(drawn)
                if dealt is not None:
                    coord.commit_step(dealt)
                return
            self._drawn = [drawn]
        hold = self.checkpoints is None or not self.checkpoints.snapshot_waits
        together, self._drawn = coord.draw_together(self._drawn, self.dealing.at_once, hold)
        if not together:
            return  # the rest of a block: a read's report pokes the pump
        # Off the loop; its end pokes the pump, which commits them.
        self._dealt_soon = self.dealing.start(together)
        self._dealt_soon.add_done_callback(lambda _: None if self.stopped else self.poke())

    async def final_flush(self) -> None:
        """Write the checkpoint's pending deltas now (no-op without a checkpoint)."""
        if self.checkpoints is not None:
            await self.checkpoints.final_flush()

    def stop(self) -> None:
        """Stop the data plane and release everything the job holds in the cluster."""
        self.stopped = True
        if self._pump is not None:
            self._pump.cancel()
            self._pump = None
        self.dealing.close()
        self.executor.release_all()
        self.coord.handle(JobFailed("job stopped", Cause.STOPPED))
        self.waiters.wake_all()

    def fail(self, message: str, cause: Cause) -> None:
        """Fail the job (if it has not failed yet) and wake every waiting agent."""
        self.coord.handle(JobFailed(scrub(message, self.secrets), cause))
        self.waiters.wake_all()

    # ------------------------------------------------------------------ helpers
    def _on_report(self, key: str, report: ReadReport, seconds: float | None) -> None:
        """Lengths to the coordinator (they decide the stream); the rest to the monitor."""
        lengths, patches = report.lengths, (report.patches, report.patches_sq)
        counts = (report.filtered, report.holes)
        event = ReadReported(key, lengths, report.skipped, seconds, report.records, *patches,
                             *counts, digest=report.digest)  # fmt: skip
        self.coord.handle(event)
        source = read_source(key)
        sources = len(self.coord.view.names)
        if source < sources:
            self.monitor.grow(sources)
            self.monitor.on_read(
                source,
                time.time(),
                int(report.records) if report.records is not None else len(report.lengths),
                report.tokens,
                report.read_seconds,
                report.tokenize_seconds,
                task_seconds=seconds,
                bad=report.bad,
                images=report.images,
                bad_images=report.bad_images,
            )

    def _keep_copy(self, key: str) -> None:
        """The standby policy: keys the job still holds get a second copy, if the plan asks."""
        if self.plan.loader.standby and key in self.executor.futures:
            self.executor.standby.keep(key)


async def _yield_to_woken() -> None:
    """Let the loop run what is ready, twice: agents woken while the pump ran (a block
    landed) then reply before its next run, which may draw many steps for the dealing thread
    (tens of milliseconds): with one yield, the pump's own resumption comes first."""
    await asyncio.sleep(0)
    await asyncio.sleep(0)

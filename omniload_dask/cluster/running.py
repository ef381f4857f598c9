"""A job running on the scheduler: its coordinator, its futures, and the loop that drives them.

One :class:`RunningJob` per job. Everything on it runs on the scheduler's event loop (handlers,
plugin hooks, the pump), so nothing needs a lock. Events come in from the plugin (a read or a
construction finished, a task failed, a rank asked for steps); each one *pokes* the job, and
one pump task at a time runs the data plane::

    poke()  ->  pump: coord.advance(1 step)  ->  executor.execute(actions)
                      -> checkpoint tick      ->  wake waiting ranks if a step was drawn,
                                                  or the job ended or failed
                      again while something moved, yielding to the loop in between

Ranks long-poll in :meth:`RunningJob.batches`, woken by :meth:`notify` when a step is drawn
or one of their batches reaches memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from distributed import Future

from omniload_dask.checkpoint import CheckpointWriter
from omniload_dask.cluster.checkpointing import CheckpointSchedule
from omniload_dask.cluster.executor import ActionExecutor
from omniload_dask.cluster.tasks import ReadReport
from omniload_dask.core.coordinator import Coordinator
from omniload_dask.errors import JobError, MissingJobError, OmniloadError
from omniload_dask.observe.monitoring import JobMonitor
from omniload_dask.plan import Plan

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
        self.executor = executor
        self.started = time.time()
        self.monitor = JobMonitor(len(plan.sources), self.started)
        self.checkpoints: CheckpointSchedule | None = None
        if writer is not None:
            assert plan.checkpoint is not None
            self.checkpoints = CheckpointSchedule(writer, plan.checkpoint, coord, self.poke)
        self.changed = asyncio.Event()
        self.stopped = False
        self.scheduler_closing = False  # feeders then wait for a new scheduler, not fail
        self.pumps = 0  # data-plane runs (advance + execute), for diagnostics
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
        """The futures the job holds, by key (reads and batches in memory or on their way)."""
        return self.executor.futures

    # ------------------------------------------------------------------ events
    def on_read_done(self, key: str, report: ReadReport | None, seconds: float | None) -> None:
        """A read task's shard is in memory; ``report`` carries its records' lengths."""
        if report is not None:
            self._on_report(key, report, seconds)
        self._keep_copy(key)  # shards too: a lost worker then costs no re-read

    def on_batch_done(self, key: str, seconds: float | None) -> None:
        """A constructed batch (or a context-parallel slice of one) is in memory."""
        self.notify()  # ranks long-polling for this batch can fetch it now
        if not key.rsplit("-", 1)[-1].startswith("cp"):  # slices are not constructions
            self.monitor.on_batch_built()
            if seconds is not None:
                self.coord.on_construct(seconds)
        self._keep_copy(key)

    def on_task_failed(self, key: str, text: str) -> None:
        """A task of the job failed for good: the job fails with its error."""
        self.coord.on_failure(key, text)

    def on_workers(self, workers: int, threads: int) -> None:
        """The cluster's workers changed (read quotas count their threads)."""
        self.coord.on_workers(workers, threads)
        self.poke()

    # ------------------------------------------------------------------ ranks
    async def batches(
        self,
        rank: int,
        start: int,
        count: int,
        timeout: float,
        report: dict[str, Any] | None,
        locate: Callable[[str], list[str] | None],
    ) -> dict[str, Any]:
        """Long-poll: ``rank``'s batches from ``start`` on (up to ``count``) that are in memory.

        ``locate(key)`` names the workers holding a key in memory (None: not in memory). The
        reply holds the keys ready, in step order, and who has each; the wait ends when at
        least one is ready, the stream ended, or ``timeout`` seconds passed.
        """
        coord = self.coord
        now = time.time()
        coord.on_request(rank, start, count, now)
        self.monitor.on_progress(now, min(r.position for r in coord.ranks.values()))
        if report is not None:
            self.monitor.on_feeder(rank, now, report)
        self.poke()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, float(timeout))
        while True:
            if self.scheduler_closing:  # retried by feeders: the job may resume on a new one
                raise MissingJobError(f"job {self.name!r}: the scheduler is shutting down")
            if coord.error:
                raise JobError(f"job {self.name!r} failed: {coord.error}")
            keys = []
            for step in range(start, start + count):
                key = coord.batch_for(rank, step)
                if key is None:
                    break
                keys.append(key)
            if coord.has_actions():
                self.poke()  # batch_for queued a rebuild of a released step
            ready, who_has = [], {}
            for key in keys:
                where = locate(key)
                if where is None:
                    break
                ready.append(key)
                who_has[key] = where
            remaining = deadline - loop.time()
            ended = coord.end_step is not None and start + len(ready) >= coord.end_step
            if ready or remaining <= 0 or ended:
                break
            if self.stopped:
                raise JobError(f"job {self.name!r} was stopped")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.changed.wait(), remaining)
        return {"start": start, "keys": ready, "who_has": who_has, "end": coord.end_step}

    def notify(self) -> None:
        """Wake every rank waiting in :meth:`batches`."""
        self.changed.set()
        self.changed = asyncio.Event()

    # ------------------------------------------------------------------ the data plane
    def poke(self) -> None:
        """Have the pump run the data plane soon (runs coalesce: one pump at a time)."""
        self._dirty = True
        if self._pump is None or self._pump.done():
            self._pump = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        """The pump: run the data plane while something may have moved."""
        coord = self.coord
        while self._dirty and not self.stopped:
            self._dirty = False
            self.pumps += 1
            before = (coord.next_step, coord.end_step, coord.error)
            actions: list[Any] = []
            try:
                actions = coord.advance(max_steps=1)
                self.executor.execute(actions)
            except OmniloadError as exc:
                coord.error = coord.error or str(exc)
            except Exception as exc:  # a bug: surface it to feeders instead of stalling them
                logger.exception("omniload data plane failed")
                coord.error = coord.error or f"internal error: {exc!r}"
            moved = (coord.next_step, coord.end_step, coord.error) != before
            if moved or actions:
                self._dirty = True
            if self.checkpoints is not None:
                self.checkpoints.tick()
            if moved:
                # Waiting feeders look again only when a step was drawn or the job ended or
                # failed (a batch reaching memory wakes them in ``on_batch_done``): waking
                # them on every pump would have them poke the pump again, a busy loop while
                # reads run.
                self.notify()
            await asyncio.sleep(0)

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
        self.executor.release_all()
        self.coord.error = self.coord.error or "job stopped"
        self.notify()

    # ------------------------------------------------------------------ helpers
    def _on_report(self, key: str, report: ReadReport, seconds: float | None) -> None:
        """Lengths to the coordinator (they decide the stream); the rest to the monitor."""
        coord = self.coord
        coord.on_report(
            key,
            report.lengths,
            report.skipped,
            seconds=seconds,
            records=report.records,
            patches=report.patches,
            patches_sq=report.patches_sq,
        )
        source = int(key.split("-")[3])
        if source < len(coord.streams):
            self.monitor.grow(len(coord.streams))
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

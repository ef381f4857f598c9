"""The data plane on the Dask scheduler: a thin adapter over :class:`Coordinator`.

It registers RPC handlers under one prefix (``omniload_*``, called as
``client.scheduler.omniload_batches(...)``), checks their arguments, and hands each call to the
part that owns it; scheduler events (the ``transition`` hooks, which carry read tasks' sample
lengths, and workers coming and going) go to the running job they belong to. Handlers and hooks
run on the scheduler's single event loop, so nothing needs locks.

Who does what behind the handlers::

    omniload_start                     start a job, or join the running one   lifecycle
    omniload_batches                   an agent's parts of the next steps in   RunningJob
                                       memory, who has them (long-poll)
    omniload_set_weights, _update_plan live changes                            coordinator,
                                                                               lifecycle
    omniload_stats, _mixture, _steps,  figures                                 stats
    _workers_wanted
    omniload_info, _jobs, _stop,       job control                             this module,
    _flush_checkpoint                                                          RunningJob
    omniload_stream_pass               a pass over a further stream (its own   streams
                                       job: started, joined, old ones stopped)
    transition / add_worker / ...      tasks done or failed, workers changed   RunningJob

A watchdog checks the data plane's own client every second: one that lost its connection is
replaced, and every job submits what it held again (never a silent stall); if no new client
can connect, the jobs fail with an error that says so.

Register it from a client (``Client.register_plugin(OmniloadPlugin())``, what :class:`Job`
does) or preload it: ``dask scheduler --preload omniload_dask.preload``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Sequence
from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin

from omniload_dask.cluster import lifecycle, stats
from omniload_dask.cluster import sizeof as _sizeof  # noqa: F401  (registers batch sizes)
from omniload_dask.cluster.arguments import MAX_TIMEOUT, optional_step, resume_arguments
from omniload_dask.cluster.arguments import integer as _integer
from omniload_dask.cluster.arguments import number as _number
from omniload_dask.cluster.arguments import weights as _weights
from omniload_dask.cluster.running import RunningJob
from omniload_dask.cluster.standby import StandbyCopies
from omniload_dask.cluster.streams import StreamPasses
from omniload_dask.cluster.tasks import ReadReport
from omniload_dask.cluster.watchdog import watch_client
from omniload_dask.core import keys
from omniload_dask.errors import JobError, MissingJobError
from omniload_dask.internals import forgetting
from omniload_dask.internals import server as _server
from omniload_dask.plan import parse_plan

__all__ = ["HANDLER_PREFIX", "OmniloadPlugin"]

logger = logging.getLogger(__name__)
HANDLER_PREFIX = "omniload_"
_JOB_EVENTS = frozenset({"memory", "erred"})  # the transitions' ends a job hears of


class OmniloadPlugin(SchedulerPlugin):
    """Holds every job's data plane on the scheduler (one copy of all cursors).

    ``jobs`` maps each running job's name to its :class:`RunningJob`.
    """

    name = "omniload"
    idempotent = True

    def __init__(self) -> None:
        self.scheduler: Any = None
        self.jobs: dict[str, RunningJob] = {}
        self._runs: dict[str, str] = {}  # run id -> job name
        self._passes = StreamPasses(self)  # passes over further streams, as jobs of their own
        self._client: lifecycle.DataPlaneClient | None = None
        self._standby: StandbyCopies | None = None
        # Resources every read task asks for (None: the workers lack the read resource);
        # decided when workers come and go, not per submitted read.
        self._read_resources: dict[str, int] | None = None
        self._watchdog: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ plugin hooks
    async def start(self, scheduler: Any) -> None:
        """Install the handlers, the standby policy, the dashboard page and the metrics."""
        self.scheduler = scheduler
        self._client = lifecycle.DataPlaneClient(scheduler)
        self._workers_changed()  # workers already there when the plugin is registered
        _server.add_handlers(
            scheduler,
            HANDLER_PREFIX,
            {
                "start": self.start_job,
                "batches": self.batches,
                "info": self.job_info,
                "set_weights": self.set_weights,
                "update_plan": self.update_plan,
                "mixture": self.mixture,
                "stats": self.stats,
                "steps": self.steps,
                "workers_wanted": self.workers_wanted,
                "jobs": self.list_jobs,
                "stop": self.stop_job,
                "flush_checkpoint": self.flush_checkpoint,
                "stream_pass": self._passes.handle,
            },
        )
        self._standby = StandbyCopies(scheduler)
        self._watchdog = asyncio.get_running_loop().create_task(
            watch_client(scheduler, self._client, lambda: list(self.jobs.values()))
        )
        try:  # watching must never keep the data plane from starting
            from omniload_dask.observe import dashboard

            dashboard.install(scheduler, self)
        except Exception:
            logger.exception("omniload: could not add the dashboard page or metrics")

    async def before_close(self) -> None:
        """Flush every job's checkpoint and stop the jobs; feeders wait for a new scheduler."""
        from omniload_dask.observe import metrics

        metrics.unregister(self)
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        for job in list(self.jobs.values()):
            with contextlib.suppress(Exception):
                await job.final_flush()
            job.scheduler_closing = True  # feeders wait for a new scheduler, not fail
            self._drop(job)
        if self._client is not None:
            await self._client.close()

    async def close(self) -> None:
        """As :meth:`before_close` (a scheduler may call either)."""
        await self.before_close()

    def transition(self, key: Any, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        """Hand a job's task reaching memory, or failing, to the job it belongs to."""
        # Every transition of every task comes here: all but the job's return at the first test.
        if finish not in _JOB_EVENTS or not keys.is_data_key(key):
            return
        job = self._job_of_key(key)
        if job is None:
            return
        if finish == "memory" and keys.is_read(key):
            meta = _server.metadata_of(kwargs)
            report = ReadReport.decode(meta) if meta is not None else None
            job.on_read_done(key, report, _server.task_duration(kwargs))
        elif finish == "memory" and keys.is_batch(key):
            job.on_batch_done(key, _server.task_duration(kwargs))
            forgetting.trim_key_cache()  # once per block: Dask keeps a little of each new key
            forgetting.trim_span_metadata(self.scheduler, key)
        elif finish == "erred":
            job.on_task_failed(key, _server.failure_text(self.scheduler, key, kwargs))
        else:
            return
        job.poke()

    def add_worker(self, scheduler: Any, worker: str) -> None:
        """A worker joined: read slots change."""
        self._workers_changed()

    def remove_worker(self, scheduler: Any, worker: str, **kwargs: Any) -> None:
        """A worker left (or was lost): read slots change; the others stop fetching from it
        and the standby copies it held are replaced."""
        self._workers_changed()
        if self._standby is not None and self.jobs:
            self._standby.worker_lost(worker)

    def _workers_changed(self) -> None:
        """Read quotas count the workers' read slots: tell every job (a Dask cluster's ``scale`` and losses)."""
        workers, read_slots = _server.worker_threads(self.scheduler)
        resource = _server.read_resource(self.scheduler)
        self._read_resources = {_server.READ_RESOURCE: 1} if resource else None
        for job in self.jobs.values():
            job.on_workers(workers, read_slots)

    # ------------------------------------------------------------------ job control
    async def start_job(
        self,
        plan: dict[str, Any],
        start_step: int = 0,
        resume: bool | int | None = None,
        resume_unverified: bool = False,
    ) -> dict[str, Any]:
        """Start a job from a resolved plan, or return the running one with the same plan.

        ``resume``: True to continue from the plan's checkpoint (at the slowest rank's saved
        position), a step number to continue from that step, None/False for a fresh job (which
        refuses a checkpoint URL that already holds a checkpoint; ``resume_unverified``: one
        whose manifest lacks its digest, logged). ``start_step`` starts the ranks of a fresh
        job at that step: earlier steps are drawn again but not built.
        """
        parsed = parse_plan(plan)
        start_step = _integer("start_step", start_step)
        resume, unverified = resume_arguments(resume, resume_unverified)
        running = self.jobs.get(parsed.name)
        if running is not None:
            lifecycle.check_same_job(running, parsed)
            return running.info
        assert self._client is not None and self._standby is not None
        run_id = uuid.uuid4().hex[:8]
        prepared = await lifecycle.prepare(self._client, parsed, run_id, resume, unverified)
        if parsed.name in self.jobs:  # another caller started it while we discovered
            return self.jobs[parsed.name].info
        job = await lifecycle.open_job(
            await self._client.get(),
            prepared,
            start_step,
            standby=self._standby,
            read_resources=lambda: self._read_resources,
            workers=lambda: _server.worker_threads(self.scheduler),
        )
        self.jobs[job.name] = job
        self._runs[job.run_id] = job.name
        job.poke()
        logger.info("omniload job %s started (run %s)", job.name, job.run_id)
        return job.info

    def job_info(self, job: str) -> dict[str, Any]:
        """What :meth:`start_job` returned, with the sources and batch as they are now."""
        return lifecycle.job_info(self._job(job), self.scheduler)

    def list_jobs(self) -> list[str]:
        """The names of the running jobs (a further stream's pass is one of its own)."""
        return sorted(self.jobs)

    async def stop_job(self, job: str) -> bool:
        """Stop a job; its checkpoint gets a last flush first. False if no such job runs."""
        run = self.jobs.get(job)
        if run is None:
            return False
        await run.final_flush()
        self._drop(run)
        await self._passes.stop_all(job)  # its streams' passes go with it
        return True

    async def flush_checkpoint(self, job: str) -> dict[str, Any] | None:
        """Write the job's pending checkpoint deltas now; return the checkpoint's figures."""
        run = self._job(job)
        await run.final_flush()
        return run.checkpoints.stats() if run.checkpoints is not None else None

    # ------------------------------------------------------------------ ranks
    async def batches(
        self,
        job: str,
        rank: int | None = None,
        start: int = 0,
        count: int = 1,
        timeout: float = 2.0,
        report: dict[str, Any] | None = None,
        ranks: Sequence[int] | None = None,
        parts: Sequence[Sequence[int]] | None = None,
    ) -> dict[str, Any]:
        """Long-poll for a fetching agent: its parts of the steps from ``start`` on (up to
        ``count``) that are in memory.

        The agent serves ``ranks`` (or the one ``rank``) and wants the parts ``parts``, each
        ``[DP group, cp rank]`` (default: what its ranks fetch). The reply holds per ready
        step one ``[block key, part]`` per part asked, and the workers holding each block
        (``who_has``), for the agent to fetch straight from them. Asking also says that the
        agent's ranks have fetched every step below ``start``: the data plane holds a block
        until every rank of its groups has said so, so the parts given out stay in memory (or
        are recomputed) until then. ``report`` carries the agent's own figures for monitoring
        (see ``FeederReport``).
        """
        run = self._job(job)
        ranks, needs = _agent(run, rank, ranks, parts)
        start, count = _integer("start", start), _integer("count", count)
        timeout = _number("timeout", timeout, maximum=MAX_TIMEOUT)
        return await run.batches(
            ranks,
            needs,
            start,
            count,
            timeout,
            report,
            lambda key: _server.holders(self.scheduler, key),
        )

    # ------------------------------------------------------------------ live changes
    def set_weights(
        self, job: str, weights: dict[str, float], at_step: int | None = None
    ) -> dict[str, Any]:
        """Change source weights live from ``at_step`` (default: the first step not built)."""
        run = self._job(job)
        scheduled = run.coord.set_weights(_weights(weights), optional_step("at_step", at_step))
        run.poke()
        return {"step": scheduled.step, "weights": scheduled.weights}

    async def update_plan(
        self, job: str, plan: dict[str, Any], at_step: int | None = None
    ) -> dict[str, Any]:
        """Apply a new version of the job's plan live: sources, weights, stages (``batch``).

        Sources keep their names (and cursors); other fields must stay as they are.
        """
        run = self._job(job)
        at_step = optional_step("at_step", at_step)
        new = lifecycle.with_known_credentials(run, parse_plan(plan))
        change = lifecycle.plan_change(run, new, at_step)
        run.secrets |= new.secrets()
        assert self._client is not None
        client = await self._client.get()
        catalogs = await lifecycle.discover_added(client, run, new, change.added)
        step, stages = lifecycle.apply_change(run, new, change, catalogs, at_step)
        run.poke()
        return {
            "step": step,
            "added": [s.name for s in change.added],
            "removed": change.removed,
            "weights": change.weights,
            "stages": stages,
        }

    # ------------------------------------------------------------------ figures
    def stats(self, job: str) -> dict[str, Any]:
        """The job's counters and figures (plain data): what every monitoring view shows."""
        return stats.job_stats(self._job(job), self.scheduler)

    def mixture(self, job: str, window: int = 100) -> list[dict[str, Any]]:
        """Per source: target and realised share, per window and overall."""
        return stats.mixture(self._job(job), _integer("mixture: window", window, minimum=1))

    def steps(self, job: str, start: int = 0) -> list[dict[str, Any]]:
        """Figures of the recent steps (efficiency, tokens per source, micro-steps)."""
        return stats.steps(self._job(job), _integer("start", start))

    def workers_wanted(self, job: str | None = None) -> dict[str, Any]:
        """Workers that keep the job's trainers fed (every job's if none is named): what
        :class:`~omniload_dask.cluster.adaptive.OmniloadAdaptive` offers Dask's adaptive scaling."""
        runs = [self._job(job)] if job is not None else list(self.jobs.values())
        return stats.workers_wanted(runs, self.scheduler)

    # ------------------------------------------------------------------ helpers
    def _job(self, name: str) -> RunningJob:
        """The running job ``name``; MissingJobError (feeders retry it) naming those that run."""
        run = self.jobs.get(name)
        if run is None:
            have = ", ".join(sorted(self.jobs)) or "none"
            raise MissingJobError(f"no omniload job named {name!r} here (running: {have})")
        return run

    def _job_of_key(self, key: str) -> RunningJob | None:
        """The running job a task key belongs to, by the run id in it (None: an old run's)."""
        run_id = keys.run_of(key)
        name = self._runs.get(run_id) if run_id is not None else None
        return self.jobs.get(name) if name else None

    def _drop(self, job: RunningJob) -> None:
        """Forget ``job`` and stop it (its tasks' events are ignored from now on)."""
        if self.jobs.get(job.name) is job:
            del self.jobs[job.name]
        self._runs.pop(job.run_id, None)
        job.stop()


def _agent(
    run: RunningJob,
    rank: Any,
    ranks: Any,
    parts: Any,
) -> tuple[list[int], list[tuple[int, int]]]:
    """The ranks a request serves and the parts it wants (default: what its ranks fetch)."""
    if ranks is None:
        if rank is None:
            raise JobError("batches: give rank or ranks")
        ranks = [rank]
    elif not isinstance(ranks, (list, tuple)) or not ranks:
        raise JobError(f"ranks must be a non-empty list of ranks, got {ranks!r}")
    checked = [_integer("rank", r) for r in ranks]
    layout = run.plan.layout
    if parts is None:
        run.coord.view.check_ranks(checked)
        coords = [layout.coords(r) for r in checked]
        return checked, list(dict.fromkeys((c["dp"], c["cp"]) for c in coords))
    if not isinstance(parts, (list, tuple)) or not parts:
        raise JobError(f"parts must be a non-empty list of [DP group, cp rank], got {parts!r}")
    return checked, [_need(p, layout.dp, layout.cp) for p in parts]


def _need(value: Any, dp: int, cp: int) -> tuple[int, int]:
    """A part an agent asks for: ``[DP group, cp rank]`` within the layout (errors name it)."""
    if (
        not isinstance(value, (list, tuple))
        or len(value) != 2
        or any(isinstance(v, bool) or not isinstance(v, int) for v in value)
        or not (0 <= value[0] < dp and 0 <= value[1] < cp)
    ):
        raise JobError(
            f"parts: each must be [DP group, cp rank] with group < {dp} and cp rank < {cp}, "
            f"got {value!r}"
        )
    return int(value[0]), int(value[1])

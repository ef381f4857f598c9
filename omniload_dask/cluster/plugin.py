"""The data plane on the Dask scheduler: a thin adapter over :class:`Coordinator`.

It registers RPC handlers under one prefix (``omniload_*``, called as
``client.scheduler.omniload_batches(...)``), turns scheduler events into coordinator events
(``transition`` hooks carry read tasks' sample lengths), and carries out the coordinator's
actions with a client of its own that lives on the scheduler's event loop. Handlers and hooks
run on that single loop, so the coordinator needs no locks.

Register it from a client (``Client.register_plugin(OmniloadPlugin())``, what :class:`Job`
does) or preload it: ``dask scheduler --preload omniload_dask.preload``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import defaultdict, deque
from typing import Any

import numpy as np
from distributed import Client, Future
from distributed.diagnostics.plugin import SchedulerPlugin

from omniload_dask.checkpoint.store import (
    Checkpoint,
    CheckpointWriter,
    apply_new_plan,
    check_catalogs,
    load_for_resume,
    registry_plan,
)
from omniload_dask.cluster import internals as _dask
from omniload_dask.cluster import sizeof as _sizeof  # noqa: F401  (registers batch sizes)
from omniload_dask.cluster import tasks
from omniload_dask.core import autoscale
from omniload_dask.core.actions import ReadSpec, Release, SubmitConstruct, SubmitRead
from omniload_dask.core.coordinator import Coordinator
from omniload_dask.errors import CheckpointError, JobError, MissingJobError, OmniloadError
from omniload_dask.observe.monitoring import JobMonitor, realised_shares
from omniload_dask.plan import Plan, parse_plan

__all__ = ["HANDLER_PREFIX", "OmniloadPlugin"]

logger = logging.getLogger(__name__)
HANDLER_PREFIX = "omniload_"
KEY_PREFIX = "omniload-"
DISCOVERY_TIMEOUT = 120.0
SHARE_WINDOW = 64  # steps behind a source's realised share in stats()
# Worker queues run higher priorities first: constructions (short, wanted now), then reads a
# draw waits for, then reads ahead, those needed in fewer steps first.
READ_PRIORITY, URGENT_READ_PRIORITY, CONSTRUCT_PRIORITY = 0, 5, 10
LEAD_LEVELS = 1000  # read-ahead priorities go down to READ_PRIORITY - LEAD_LEVELS


class _Job:
    """A running job: its coordinator, the futures it holds, and its wake-up machinery."""

    def __init__(self, plan: Plan, coord: Coordinator, info: dict[str, Any]) -> None:
        self.plan = plan
        self.coord = coord
        self.info = info
        self.futures: dict[str, Future] = {}
        self.changed = asyncio.Event()
        self.dirty = False
        self.pump: asyncio.Task[None] | None = None
        self.pumps = 0  # data-plane runs (advance + execute), for diagnostics
        self.scheduler_closing = False
        self.started = time.time()
        self.bad: defaultdict[int, deque[str]] = defaultdict(lambda: deque(maxlen=5))
        self.batches_built = 0
        self.read_seconds: defaultdict[int, float] = defaultdict(float)
        self.reads_done: defaultdict[int, int] = defaultdict(int)
        self.images_read: defaultdict[int, int] = defaultdict(int)
        self.bad_images: defaultdict[int, int] = defaultdict(int)
        self.monitor = JobMonitor(len(plan.sources), self.started)
        self.writer: CheckpointWriter | None = None
        self.checkpoint_error: str | None = None
        self.flushing: asyncio.Future[Any] | None = None
        self.last_flush = time.monotonic()

    def notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()


class OmniloadPlugin(SchedulerPlugin):
    """Holds every job's data plane on the scheduler (one copy of all cursors)."""

    name = "omniload"
    idempotent = True

    def __init__(self) -> None:
        self.scheduler: Any = None
        self.jobs: dict[str, _Job] = {}
        self._runs: dict[str, str] = {}  # run id -> job name
        self._client: Client | None = None
        self._client_lock: asyncio.Lock | None = None
        self._standby: Any = None  # AMM policy keeping second copies of upcoming batches
        self._amm_soon = False
        # Resources every read task asks for (None: the workers lack the read resource);
        # decided when workers come and go, not per submitted read.
        self._read_resources: dict[str, int] | None = None

    # ------------------------------------------------------------------ plugin hooks
    async def start(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self._client_lock = asyncio.Lock()
        self._workers_changed()  # workers already there when the plugin is registered
        handlers = {
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
        }
        for name, handler in handlers.items():
            scheduler.handlers[HANDLER_PREFIX + name] = handler
        self._standby = _dask.install_standby(scheduler, _is_standby_key)
        try:  # watching must never keep the data plane from starting
            from omniload_dask.observe import dashboard

            dashboard.install(scheduler, self)
        except Exception:
            logger.exception("omniload: could not add the dashboard page or metrics")

    async def before_close(self) -> None:
        from omniload_dask.observe import metrics

        metrics.unregister(self)
        for job in list(self.jobs.values()):
            with contextlib.suppress(Exception):
                await self._final_flush(job)
            job.scheduler_closing = True  # feeders wait for a new scheduler, not fail
            self._drop(job)
        if self._client is not None:
            client, self._client = self._client, None
            await client.close()

    async def close(self) -> None:
        await self.before_close()

    def transition(self, key: Any, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        if not isinstance(key, str) or not key.startswith(KEY_PREFIX):
            return
        job = self._job_of_key(key)
        if job is None:
            return
        if finish == "memory" and key.startswith("omniload-read-"):
            meta = _dask.metadata_of(kwargs)
            if meta is not None:
                self._on_report(job, key, meta, _dask.task_duration(kwargs))
            if job.plan.loader.standby and key in job.futures:
                self._keep_standby(key)  # shards too: a lost worker then costs no re-read
        elif finish == "memory" and key.startswith("omniload-batch-"):
            job.notify()  # ranks long-polling for this batch can fetch it now
            if not key.rsplit("-", 1)[-1].startswith("cp"):  # slices are not constructions
                job.batches_built += 1
                seconds = _dask.task_duration(kwargs)
                if seconds is not None:
                    job.coord.on_construct(seconds)
            if job.plan.loader.standby and key in job.futures:
                self._keep_standby(key)
        elif finish == "erred":
            text = kwargs.get("exception_text") or _dask.erred_text(self.scheduler, key) or "failed"
            job.coord.on_failure(key, str(text))
        else:
            return
        self._poke(job)

    def add_worker(self, scheduler: Any, worker: str) -> None:
        self._workers_changed()

    def remove_worker(self, scheduler: Any, worker: str, **kwargs: Any) -> None:
        self._workers_changed()

    def _workers_changed(self) -> None:
        """Read quotas count worker threads: tell every job (``cluster.scale`` and losses)."""
        workers, threads = _dask.worker_threads(self.scheduler)
        resource = _dask.read_resource(self.scheduler)
        self._read_resources = {_dask.READ_RESOURCE: 1} if resource else None
        for job in self.jobs.values():
            job.coord.on_workers(workers, threads)
            self._poke(job)

    # ------------------------------------------------------------------ handlers
    async def start_job(
        self, plan: dict[str, Any], start_step: int = 0, resume: bool | int | None = None
    ) -> dict[str, Any]:
        """Start a job from a resolved plan, or return the running one with the same plan.

        ``resume``: True to continue from the plan's checkpoint (at the slowest rank's saved
        position), a step number to continue from that step, None/False for a fresh job (which
        refuses a checkpoint URL that already holds a checkpoint). ``start_step`` starts the
        ranks of a fresh job at that step: earlier steps are drawn again but not built.
        """
        parsed = parse_plan(plan)
        start_step = _integer("start_step", start_step)
        if resume is not None and not isinstance(resume, bool):
            resume = _integer("resume", resume)
        running = self.jobs.get(parsed.name)
        if running is not None:
            if (
                running.plan.stream_fingerprint() != parsed.stream_fingerprint()
                or running.plan.layout != parsed.layout
            ):
                raise JobError(
                    f"job {parsed.name!r} already runs with another plan or layout; "
                    "stop it first or give the plan another name"
                )
            return running.info
        if resume is not None and resume is not False and parsed.checkpoint is None:
            raise CheckpointError(f"job {parsed.name!r}: resume needs checkpoint.url in the plan")
        client = await self._get_client()
        run_id = uuid.uuid4().hex[:8]
        loop = asyncio.get_running_loop()
        saved: Checkpoint | None = None
        state = None
        sources = parsed
        if resume is not None and resume is not False:
            assert parsed.checkpoint is not None
            saved, state = await loop.run_in_executor(None, load_for_resume, parsed, resume)
            sources = registry_plan(parsed, state)
        catalogs, tokenizer = await self._discover(client, sources, run_id)
        if parsed.name in self.jobs:  # another caller started it while we discovered
            return self.jobs[parsed.name].info
        coord = Coordinator(sources, catalogs, run_id, start_step=start_step)
        if state is not None:
            assert saved is not None
            check_catalogs(state, catalogs)
            coord.load_state_dict(state)
            if saved.plan.stream_fingerprint() != parsed.stream_fingerprint():
                apply_new_plan(coord, parsed, catalogs)
        writer = None
        if parsed.checkpoint is not None:
            spec = parsed.checkpoint
            writer = CheckpointWriter(
                spec.url,
                parsed,
                compact_every=spec.compact_every,
                keep_bases=spec.keep_bases,
                storage_options=dict(spec.storage_options),
            )
            await loop.run_in_executor(None, writer.start, coord.state_dict(), saved)
            coord.take_deltas()  # the base holds them
        info = {
            "name": parsed.name,
            "run_id": run_id,
            "plan": parsed.to_dict(),
            "sources": coord.names,
            "files": [len(c.files) for c in catalogs],
            "units": [c.num_units for c in catalogs],
            "bytes": [c.total_bytes for c in catalogs],
            "tokenizer": tokenizer,
            "start_step": coord.next_step if state is not None else start_step,
            "resumed": state is not None,
        }
        job = _Job(parsed, coord, info)
        workers, threads = _dask.worker_threads(self.scheduler)
        if threads:
            coord.on_workers(workers, threads)
        job.writer = writer
        self.jobs[parsed.name] = job
        self._runs[run_id] = parsed.name
        self._poke(job)
        logger.info("omniload job %s started (run %s)", parsed.name, run_id)
        return info

    async def batches(
        self,
        job: str,
        rank: int,
        start: int,
        count: int,
        timeout: float = 2.0,
        report: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Long-poll: ``rank``'s batches from ``start`` on (up to ``count``) that are in memory.

        Replies with their keys and the workers holding each (``who_has``), for the feeder to
        fetch straight from them. Also says that ``rank`` has fetched every step below
        ``start``: the data plane holds a batch until every rank of its group has said so, so
        the keys given out stay in memory (or are recomputed) until then.
        ``report`` carries the feeder's own figures for monitoring (see ``FeederReport``).
        """
        run = self._job(job)
        rank, start = _integer("rank", rank), _integer("start", start)
        count, timeout = _integer("count", count), _number("timeout", timeout)
        now = time.time()
        run.coord.on_request(rank, start, count, now)
        run.monitor.on_progress(now, min(r.position for r in run.coord.ranks.values()))
        if report is not None:
            run.monitor.on_feeder(int(rank), now, report)
        self._poke(run)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, float(timeout))
        while True:
            if run.scheduler_closing:  # retried by feeders: the job may resume on a new one
                raise MissingJobError(f"job {job!r}: the scheduler is shutting down")
            if run.coord.error:
                raise JobError(f"job {job!r} failed: {run.coord.error}")
            keys = []
            for step in range(start, start + count):
                key = run.coord.batch_for(int(rank), step)
                if key is None:
                    break
                keys.append(key)
            if run.coord.has_actions():
                self._poke(run)  # batch_for queued a rebuild of a released step
            ready, who_has = [], {}
            for key in keys:
                where = _dask.holders(self.scheduler, key)
                if where is None:
                    break
                ready.append(key)
                who_has[key] = where
            remaining = deadline - loop.time()
            ended = run.coord.end_step is not None and start + len(ready) >= run.coord.end_step
            if ready or remaining <= 0 or ended:
                break
            if self.jobs.get(job) is not run:
                raise JobError(f"job {job!r} was stopped")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(run.changed.wait(), remaining)
        return {"start": start, "keys": ready, "who_has": who_has, "end": run.coord.end_step}

    def set_weights(
        self, job: str, weights: dict[str, float], at_step: int | None = None
    ) -> dict[str, Any]:
        """Change source weights live from ``at_step`` (default: the first undrawn step)."""
        run = self._job(job)
        if not isinstance(weights, dict):
            raise JobError(
                f"set_weights: weights must be a mapping of source to weight, got {weights!r}"
            )
        step = run.coord.set_weights(dict(weights), at_step)
        self._poke(run)
        return {"step": step, "weights": run.coord.log[-1]["weights"]}

    async def update_plan(
        self, job: str, plan: dict[str, Any], at_step: int | None = None
    ) -> dict[str, Any]:
        """Apply a new version of the job's plan live: sources added or removed, weights.

        Sources keep their names (and cursors); other fields must stay as they are.
        """
        run = self._job(job)
        new = parse_plan(plan)
        old = run.plan
        for field in ("seed", "tokenizer", "batch", "layout", "cost", "on_error", "images"):
            if getattr(new, field) != getattr(old, field):
                raise JobError(
                    f"update_plan: {field} cannot change while the job runs (start a new job)"
                )
        if new.mixing.by != old.mixing.by:
            raise JobError("update_plan: mixing.by cannot change while the job runs")
        live = {s.spec.name: s for s in run.coord.streams if not s.retired}
        for spec in new.sources:
            stream = live.get(spec.name)
            if stream is not None and (
                stream.spec.paths,
                stream.spec.format,
                stream.spec.text,
                stream.spec.image,
            ) != (spec.paths, spec.format, spec.text, spec.image):
                raise JobError(
                    f"update_plan: source {spec.name!r} changed its path, format, "
                    "text or image field; add it under a new name instead"
                )
        added = [s for s in new.sources if s.name not in live]
        removed = [n for n in live if n not in new.source_names]
        client = await self._get_client()
        catalogs = []
        if added:
            futures = [
                client.submit(
                    tasks.discover,
                    spec,
                    retries=new.loader.read_retries,
                    key=f"omniload-discover-{run.info['run_id']}-{spec.name}-{len(run.coord.log)}",
                    priority=100,
                )
                for spec in added
            ]
            try:
                catalogs = await asyncio.wait_for(client.gather(futures), DISCOVERY_TIMEOUT)
            finally:
                for fut in futures:
                    fut.release()
        step = at_step if at_step is not None else run.coord.next_step
        for spec, catalog in zip(added, catalogs, strict=True):
            step = run.coord.add_source(spec, catalog, step)
        for name in removed:
            step = run.coord.remove_source(name, step)
        changed = {
            s.name: s.weight
            for s in new.sources
            if s.name in live and live[s.name].spec.weight != s.weight
        }
        if changed:
            step = run.coord.set_weights(changed, step)
        self._poke(run)
        return {
            "step": step,
            "added": [s.name for s in added],
            "removed": removed,
            "weights": changed,
        }

    def mixture(self, job: str, window: int = 100) -> list[dict[str, Any]]:
        """Per source: target and realised share, per window and overall."""
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise JobError(f"mixture: window must be an integer >= 1, got {window!r}")
        return self._job(job).coord.mixture(window)

    def job_info(self, job: str) -> dict[str, Any]:
        """What :meth:`start_job` returned (resolved plan, files, tokenizer), with the sources
        as they are now (live changes add sources at the end)."""
        run = self._job(job)
        return {**run.info, "sources": run.coord.names}

    def stats(self, job: str) -> dict[str, Any]:
        """The job's counters and figures (plain data): what every monitoring view shows."""
        run = self._job(job)
        out = run.coord.stats()
        now = time.time()
        mon = run.monitor
        mon.grow(len(out["sources"]))
        records_rate, tokens_rate = mon.rates(now)
        recent = list(run.coord.history)[-SHARE_WINDOW:]
        _, _, realised = realised_shares(
            recent, len(out["sources"]), run.plan.mixing_by, SHARE_WINDOW
        )
        weights = np.asarray([s["weight"] for s in out["sources"]], dtype=np.float64)
        shares = weights / weights.sum() if weights.sum() > 0 else weights
        for i, src in enumerate(out["sources"]):
            src["bad_examples"] = list(run.bad[i])
            src["reads_done"] = run.reads_done[i]
            src["read_seconds"] = round(run.read_seconds[i], 3)
            src["target_share"] = float(shares[i])
            src["realised_share"] = float(realised[-1, i]) if len(realised) else None
            src["records_read"] = int(mon.records[i])
            src["tokens_read"] = int(mon.read_tokens[i])
            src["decode_seconds"] = round(float(mon.read_seconds[i]), 4)
            src["tokenize_seconds"] = round(float(mon.tokenize_seconds[i]), 4)
            src["records_per_s"] = float(records_rate[i])
            src["tokens_per_s"] = float(tokens_rate[i])
            src["images_read"] = run.images_read[i]
            src["bad_images"] = run.bad_images[i]
        for rank, state in out["ranks"].items():
            fed = mon.feeders.get(int(rank))
            if fed is not None:
                state.update(
                    wait_p50=fed.wait_p50,
                    wait_p99=fed.wait_p99,
                    buffered=fed.buffered,
                    prefetch=fed.prefetch,
                    reported_ago=now - fed.time,
                )
        start_step = int(run.info.get("start_step", 0))
        slowest = min((r["position"] for r in out["ranks"].values()), default=start_step)
        out.update(
            name=job,
            run_id=run.info["run_id"],
            uptime=time.time() - run.started,
            workers=_dask.worker_count(self.scheduler),
            futures_held=len(run.futures),
            batches_built=run.batches_built,
            data_plane_runs=run.pumps,
            scheduler_tasks=len(self.scheduler.tasks),
            mixing_by=run.plan.mixing_by,
            start_step=start_step,
            steps_fetched=max(0, slowest - start_step),
            steps_per_second=mon.steps_per_second(now),
            prefetch=run.plan.loader.prefetch,
        )
        out["checkpoint"] = run.writer.stats() if run.writer is not None else None
        if run.checkpoint_error:
            out["checkpoint_error"] = run.checkpoint_error
        return out

    def workers_wanted(self, job: str | None = None) -> dict[str, Any]:
        """Workers that keep the job's trainers fed (every job's if none is named): what
        :class:`~omniload_dask.cluster.adaptive.OmniloadAdaptive` offers Dask's adaptive scaling."""
        runs = [self._job(job)] if job is not None else list(self.jobs.values())
        workers, threads = _dask.worker_threads(self.scheduler)
        per_worker = threads / workers if workers else 1.0
        now = time.time()
        out: dict[str, Any] = {"workers": workers, "wanted": 0, "jobs": {}}
        for run in runs:
            work = run.coord.work_per_step()
            rate = run.monitor.steps_per_second(now)
            waits = [f.wait_p50 for f in run.monitor.feeders.values() if f.wait_p50 is not None]
            wait = max(waits, default=0.0) * run.plan.batch.micro_batches
            wanted = autoscale.recommend_workers(work, rate, wait, per_worker, workers)
            out["jobs"][run.plan.name] = {
                "wanted": wanted,
                "work_per_step": work,
                "steps_per_second": rate,
                "wait_per_step": wait,
            }
            out["wanted"] = max(out["wanted"], wanted)
        return out

    def steps(self, job: str, start: int = 0) -> list[dict[str, Any]]:
        """Figures of the recent steps (efficiency, tokens per source, micro-steps)."""
        run = self._job(job)
        return [vars(f) for f in run.coord.step_figures(_integer("start", start))]

    def list_jobs(self) -> list[str]:
        return sorted(self.jobs)

    async def stop_job(self, job: str) -> bool:
        """Stop a job; its checkpoint gets a last flush first."""
        run = self.jobs.get(job)
        if run is None:
            return False
        await self._final_flush(run)
        self._drop(run)
        return True

    async def flush_checkpoint(self, job: str) -> dict[str, Any] | None:
        """Write the job's pending checkpoint deltas now; return the checkpoint's figures."""
        run = self._job(job)
        await self._final_flush(run)
        return run.writer.stats() if run.writer is not None else None

    async def _final_flush(self, run: _Job) -> None:
        if run.writer is None:
            return
        if run.flushing is not None:
            with contextlib.suppress(Exception):
                await run.flushing
        run.flushing = None
        fut = self._checkpoint(run, force=True)
        if fut is not None:
            await fut

    # ------------------------------------------------------------------ internals
    def _job(self, name: str) -> _Job:
        run = self.jobs.get(name)
        if run is None:
            have = ", ".join(sorted(self.jobs)) or "none"
            raise MissingJobError(
                f"no omniload job named {name!r} on this scheduler (running: {have})"
            )
        return run

    def _job_of_key(self, key: str) -> _Job | None:
        parts = key.split("-", 3)
        if len(parts) < 4:
            return None
        name = self._runs.get(parts[2])
        return self.jobs.get(name) if name else None

    def _drop(self, job: _Job) -> None:
        if self._standby is not None:
            self._standby.keys.difference_update(job.futures)
        if self.jobs.get(job.plan.name) is job:
            del self.jobs[job.plan.name]
        self._runs.pop(job.info["run_id"], None)
        if job.pump is not None:
            job.pump.cancel()
            job.pump = None
        for fut in job.futures.values():
            fut.release()
        job.futures.clear()
        job.coord.error = job.coord.error or "job stopped"
        job.notify()

    async def _get_client(self) -> Client:
        assert self._client_lock is not None
        async with self._client_lock:
            if self._client is None:
                self._client = await Client(
                    self.scheduler.address,
                    asynchronous=True,
                    name="omniload-data-plane",
                    security=getattr(self.scheduler, "security", None),
                    set_as_default=False,
                )
            return self._client

    async def _discover(
        self,
        client: Client,
        plan: Plan,
        run_id: str,
    ) -> tuple[list[Any], dict[str, Any]]:
        futures = [
            client.submit(
                tasks.discover,
                spec,
                key=f"omniload-discover-{run_id}-{i}",
                retries=plan.loader.read_retries,
                priority=100,
            )
            for i, spec in enumerate(plan.sources)
        ]
        tok = client.submit(
            tasks.check_tokenizer,
            plan.tokenizer,
            plan.images,
            key=f"omniload-tokenizer-{run_id}",
            priority=100,
        )
        try:
            results = await asyncio.wait_for(client.gather([*futures, tok]), DISCOVERY_TIMEOUT)
        except asyncio.TimeoutError:
            raise JobError(
                f"job {plan.name!r}: discovery did not finish within "
                f"{DISCOVERY_TIMEOUT:.0f}s; does the cluster have workers?"
            ) from None
        finally:
            for fut in futures:
                fut.release()
            tok.release()
        return list(results[:-1]), results[-1]

    def _on_report(
        self,
        job: _Job,
        key: str,
        meta: dict[str, Any],
        seconds: float | None,
    ) -> None:
        lengths = np.frombuffer(meta["lengths"], dtype=np.int32)
        patches = meta.get("patches")
        job.coord.on_report(
            key,
            lengths,
            int(meta["skipped"]),
            seconds=seconds,
            records=meta.get("records"),
            patches=np.frombuffer(patches, dtype=np.int64) if patches is not None else None,
            patches_sq=(
                np.frombuffer(meta["patches_sq"], dtype=np.int64) if patches is not None else None
            ),
        )
        source = int(key.split("-")[3])
        if source < len(job.coord.streams):
            job.monitor.grow(len(job.coord.streams))
            job.bad[source].extend(meta.get("bad") or [])
            job.reads_done[source] += 1
            job.images_read[source] += int(meta.get("images", 0))
            job.bad_images[source] += int(meta.get("bad_images", 0))
            job.read_seconds[source] += seconds or 0.0
            job.monitor.on_read(
                source,
                time.time(),
                int(meta.get("records", len(lengths))),
                int(meta.get("tokens", 0)),
                meta.get("read_seconds"),
                meta.get("tokenize_seconds"),
            )

    def _keep_standby(self, key: str) -> None:
        """Ask for a second copy of a constructed batch on another worker (shadow loader)."""
        if self._standby is None:
            return
        self._standby.keys.add(key)
        if not self._amm_soon:  # one memory-manager run for a burst of finished batches
            self._amm_soon = True
            asyncio.get_running_loop().call_later(0.02, self._run_amm)

    def _run_amm(self) -> None:
        self._amm_soon = False
        try:
            _dask.run_memory_manager(self.scheduler)
        except Exception:  # replication is best effort: lineage still recomputes lost data
            logger.exception("omniload: standby replication failed")

    def _poke(self, job: _Job) -> None:
        """Schedule the job's pump (coalesced): draw, submit, release."""
        job.dirty = True
        if job.pump is None or job.pump.done():
            job.pump = asyncio.get_running_loop().create_task(self._pump(job))

    async def _pump(self, job: _Job) -> None:
        while job.dirty and self.jobs.get(job.plan.name) is job:
            job.dirty = False
            job.pumps += 1
            coord = job.coord
            before = (coord.next_step, coord.end_step, coord.error)
            actions: list[Any] = []
            try:
                actions = coord.advance(max_steps=1)
                self._execute(job, actions)
            except OmniloadError as exc:
                coord.error = coord.error or str(exc)
            except Exception as exc:  # a bug: surface it to feeders instead of stalling them
                logger.exception("omniload data plane failed")
                coord.error = coord.error or f"internal error: {exc!r}"
            moved = (coord.next_step, coord.end_step, coord.error) != before
            if moved or actions:
                job.dirty = True
            self._checkpoint(job)
            if moved:
                # Waiting feeders look again only when a step was drawn or the job ended or
                # failed (a batch reaching memory wakes them in ``transition``): waking them
                # on every pump would have them poke the pump again, a busy loop while reads
                # run.
                job.notify()
            await asyncio.sleep(0)

    def _checkpoint(self, job: _Job, force: bool = False) -> asyncio.Future[Any] | None:
        """Queue the new deltas; flush them in a thread when due (never on this loop)."""
        writer = job.writer
        if writer is None:
            return None
        deltas = job.coord.take_deltas()
        if deltas:
            positions = {r: s.position for r, s in job.coord.ranks.items()}
            writer.add(deltas, positions)
        assert job.plan.checkpoint is not None
        due = time.monotonic() - job.last_flush >= job.plan.checkpoint.flush_seconds
        if not writer.pending() or not (due or force):
            return job.flushing
        if job.flushing is not None and not job.flushing.done():
            return job.flushing
        base = job.plan.checkpoint.compact_every
        latest = writer.manifest.bases[-1]["step"] if writer.manifest.bases else 0
        state = job.coord.state_dict() if job.coord.next_step - latest >= base else None
        job.last_flush = time.monotonic()
        job.flushing = asyncio.get_running_loop().run_in_executor(None, writer.flush, state)
        job.flushing.add_done_callback(lambda f: self._flushed(job, f))
        return job.flushing

    def _flushed(self, job: _Job, fut: asyncio.Future[Any]) -> None:
        exc = fut.exception() if not fut.cancelled() else None
        if exc is not None:
            logger.error("omniload checkpoint flush failed: %s", exc)
            job.checkpoint_error = str(exc)
        elif job.writer is not None and job.writer.pending():
            self._poke(job)  # more arrived meanwhile

    def _submit_read(self, client: Client, job: _Job, r: ReadSpec, lead: float = -1.0) -> Future:
        plan = job.plan
        return client.submit(
            tasks.read_unit,
            job.coord.streams[r.source].spec,
            r.source,
            plan.tokenizer,
            plan.on_error,
            r.file_index,
            r.file_url,
            r.start,
            r.stop,
            images=plan.images,
            key=r.key,
            retries=plan.loader.read_retries,
            priority=_read_priority(lead),
            resources=self._read_resources,
        )

    def _execute(self, job: _Job, actions: list[Any]) -> None:
        client = self._client
        assert client is not None
        for action in actions:
            if isinstance(action, SubmitRead):
                job.futures[action.read.key] = self._submit_read(
                    client, job, action.read, action.lead
                )
            elif isinstance(action, SubmitConstruct):
                deps = []
                for r in action.reads:
                    fut = job.futures.get(r.key)
                    if fut is None:  # a rebuild after the unit was released: read it again
                        fut = self._submit_read(client, job, r)  # a rebuild waits for it
                    deps.append(fut)
                built = client.submit(
                    tasks.construct,
                    action.recipe,
                    *deps,
                    key=action.key,
                    priority=CONSTRUCT_PRIORITY,
                    retries=1,
                )
                cp = len(action.slices)
                for c, key in enumerate(action.slices):
                    job.futures[key] = client.submit(
                        tasks.cp_slice,
                        built,
                        cp,
                        c,
                        key=key,
                        priority=CONSTRUCT_PRIORITY,
                        retries=1,
                    )
                if cp:
                    # Ranks fetch only slices; the scheduler keeps the batch until they are cut
                    # (and can recompute it if a slice is lost).
                    built.release()
                else:
                    job.futures[action.key] = built
            elif isinstance(action, Release):
                for key in action.keys:
                    if self._standby is not None:
                        self._standby.keys.discard(key)
                    fut = job.futures.pop(key, None)
                    if fut is not None:
                        fut.release()


def _read_priority(lead: float) -> int:
    """Dask priority of a read whose data is needed in ``lead`` steps (< 0: now)."""
    if lead < 0:
        return URGENT_READ_PRIORITY
    return READ_PRIORITY - min(int(lead), LEAD_LEVELS)


def _is_standby_key(key: Any) -> bool:
    return isinstance(key, str) and key.startswith(("omniload-batch-", "omniload-read-"))


def _integer(name: str, value: Any) -> int:
    """An RPC argument that must be a non-negative integer (errors name it)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise JobError(f"{name} must be an integer >= 0, got {value!r}")
    return value


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise JobError(f"{name} must be a number >= 0, got {value!r}")
    return float(value)

"""What the figure handlers reply: ``stats``, ``mixture``, ``steps`` and ``workers_wanted``.

Each reply is plain data (msgpack-able), assembled from the coordinator's own figures, the
job's :class:`~omniload_dask.observe.monitoring.JobMonitor` and what the scheduler knows of its
workers. ``stats`` is what every view of a job shows (the dashboard page, ``/metrics``,
``omniload status``); ``workers_wanted`` is what
:class:`~omniload_dask.cluster.adaptive.OmniloadAdaptive` offers Dask's adaptive scaling.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from omniload_dask.cluster.running import RunningJob
from omniload_dask.core import autoscale
from omniload_dask.internals import server as _server
from omniload_dask.observe.monitoring import realised_shares
from omniload_dask.plan.credentials import scrub

__all__ = ["SHARE_WINDOW", "job_stats", "mixture", "steps", "workers_wanted"]

SHARE_WINDOW = 64  # steps behind a source's realised share in stats()


def job_stats(run: RunningJob, scheduler: Any) -> dict[str, Any]:
    """The job's counters and figures: the coordinator's ``stats()`` plus, per source, what
    was read and how fast, per rank its feeder's last report, and the job's Dask figures."""
    out = run.coord.view.stats()
    now = time.time()
    mon = run.monitor
    mon.grow(len(out["sources"]))
    _add_source_figures(run, out["sources"], now)
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
        name=run.name,
        run_id=run.run_id,
        uptime=time.time() - run.started,
        workers=_server.worker_count(scheduler),
        futures_held=len(run.futures),
        batches_built=mon.batches_built,
        data_plane_runs=run.pumps,
        agent_requests=run.requests,
        agents_waiting=len(run.waiters),
        steps_planned_off_loop=run.dealing.off_loop,
        planning_batches=run.dealing.hand_offs,
        planning_cpu_s=round(run.dealing.cpu_s, 4),
        planning_in=run.dealing.where,
        resubmits=run.executor.resubmits,
        batches_recomputed=run.executor.recomputed["batch"],
        reads_recomputed=run.executor.recomputed["read"],
        scheduler_tasks=_server.task_count(scheduler),
        mixing_by=run.plan.mixing_by,
        start_step=start_step,
        steps_fetched=max(0, slowest - start_step),
        steps_per_second=mon.steps_per_second(now),
        prefetch=run.plan.loader.prefetch,
    )
    checkpoints = run.checkpoints
    out["checkpoint"] = checkpoints.stats() if checkpoints is not None else None
    if checkpoints is not None and checkpoints.error:
        out["checkpoint_error"] = checkpoints.error
    return _scrubbed(out, run.secrets)


def _scrubbed(out: dict[str, Any], secrets: set[str]) -> dict[str, Any]:
    """``out`` with credentials taken out of the texts that came from elsewhere (errors of
    storage libraries, bad records)."""
    for key in ("error", "checkpoint_error"):
        if out.get(key):
            out[key] = scrub(str(out[key]), secrets)
    for src in out["sources"]:
        src["bad_examples"] = [scrub(str(b), secrets) for b in src.get("bad_examples") or ()]
    return out


def _add_source_figures(run: RunningJob, sources: list[dict[str, Any]], now: float) -> None:
    mon = run.monitor
    records_rate, tokens_rate = mon.rates(now)
    recent = list(run.coord.view.history)[-SHARE_WINDOW:]
    _, _, realised = realised_shares(recent, len(sources), run.plan.mixing_by, SHARE_WINDOW)
    weights = np.asarray([s["weight"] for s in sources], dtype=np.float64)
    shares = weights / weights.sum() if weights.sum() > 0 else weights
    for i, src in enumerate(sources):
        src["bad_examples"] = list(mon.bad_examples[i])
        src["reads_done"] = int(mon.read_units[i])
        src["read_seconds"] = round(float(mon.task_seconds[i]), 3)
        src["target_share"] = float(shares[i])
        src["realised_share"] = float(realised[-1, i]) if len(realised) else None
        src["records_read"] = int(mon.records[i])
        src["tokens_read"] = int(mon.read_tokens[i])
        src["decode_seconds"] = round(float(mon.read_seconds[i]), 4)
        src["tokenize_seconds"] = round(float(mon.tokenize_seconds[i]), 4)
        src["records_per_s"] = float(records_rate[i])
        src["tokens_per_s"] = float(tokens_rate[i])
        src["images_read"] = int(mon.images_read[i])
        src["bad_images"] = int(mon.bad_images[i])


def workers_wanted(runs: Iterable[RunningJob], scheduler: Any) -> dict[str, Any]:
    """Workers that keep each job's trainers fed, and the most any job wants."""
    workers, threads = _server.worker_threads(scheduler)
    per_worker = threads / workers if workers else 1.0
    now = time.time()
    out: dict[str, Any] = {"workers": workers, "wanted": 0, "jobs": {}}
    for run in runs:
        work = run.coord.view.work_per_step()
        rate = run.monitor.steps_per_second(now)
        waits = [f.wait_p50 for f in run.monitor.feeders.values() if f.wait_p50 is not None]
        wait = max(waits, default=0.0) * run.plan.batch.micro_batches
        wanted = autoscale.recommend_workers(work, rate, wait, per_worker, workers)
        out["jobs"][run.name] = {
            "wanted": wanted,
            "work_per_step": work,
            "steps_per_second": rate,
            "wait_per_step": wait,
        }
        out["wanted"] = max(out["wanted"], wanted)
    return out


def mixture(run: RunningJob, window: int) -> list[dict[str, Any]]:
    """Per source: target and realised share, over the last ``window`` steps and overall."""
    return run.coord.view.mixture(window)


def steps(run: RunningJob, start: int) -> list[dict[str, Any]]:
    """Figures of the recent steps from ``start`` on (efficiency, tokens per source, ...)."""
    return [vars(f) for f in run.coord.view.step_figures(start)]

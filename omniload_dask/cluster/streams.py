"""Passes over a job's further streams (validation): which run, which to stop.

A pass over stream ``s`` of job ``j`` runs as a job of its own on the same scheduler, named
``j.s.p<k>`` (:func:`~omniload_dask.plan.streams.pass_job_name`), with the plan
:func:`stream_plan` makes: its own coordinator, run id and task
keys, so it shares the workers and nothing else with the training stream (whose cursors, draws
and checkpoint it never touches). Every rank asks for pass ``k`` by the same index (the
trainer's count of evaluations); the first to ask starts it, the others join it, as with
``Job.start``::

    pass k asked   ->  start j.s.p<k> (or join it)  ->  stop j.s.p<i> for i <= k - KEEP_PASSES
    job j stopped  ->  stop all of j's passes

Since a pass is recomputed from step 0 of its stream, stopping one loses nothing: the same pass
asked for again gives the same batches. :data:`KEEP_PASSES` passes stay, so a rank that is one
evaluation behind the others still finds its pass running.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from omniload_dask.cluster.arguments import integer
from omniload_dask.errors import JobError
from omniload_dask.plan import MixingSpec, Plan
from omniload_dask.plan.streams import pass_job_name

__all__ = ["KEEP_PASSES", "StreamPasses", "stream_plan"]

KEEP_PASSES = 2


class StreamPasses:
    """The pass jobs each running job has started, by stream; serves ``omniload_stream_pass``
    for the scheduler plugin, whose ``jobs``, ``start_job`` and ``stop_job`` it uses."""

    def __init__(self, plugin: Any) -> None:
        self._plugin = plugin
        # job name -> stream -> pass index -> pass job name
        self._passes: dict[str, dict[str, dict[int, str]]] = {}

    async def handle(self, job: str, stream: str, index: int = 0) -> dict[str, Any]:
        """Pass ``index`` over ``stream`` of the running ``job``: its job started or joined,
        the passes it outdates stopped. Returns ``{"job": the pass's job name, "first": its
        first step, "end": the step it ends before (None: where the stream ends)}``."""
        jobs = self._plugin.jobs
        if job not in jobs:
            self._plugin.job_info(job)  # (raises the error feeders know: no such job)
        run, index = jobs[job], integer("index", index)
        plan = run.plan
        if not isinstance(stream, str) or stream not in plan.stream_names:
            have = ", ".join(plan.stream_names) or "none"
            raise JobError(f"stream: job {job!r} has no stream named {stream!r} (have: {have})")
        first, end = plan.stream(stream).pass_range(index)
        name = pass_job_name(job, stream, index)
        if name not in jobs:
            await self._plugin.start_job(stream_plan(plan, stream, index).to_dict(), first)
            if jobs.get(job) is not run:  # the job stopped while its pass started
                await self._plugin.stop_job(name)
                raise JobError(f"stream: job {job!r} stopped while its pass started")
            for old in self._started(job, stream, index, name):
                await self._plugin.stop_job(old)
        return {"job": name, "first": first, "end": end}

    async def stop_all(self, job: str) -> None:
        """Stop every pass job of ``job`` (it stopped)."""
        streams = self._passes.pop(job, {})
        for name in [name for passes in streams.values() for name in passes.values()]:
            await self._plugin.stop_job(name)

    def _started(self, job: str, stream: str, index: int, name: str) -> list[str]:
        """Record pass ``index`` of ``stream`` (job ``name``); return the pass jobs to stop now:
        those of the stream ``KEEP_PASSES`` or more passes older."""
        passes = self._passes.setdefault(job, {}).setdefault(stream, {})
        passes[index] = name
        old = [i for i in passes if i <= index - KEEP_PASSES]
        return [passes.pop(i) for i in sorted(old)]


def stream_plan(plan: Plan, stream: str, index: int) -> Plan:
    """The plan pass ``index`` over ``stream`` runs as its own job: ``plan`` with the stream's
    sources and batch, the mixing by the sources' weights, no checkpoint (a pass is recomputed
    from step 0, never resumed) and no streams of its own."""
    spec = plan.stream(stream)
    return replace(
        plan,
        name=pass_job_name(plan.name, stream, index),
        sources=spec.sources,
        batch=spec.batch,
        mixing=MixingSpec(by=plan.mixing.by),
        checkpoint=None,
        streams=(),
    )

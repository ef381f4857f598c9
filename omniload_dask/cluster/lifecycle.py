"""Starting, resuming and changing jobs on the scheduler; the data plane's own client.

Starting a job has two phases, with the scheduler's loop free in between (the plugin checks
there that no other caller started the same job meanwhile)::

    prepare(data_client, plan, run_id, resume)   read the checkpoint to resume from (in a
                                                 thread); discover every source's files and
                                                 units, check the tokenizer (worker tasks)
    open_job(client, prepared, start_step, ...)  the coordinator (restored, a changed plan
                                                 applied), the checkpoint writer, the
                                                 job's executor

A live plan change (``update_plan``) is checked against the running job by
:func:`plan_change`, its new sources discovered by :func:`discover_added`, and applied to the
coordinator by :func:`apply_change`. Stopping is :meth:`RunningJob.final_flush` and
:meth:`RunningJob.stop`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from distributed import Client

from omniload_dask.checkpoint import (
    Checkpoint,
    check_catalogs,
    load_for_resume,
    registry_plan,
)
from omniload_dask.cluster import tasks
from omniload_dask.cluster.checkpointing import open_writer
from omniload_dask.cluster.executor import ActionExecutor
from omniload_dask.cluster.running import RunningJob
from omniload_dask.cluster.serving import PartServer
from omniload_dask.cluster.standby import StandbyCopies
from omniload_dask.core.coordinator import Coordinator
from omniload_dask.core.events import WorkersChanged
from omniload_dask.core.keys import Keys
from omniload_dask.core.live import PlanChange
from omniload_dask.core.stages import StageChange
from omniload_dask.errors import CheckpointError, JobError
from omniload_dask.internals import server as _server
from omniload_dask.plan import Plan, SourceSpec
from omniload_dask.plan.credentials import redact
from omniload_dask.preprocess.tokens import check_vocabularies
from omniload_dask.sources import Catalog

__all__ = [
    "DISCOVERY_TIMEOUT",
    "RECONNECT_TIMEOUT",
    "WARM_WORKERS",
    "DataPlaneClient",
    "PlanChange",
    "Prepared",
    "apply_change",
    "check_same_job",
    "discover_added",
    "job_info",
    "open_job",
    "plan_change",
    "prepare",
    "stage_change",
    "with_known_credentials",
]

DISCOVERY_TIMEOUT = 120.0
RECONNECT_TIMEOUT = 30.0  # seconds a new data-plane client may take to connect
DISCOVERY_PRIORITY = 100  # start-up work goes before any job's reads
WARM_WORKERS = 8  # feeders connect to the workers ahead of a first fetch on clusters this small
# Fields of a plan that a live update may not change (a new job may).
FIXED_FIELDS = ("seed", "tokenizer", "layout", "cost", "on_error", "images")  # (batch: stages)


class DataPlaneClient:
    """The data plane's own Dask client, on the scheduler's event loop, made on first use.

    Making it also registers :class:`~omniload_dask.cluster.serving.PartServer` on the
    workers. The plugin's watchdog (:mod:`.watchdog`) asks :meth:`healthy` every second; a
    client that lost its connection is replaced (:meth:`replace`), never reused after Dask's
    own reconnect, and the jobs submit what they held again.
    """

    def __init__(self, scheduler: Any) -> None:
        self._scheduler = scheduler
        self._client: Client | None = None
        self._stream: Any = None
        self._lock = asyncio.Lock()
        self.replaced = 0  # clients replaced after a lost connection

    async def get(self) -> Client:
        """The client (connected to this scheduler, with its security settings)."""
        async with self._lock:
            if self._client is None:
                self._client = await self._connect()
            return self._client

    async def _connect(self) -> Client:
        client = await Client(
            self._scheduler.address,
            asynchronous=True,
            name="omniload-data-plane",
            security=_server.scheduler_security(self._scheduler),
            set_as_default=False,
        )
        self._stream = _server.client_stream(client)
        await client.register_plugin(PartServer())
        return client

    @property
    def current(self) -> Client | None:
        """The client made so far, if any."""
        return self._client

    def healthy(self) -> bool:
        """Whether the client is still on the connection it was made with."""
        client = self._client
        return client is not None and _server.client_connected(
            self._scheduler, client, self._stream
        )

    async def replace(self) -> Client:
        """Drop the current client (its connection was lost) and connect a new one."""
        async with self._lock:
            old, self._client = self._client, None
            if old is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(old.close(), 5)
            self._client = await self._connect()
            self.replaced += 1
            return self._client

    async def close(self) -> None:
        """Close the client, if one was made."""
        if self._client is not None:
            client, self._client = self._client, None
            await client.close()


# ---------------------------------------------------------------------- starting
def check_same_job(running: RunningJob, plan: Plan) -> None:
    """A second start of a running job must give the same stream and layout."""
    if (
        running.plan.stream_fingerprint() != plan.stream_fingerprint()
        or running.plan.layout != plan.layout
    ):
        raise JobError(
            f"a job named {plan.name!r} already runs with another plan or layout: stop it "
            f"(`omniload stop {plan.name} --address ADDR`, or Job.attach(...).stop()), attach "
            "to it (Job.attach), or give the plan another name (its `name:` field)"
        )


@dataclass
class Prepared:
    """What :func:`prepare` found: the sources' catalogs, the tokenizer, the resumed state."""

    plan: Plan
    run_id: str
    sources: Plan  # the plan with the sources in the checkpoint's order when resuming
    catalogs: list[Catalog]
    tokenizer: dict[str, Any]
    saved: Checkpoint | None = None
    state: dict[str, Any] | None = field(default=None, repr=False)


async def prepare(
    data_client: DataPlaneClient,
    plan: Plan,
    run_id: str,
    resume: bool | int | None,
    unverified: bool = False,
) -> Prepared:
    """Load the checkpoint to resume from (if ``resume``; ``unverified``: accept a manifest
    without its own digest, logged), then discover the sources."""
    resuming = resume is not None and resume is not False
    if resuming and plan.checkpoint is None:
        raise CheckpointError(f"job {plan.name!r}: resume needs checkpoint.url in the plan")
    client = await data_client.get()
    saved: Checkpoint | None = None
    state = None
    sources = plan
    if resuming:
        assert resume is not None
        loop = asyncio.get_running_loop()
        saved, state = await loop.run_in_executor(None, load_for_resume, plan, resume, unverified)
        sources = registry_plan(plan, state)
    catalogs, tokenizer = await _discover(client, sources, run_id)
    check_vocabularies(sources, tokenizer)  # token sources: the plan's vocabulary, or fail
    return Prepared(plan, run_id, sources, catalogs, tokenizer, saved, state)


async def open_job(
    client: Client,
    prepared: Prepared,
    start_step: int,
    *,
    standby: StandbyCopies,
    read_resources: Callable[[], dict[str, int] | None],
    workers: Callable[[], tuple[int, int]],
) -> RunningJob:
    """The running job: its coordinator (restored when resuming), checkpoint writer, executor.

    ``workers()`` tells ``(workers, read slots)`` of the cluster now; it is asked last, after
    the writer's first base is written (workers may come and go meanwhile).
    """
    plan, state, catalogs = prepared.plan, prepared.state, prepared.catalogs
    if state is not None:
        catalogs = check_catalogs(state, catalogs)
    coord = Coordinator(prepared.sources, catalogs, prepared.run_id, start_step=start_step)
    if state is not None:
        assert prepared.saved is not None
        coord.load_state_dict(state)
        if prepared.saved.plan.stream_fingerprint() != plan.stream_fingerprint():
            coord.adopt_plan(plan, catalogs)
    writer = None
    if plan.checkpoint is not None:
        writer = await open_writer(plan, coord, prepared.saved)
    info = {
        "name": plan.name,
        "run_id": prepared.run_id,
        "plan": plan.redacted(),  # feeders get no credentials
        "sources": coord.view.names,
        "files": [len(c.files) for c in catalogs],
        "units": [c.num_units for c in catalogs],
        "bytes": [c.total_bytes for c in catalogs],
        "tokenizer": prepared.tokenizer,
        "start_step": coord.view.next_step if state is not None else start_step,
        "resumed": state is not None,
    }
    executor = ActionExecutor(client, plan, coord.view.spec_of, standby, read_resources)
    job = RunningJob(plan, coord, info, executor, writer)
    count, read_slots = workers()
    if read_slots:
        coord.handle(WorkersChanged(count, read_slots))
    return job


async def _discover(
    client: Client, plan: Plan, run_id: str
) -> tuple[list[Catalog], dict[str, Any]]:
    """Every source's catalog, and the tokenizer's description, from tasks on the workers."""
    futures = [
        client.submit(
            tasks.discover,
            spec,
            plan.on_error,
            plan.loader.read_retries,  # transient errors only, inside the task
            key=Keys(run_id).discover(i),
            priority=DISCOVERY_PRIORITY,
        )
        for i, spec in enumerate(plan.sources)
    ]
    if plan.images is None and all(s.has_tokens for s in plan.sources):
        # (no tokenizer runs: its vocabulary is all the token sources are checked against)
        tok = client.submit(
            tasks.check_vocabulary,
            plan.tokenizer,
            key=Keys(run_id).tokenizer(),
            priority=DISCOVERY_PRIORITY,
        )
    else:
        tok = client.submit(
            tasks.check_tokenizer,
            plan.tokenizer,
            plan.images,
            key=Keys(run_id).tokenizer(),
            priority=DISCOVERY_PRIORITY,
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


# ---------------------------------------------------------------------- live plan changes
def with_known_credentials(run: RunningJob, new: Plan) -> Plan:
    """``new`` with the running job's options wherever it carries their redacted form.

    A plan read back from a job (``Job.attach(...).plan``, the ``info`` reply) holds ``***``
    for credentials; updating the job with it keeps the credentials the job already has.
    """
    old = {s.name: s for s in run.plan.sources}
    old.update((s.spec.name, s.spec) for s in run.coord.view.streams)

    def known(options: Any, mine: Any) -> Any:
        shown = redact({"storage_options": dict(mine)})["storage_options"]
        return mine if dict(options) == shown else options

    sources = tuple(
        replace(s, storage_options=known(s.storage_options, old[s.name].storage_options))
        if s.name in old
        else s
        for s in new.sources
    )
    tokenizer = replace(
        new.tokenizer,
        storage_options=known(new.tokenizer.storage_options, run.plan.tokenizer.storage_options),
    )
    return replace(new, sources=sources, tokenizer=tokenizer)


def plan_change(run: RunningJob, new: Plan, at_step: int | None = None) -> PlanChange:
    """Check ``new`` against the running job and say what it changes at ``at_step`` (default:
    the first step not built), compared with the plan due at that step.

    Sources keep their names (and cursors); the batch may change its stages
    (:func:`stage_change`); other fields must stay as they are.
    """
    old = run.plan
    for name in FIXED_FIELDS:
        if getattr(new, name) != getattr(old, name):
            raise JobError(
                f"update_plan: {name} cannot change while the job runs (start a new job)"
            )
    if new.mixing.by != old.mixing.by:
        raise JobError("update_plan: mixing.by cannot change while the job runs")
    stage_change(run, new, at_step)  # (checked now, applied with the sources)
    return run.coord.view.plan_change(new.sources, at_step)


def stage_change(run: RunningJob, new: Plan, at_step: int | None = None) -> StageChange | None:
    """Check ``new``'s batch against the running job's from ``at_step`` (default: the first
    step not built): the stage change it makes (:mod:`omniload_dask.core.stages`), or None."""
    return run.coord.view.stage_change(new.batch, at_step)


async def discover_added(
    client: Client, run: RunningJob, new: Plan, added: list[SourceSpec]
) -> list[Catalog]:
    """The catalogs of the sources a plan change adds (tasks on the workers)."""
    if not added:
        return []
    futures = [
        client.submit(
            tasks.discover,
            spec,
            new.on_error,
            new.loader.read_retries,
            key=Keys(run.run_id).discover(spec.name, len(run.coord.view.log)),
            priority=DISCOVERY_PRIORITY,
        )
        for spec in added
    ]
    try:
        catalogs: list[Catalog] = await asyncio.wait_for(client.gather(futures), DISCOVERY_TIMEOUT)
    finally:
        for fut in futures:
            fut.release()
    return catalogs


def apply_change(
    run: RunningJob, new: Plan, change: PlanChange, catalogs: list[Catalog], at_step: int | None
) -> tuple[int, list[dict[str, Any]] | None]:
    """Apply ``change`` and ``new``'s stage change (:func:`stage_change`) from ``at_step``
    (default: the first step not built); returns the step they take effect at, and the
    stages logged from there on (None: the stages did not change)."""
    step = run.coord.apply_change(change, catalogs, at_step)
    stages = stage_change(run, new, at_step)  # (again: steps may be built since the check)
    if stages is None:
        return step, None
    return run.coord.apply_stages(stages), stages.stages


def job_info(run: RunningJob, scheduler: Any = None) -> dict[str, Any]:
    """What the job's start returned, with the sources and the batch as live changes left
    them, and the count of stage changes behind that batch (a feeder reads its plan from
    here, and again where a micro-batch carries another count: ``trainer.jobcopy``), and
    ``workers``: the addresses of ``scheduler``'s workers where it has at most
    :data:`WARM_WORKERS` (a feeder connects to them while its first batch is built)."""
    view = run.coord.view
    info = {**run.info, "sources": view.names, "stages_version": view.stages_version}
    info["workers"] = _server.worker_addresses(scheduler, WARM_WORKERS) if scheduler else []
    if run.coord.view.batch != run.plan.batch:
        info["plan"] = replace(run.plan, batch=run.coord.view.batch).redacted()
    return info

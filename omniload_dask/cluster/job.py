"""Starting and attaching to jobs, on an embedded LocalCluster or on any Dask cluster.

::

    plan = load_plan("plans/quickstart.yaml")
    with Job.start(plan) as job:              # no address: a LocalCluster in this process
        for mb in job.feeder(dp_rank=0):
            ...

    job = Job.start(plan, address="tcp://scheduler:8786")   # an existing cluster
    feeder = Feeder("quickstart", address="tcp://scheduler:8786")   # in each trainer rank

    sec = Security(tls_ca_file="ca.pem", tls_client_cert="me.pem", tls_client_key="me.key",
                   require_encryption=True)
    job = Job.start(plan, address="tls://scheduler:8786", security=sec)   # TLS
    with Job.start(plan, security=True) as job:  # embedded, temporary certificates

Without ``security`` a connection takes Dask's configuration (``distributed.comm.tls.*``).

Starting is idempotent: every rank may call ``Job.start`` with the same plan and they all get
the one job. The scheduler plugin is registered on the fly, or preloaded with
``dask scheduler --preload omniload_dask.preload``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

import dask
from distributed import Client, LocalCluster

from omniload_dask.cluster import quiet, settings
from omniload_dask.cluster.plugin import OmniloadPlugin
from omniload_dask.errors import JobError, OmniloadError
from omniload_dask.fixes import own_error
from omniload_dask.internals import comms as _comms
from omniload_dask.internals import server as _server
from omniload_dask.plan import READ_SLOTS_PER_THREAD, Plan, load_plan, parse_plan
from omniload_dask.trainer.feeder import Feeder

CLOSE_IDLE_TIMEOUT = 3.0  # seconds close() lets a stopped job's running reads finish
CLOSE_TIMEOUT = 30.0  # seconds each part of close() may take (stop, workers, client, cluster)
WORKER_PRELOAD = "omniload_dask.preload"  # (imported by name in each worker, not here)

logger = logging.getLogger(__name__)

__all__ = ["Job", "local_cluster"]


def local_cluster(
    workers: int,
    threads_per_worker: int = 1,
    *,
    processes: bool = True,
    dashboard_address: str | None = ":0",
    **kwargs: Any,
) -> LocalCluster:
    """The embedded cluster: worker processes with ``threads_per_worker`` tokenizing threads
    each, and :data:`~omniload_dask.plan.READ_SLOTS_PER_THREAD` read slots for each of them (one
    read decodes its records while another tokenizes).

    Each worker also gets one more thread, for constructions: reads ask for the
    ``omniload-read`` resource, so a short construction never waits behind a long read.
    ``dashboard_address=None`` turns the Bokeh dashboard off; the scheduler's small HTTP server
    (``/metrics``, ``/health``) then listens on a free port instead of 8787. The cluster runs
    with :data:`.settings.DASK_SETTINGS` (a cluster given by address gets them from the preload).
    Worker processes run the worker preload (:mod:`omniload_dask.preload`, after any the
    caller or Dask's config names): while a worker waits for its first job it imports the
    readers' libraries, which the job's first reads would otherwise wait for.
    """
    slots = threads_per_worker * READ_SLOTS_PER_THREAD
    kwargs.setdefault("resources", {"omniload-read": slots})
    if processes:  # (in-process workers would change the caller's own Dask defaults)
        kwargs["preload"] = _with_worker_preload(kwargs.get("preload"))
    if kwargs.get("security") is not None and dashboard_address is not None:
        dashboard_address = _loopback(dashboard_address)
    if dashboard_address is None:
        kwargs["scheduler_kwargs"] = {
            "dashboard_address": ":0",
            **kwargs.get("scheduler_kwargs", {}),
        }
    with dask.config.set(settings.DASK_SETTINGS):
        return LocalCluster(
            n_workers=workers,
            threads_per_worker=slots + 1,
            processes=processes,
            dashboard_address=dashboard_address,
            **kwargs,
        )


def _with_worker_preload(preload: Any) -> list[str]:
    """The workers' preloads: ``preload`` (a name or a list; None: Dask's config), then ours."""
    if preload is None:
        preload = dask.config.get("distributed.worker.preload", [])
    names = [preload] if isinstance(preload, str) else list(preload)
    return names if WORKER_PRELOAD in names else [*names, WORKER_PRELOAD]


def _loopback(address: str) -> str:
    """``address`` (``host:port`` or ``:port``) with the host forced to 127.0.0.1: the
    dashboard is plain HTTP, so a secured embedded cluster serves it on loopback only."""
    port = address.rpartition(":")[2] if ":" in address else address
    return f"127.0.0.1:{port or 0}"


def _embedded_security(security: Any, plan: Plan) -> Any:
    """The embedded cluster's ``distributed.Security``: the one given, temporary certificates
    (``security=True`` or the plan's ``loader.tls``), or None (Dask's config)."""
    if security is True or (security is None and plan.loader.tls):
        from distributed import Security

        try:
            return Security.temporary()
        except ImportError as exc:
            raise JobError(f"TLS for the embedded cluster: {exc}") from None
    return security or None


def _close_local_workers(cluster: LocalCluster, timeout: float) -> None:
    """Close the workers of a ``LocalCluster`` (nannies and their processes), waiting up to
    ``timeout`` seconds for each process to exit by itself.

    ``LocalCluster.close()`` gives a worker process 4 s before it kills it with a warning
    ("Worker process still alive after 4.0 seconds, killing"); on a loaded machine a clean
    exit can take longer. Closed first here, the workers are gone when the cluster closes.
    """

    async def close_all() -> None:
        workers = list(cluster.workers.values())
        await asyncio.gather(*(w.close(timeout=timeout) for w in workers), return_exceptions=True)

    cluster.sync(close_all, callback_timeout=timeout + 5)


@contextlib.contextmanager
def _bounded(what: str) -> Iterator[None]:
    """Log (not raise) a part of closing that ran out of time or failed."""
    try:
        yield
    except Exception as exc:  # close() must end, and close what it can
        logger.warning("omniload: %s did not finish cleanly: %s: %s", what, type(exc).__name__, exc)


class Job:
    """A handle on a running omniload job (not the job itself: that lives on the scheduler)."""

    def __init__(
        self,
        client: Client,
        info: dict[str, Any],
        *,
        cluster: LocalCluster | None = None,
        owns_client: bool = False,
    ) -> None:
        self.client = client
        self.info = info
        self.name: str = info["name"]
        self.plan = parse_plan(info["plan"])
        self.cluster = cluster
        self._owns_client = owns_client
        self._feeders: list[Feeder] = []

    @classmethod
    def start(
        cls,
        plan: Plan | str | os.PathLike[str],
        *,
        address: str | None = None,
        client: Client | None = None,
        workers: int | None = None,
        start_step: int = 0,
        resume: bool | int | None = None,
        resume_unverified: bool = False,
        dashboard_address: str | None = ":0",
        scheduler_port: int = 0,
        security: Any = None,
        **layout: int,
    ) -> Job:
        """Start (or join) the plan's job. ``layout`` overrides the plan's dp/tp/pp/cp.

        ``security``: a ``distributed.Security`` for the scheduler at ``address`` (default:
        Dask's config). Without an address, ``security=True`` (or the plan's ``loader.tls``)
        runs the embedded cluster on TLS with temporary certificates, its dashboard on
        loopback; ``Job.client``'s ``security`` then lets other processes of this machine connect.

        ``resume=True`` continues from the plan's checkpoint where the slowest rank was;
        ``resume=STEP`` continues from that step (e.g. the smallest ``step`` of the ranks'
        ``Feeder.state_dict()`` in the trainer's checkpoint). A checkpoint whose manifest
        carries no digest of its own (an old format, or one edited by hand) is refused unless
        ``resume_unverified=True``, which the scheduler logs. The global stream continues
        exactly, also with another DP size or worker count; a changed plan (weights, sources
        added or removed) applies from the resumed step. Without a checkpoint,
        ``start_step=STEP`` gives the same batches by drawing again from step 0 (slower).
        """
        if not isinstance(plan, Plan):
            plan = load_plan(plan)
        if layout:
            unknown = set(layout) - {"dp", "tp", "pp", "cp"}
            if unknown:
                raise JobError(
                    f"Job.start: unknown layout axis {sorted(unknown)}; use dp, tp, pp, cp"
                )
            plan = parse_plan({**plan.to_dict(), "layout": {**plan.to_dict()["layout"], **layout}})
        cluster = None
        owns = False
        if client is None:
            if address is None:
                security = _embedded_security(security, plan)
                cluster = local_cluster(
                    workers or plan.loader.workers,
                    plan.loader.threads_per_worker,
                    dashboard_address=dashboard_address,
                    scheduler_port=scheduler_port,
                    security=security,
                )
                address = cluster.scheduler_address
            elif security is True:
                raise JobError(
                    "Job.start: security=True makes temporary certificates for the embedded "
                    "cluster; for the cluster at an address give a distributed.Security"
                )
            client = Client(address, security=security, set_as_default=False)
            owns = True
        try:
            if cluster is not None:  # our errors reach the user once, in our words
                quiet.install()
                client.register_plugin(quiet.QuietTaskErrors())
            client.register_plugin(OmniloadPlugin())
            unverified = {"resume_unverified": True} if resume_unverified else {}
            info = _comms.call(
                client,
                "start",
                plan=plan.to_dict(),
                start_step=start_step,
                resume=resume,
                **unverified,
            )
        except BaseException as exc:
            if owns:
                client.close()
            if cluster is not None:
                cluster.close()
            if isinstance(exc, OmniloadError):
                raise own_error(exc) from None
            raise
        return cls(client, info, cluster=cluster, owns_client=owns)

    @classmethod
    def attach(
        cls,
        name: str,
        *,
        address: str | None = None,
        client: Client | None = None,
        security: Any = None,
    ) -> Job:
        """A handle on job ``name`` that runs on the cluster at ``address`` (``security``: a
        ``distributed.Security``; default: Dask's config)."""
        owns = client is None
        if client is None:
            if address is None:
                raise JobError("Job.attach: give an address or a client")
            client = Client(address, security=security, set_as_default=False)
        info = _comms.call(client, "info", job=name)
        return cls(client, info, owns_client=owns)

    def feeder(self, **kwargs: Any) -> Feeder:
        """A :class:`Feeder` for one rank of this job (see Feeder for the arguments)."""
        feeder = Feeder(self.name, client=self.client, **kwargs)
        self._feeders.append(feeder)
        return feeder

    def flush_checkpoint(self) -> dict[str, Any] | None:
        """Write pending checkpoint deltas now (they are also written every few seconds)."""
        return _comms.call(self.client, "flush_checkpoint", job=self.name)

    def stats(self) -> dict[str, Any]:
        """The job's counters and figures, as every monitoring view shows them."""
        return _comms.call(self.client, "stats", job=self.name)

    def steps(self, start: int = 0) -> list[dict[str, Any]]:
        """Figures of the recent steps from ``start`` on (efficiency, tokens per source...)."""
        return _comms.call(self.client, "steps", job=self.name, start=start)

    def set_weights(self, weights: dict[str, float], at_step: int | None = None) -> int:
        """Change source weights live, from ``at_step`` (default: the first step not yet
        built: steps drawn past it are drawn again); sources not named keep following the
        plan. Returns the effective step."""
        reply = _comms.call(
            self.client, "set_weights", job=self.name, weights=dict(weights), at_step=at_step
        )
        return int(reply["step"])

    def update_plan(
        self,
        plan: Plan | str | os.PathLike[str],
        at_step: int | None = None,
    ) -> dict[str, Any]:
        """Apply a new version of the plan live: add or remove sources, change weights, change
        the training stages (``batch``: its budget, ``seq_len``, micro-batches, buckets and
        ``stages``; see :mod:`omniload_dask.core.stages`), from ``at_step`` (default: the first
        step not yet built). Returns the step, and what changed (``stages``: those logged)."""
        if not isinstance(plan, Plan):
            plan = load_plan(plan)
        return _comms.call(
            self.client, "update_plan", job=self.name, plan=plan.to_dict(), at_step=at_step
        )

    def mixture(self, window: int = 100) -> list[dict[str, Any]]:
        """Per source: target and realised share over the last ``window`` steps and overall."""
        return _comms.call(self.client, "mixture", job=self.name, window=window)

    def adapt(self, minimum: int = 1, maximum: int = 8, **kwargs: Any) -> Any:
        """Scale the embedded cluster adaptively, by Dask's and the data plane's needs.

        On a cluster of your own, call ``cluster.adapt(Adaptive=OmniloadAdaptive, ...)``
        (:mod:`omniload_dask.cluster.adaptive`) yourself.
        """
        if self.cluster is None:
            raise JobError(
                "Job.adapt: only for the embedded LocalCluster; on your own cluster call "
                "cluster.adapt(Adaptive=omniload_dask.cluster.adaptive.OmniloadAdaptive, ...)"
            )
        from omniload_dask.cluster.adaptive import OmniloadAdaptive

        return self.cluster.adapt(
            Adaptive=OmniloadAdaptive, minimum=minimum, maximum=maximum, **kwargs
        )

    @property
    def dashboard_link(self) -> str | None:
        """The Dask dashboard's address (the Omniload page is ``/omniload`` next to it)."""
        return getattr(self.client, "dashboard_link", None)

    def stop(self) -> None:
        """Stop the job on the scheduler, whoever started it.

        A job on a cluster of your own runs until it is stopped (closing the handle that
        started it does not stop it): ``Job.attach(name, address=...).stop()``, or
        ``omniload stop NAME --address ADDR``. Its checkpoint (if any) gets a last flush, its
        batches and shards are released, and its feeders' next fetch raises JobError. The
        embedded cluster's job stops with :meth:`close`.
        """
        for feeder in self._feeders:
            feeder.close()
        self._feeders.clear()
        if self.client.status == "running":
            _comms.call(self.client, "stop", job=self.name, call_timeout=CLOSE_TIMEOUT)

    def close(self) -> None:
        """Stop the job if this handle started the cluster, and close what it owns.

        Bounded: each part (the stop, the workers' exit, the client, the cluster) has its own
        time limit; one that runs out is logged and the rest still closes.
        """
        for feeder in self._feeders:
            feeder.close()
        self._feeders.clear()
        if self.cluster is not None:
            with _bounded("stopping the job"):
                self.stop()
            if self.client.status == "running":  # let reads in flight end before closing
                _server.wait_workers_idle(self.client, CLOSE_IDLE_TIMEOUT)
            with _bounded("closing the workers"):  # their exit may take a while under load
                _close_local_workers(self.cluster, CLOSE_TIMEOUT)
        if self._owns_client:
            with _bounded("closing the client"):
                self.client.close(timeout=CLOSE_TIMEOUT)
        if self.cluster is not None:
            with _bounded("closing the cluster"):
                self.cluster.close(timeout=CLOSE_TIMEOUT)

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

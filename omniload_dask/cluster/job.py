"""Starting and attaching to jobs, on an embedded LocalCluster or on any Dask cluster.

::

    plan = load_plan("plans/quickstart.yaml")
    with Job.start(plan) as job:              # no address: a LocalCluster in this process
        for mb in job.feeder(dp_rank=0):
            ...

    job = Job.start(plan, address="tcp://scheduler:8786")   # an existing cluster
    feeder = Feeder("quickstart", address="tcp://scheduler:8786")   # in each trainer rank

Starting is idempotent: every rank may call ``Job.start`` with the same plan and they all get
the one job. The scheduler plugin is registered on the fly, or preloaded with
``dask scheduler --preload omniload_dask.preload``.
"""

from __future__ import annotations

import os
from typing import Any

import dask
from distributed import Client, LocalCluster

from omniload_dask.cluster import internals as _dask
from omniload_dask.cluster import settings
from omniload_dask.cluster.plugin import OmniloadPlugin
from omniload_dask.errors import JobError
from omniload_dask.plan import Plan, load_plan, parse_plan
from omniload_dask.trainer.feeder import Feeder

CLOSE_IDLE_TIMEOUT = 3.0  # seconds close() lets a stopped job's running reads finish

__all__ = ["Job", "local_cluster"]


def local_cluster(
    workers: int,
    threads_per_worker: int = 1,
    *,
    processes: bool = True,
    dashboard_address: str | None = ":0",
    **kwargs: Any,
) -> LocalCluster:
    """The embedded cluster: worker processes with ``threads_per_worker`` read slots each.

    Each worker also gets one more thread, for constructions: reads ask for the
    ``omniload-read`` resource, so a short construction never waits behind a long read.
    ``dashboard_address=None`` turns the Bokeh dashboard off; the scheduler's small HTTP server
    (``/metrics``, ``/health``) then listens on a free port instead of 8787. The cluster runs
    with :data:`.settings.DASK_SETTINGS` (a cluster given by address gets them from the preload).
    """
    kwargs.setdefault("resources", {"omniload-read": threads_per_worker})
    if dashboard_address is None:
        kwargs["scheduler_kwargs"] = {
            "dashboard_address": ":0",
            **kwargs.get("scheduler_kwargs", {}),
        }
    with dask.config.set(settings.DASK_SETTINGS):
        return LocalCluster(
            n_workers=workers,
            threads_per_worker=threads_per_worker + 1,
            processes=processes,
            dashboard_address=dashboard_address,
            **kwargs,
        )


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
        dashboard_address: str | None = ":0",
        scheduler_port: int = 0,
        **layout: int,
    ) -> Job:
        """Start (or join) the plan's job. ``layout`` overrides the plan's dp/tp/pp/cp.

        ``resume=True`` continues from the plan's checkpoint where the slowest rank was;
        ``resume=STEP`` continues from that step (e.g. the smallest ``step`` of the ranks'
        ``Feeder.state_dict()`` in the trainer's checkpoint). The global stream continues
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
                cluster = local_cluster(
                    workers or plan.loader.workers,
                    plan.loader.threads_per_worker,
                    dashboard_address=dashboard_address,
                    scheduler_port=scheduler_port,
                )
                address = cluster.scheduler_address
            client = Client(address, set_as_default=False)
            owns = True
        try:
            client.register_plugin(OmniloadPlugin())
            info = _dask.call(
                client, "start", plan=plan.to_dict(), start_step=start_step, resume=resume
            )
        except BaseException:
            if owns:
                client.close()
            if cluster is not None:
                cluster.close()
            raise
        return cls(client, info, cluster=cluster, owns_client=owns)

    @classmethod
    def attach(cls, name: str, *, address: str | None = None, client: Client | None = None) -> Job:
        """A handle on job ``name`` that runs on the cluster at ``address``."""
        owns = client is None
        if client is None:
            if address is None:
                raise JobError("Job.attach: give an address or a client")
            client = Client(address, set_as_default=False)
        info = _dask.call(client, "info", job=name)
        return cls(client, info, owns_client=owns)

    def feeder(self, **kwargs: Any) -> Feeder:
        """A :class:`Feeder` for one rank of this job (see Feeder for the arguments)."""
        feeder = Feeder(self.name, client=self.client, **kwargs)
        self._feeders.append(feeder)
        return feeder

    def flush_checkpoint(self) -> dict[str, Any] | None:
        """Write pending checkpoint deltas now (they are also written every few seconds)."""
        return _dask.call(self.client, "flush_checkpoint", job=self.name)

    def stats(self) -> dict[str, Any]:
        """The job's counters and figures, as every monitoring view shows them."""
        return _dask.call(self.client, "stats", job=self.name)

    def steps(self, start: int = 0) -> list[dict[str, Any]]:
        """Figures of the recent steps from ``start`` on (efficiency, tokens per source...)."""
        return _dask.call(self.client, "steps", job=self.name, start=start)

    def set_weights(self, weights: dict[str, float], at_step: int | None = None) -> int:
        """Change source weights live, from ``at_step`` (default: the first step not yet
        drawn); sources not named keep following the plan. Returns the effective step."""
        reply = _dask.call(
            self.client, "set_weights", job=self.name, weights=dict(weights), at_step=at_step
        )
        return int(reply["step"])

    def update_plan(
        self,
        plan: Plan | str | os.PathLike[str],
        at_step: int | None = None,
    ) -> dict[str, Any]:
        """Apply a new version of the plan live: add or remove sources, change weights."""
        if not isinstance(plan, Plan):
            plan = load_plan(plan)
        return _dask.call(
            self.client, "update_plan", job=self.name, plan=plan.to_dict(), at_step=at_step
        )

    def mixture(self, window: int = 100) -> list[dict[str, Any]]:
        """Per source: target and realised share over the last ``window`` steps and overall."""
        return _dask.call(self.client, "mixture", job=self.name, window=window)

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
        """Stop the job on the scheduler (its batches and shards are released)."""
        for feeder in self._feeders:
            feeder.close()
        self._feeders.clear()
        if self.client.status == "running":
            _dask.call(self.client, "stop", job=self.name)

    def close(self) -> None:
        """Stop the job if this handle started the cluster, and close what it owns."""
        for feeder in self._feeders:
            feeder.close()
        self._feeders.clear()
        if self.cluster is not None:
            self.stop()
            if self.client.status == "running":  # let reads in flight end before closing
                _dask.wait_workers_idle(self.client, CLOSE_IDLE_TIMEOUT)
        if self._owns_client:
            self.client.close()
        if self.cluster is not None:
            self.cluster.close()

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

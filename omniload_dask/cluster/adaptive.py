"""Dask's adaptive scaling, told by the data plane how many workers keep the trainers fed.

Dask's own estimate (``Scheduler.adaptive_target``) counts the work queued on the scheduler; the
data plane deliberately queues little (a few reads per worker thread, see
:mod:`omniload_dask.core.autoscale`), so that estimate cannot see that trainers wait. Dask's supported
way to change the target is a subclass of :class:`distributed.deploy.Adaptive` with its own
``target()``, passed to a Dask cluster's ``adapt``::

    from omniload_dask.cluster.adaptive import OmniloadAdaptive
    cluster.adapt(Adaptive=OmniloadAdaptive, minimum=1, maximum=16)
    # or, for an embedded cluster: job.adapt(minimum=1, maximum=16)

The target is the larger of Dask's and the data plane's recommendation (the
``omniload_workers_wanted`` handler: measured read work per step times the trainers' pace);
``minimum``/``maximum`` bound it as usual, and Dask picks which workers to retire.
"""

from __future__ import annotations

import logging

from distributed.deploy.adaptive import Adaptive

__all__ = ["OmniloadAdaptive"]

logger = logging.getLogger(__name__)


class OmniloadAdaptive(Adaptive):
    """Adaptive scaling whose target also covers every omniload job's read work."""

    async def target(self) -> int:
        """Workers to have: Dask's own target, raised to what the data plane asks for."""
        dask_target = int(await super().target())
        try:
            reply = await self.scheduler.omniload_workers_wanted()
        except Exception as exc:  # no data plane on this scheduler (yet): Dask's target stands
            logger.debug("omniload: no worker recommendation (%s)", exc)
            return dask_target
        if not isinstance(reply, dict) or not reply.get("jobs"):  # no plugin or no job
            return dask_target
        return max(dask_target, int(reply.get("wanted") or 0))

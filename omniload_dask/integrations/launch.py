"""One job for a ``torchrun`` world: rank 0 starts it, every rank attaches a feeder.

Frameworks start the ranks (``torchrun``, Lightning, ``accelerate launch``); the data plane is
one job for all of them. Rank 0 starts the job (an embedded cluster in its process, or on the
cluster at ``address``) and sends its name and scheduler address to the other ranks over the
framework's own process group (``torch.distributed``, gloo or nccl), so nothing but the
launcher's rendezvous needs configuring::

    shared = SharedJob.start(plan, dp=dist.get_world_size(), start_step=resume_step)
    feeder = shared.feeder()            # this rank's, from torch.distributed's rank
    ...
    shared.close()                      # every rank; rank 0 stops the job after a barrier
"""

from __future__ import annotations

from typing import Any

from omniload_dask.errors import JobError
from omniload_dask.plan import Plan

__all__ = ["SharedJob"]


class SharedJob:
    """A job that rank 0 of an initialised ``torch.distributed`` world started (``job`` is
    set there only) and every rank can make feeders of."""

    def __init__(self, name: str, address: str, info: dict[str, Any], job: Any = None) -> None:
        self.name = name
        self.address = address
        self.info = info  # the job's info (plan, tokenizer, sources), the same on every rank
        self.job = job

    @classmethod
    def start(
        cls,
        plan: Plan | str,
        *,
        address: str | None = None,
        start_step: int = 0,
        **job_args: Any,
    ) -> SharedJob:
        """Start the job on rank 0 (``Job.start(plan, address=..., start_step=..., **job_args)``)
        and hand its name and address to every rank. A collective: every rank calls it."""
        import torch.distributed as dist

        from omniload_dask.cluster.job import Job
        from omniload_dask.internals import comms as _comms

        if not (dist.is_available() and dist.is_initialized()):
            raise JobError(
                "SharedJob.start: torch.distributed is not initialised; launch with torchrun "
                "(or the framework's launcher) and let the framework set up its process group "
                "first, or use Job.start in a single process"
            )
        job = None
        message: list[Any] = [None]
        if dist.get_rank() == 0:
            try:
                job = Job.start(
                    plan,
                    address=address,
                    start_step=start_step,
                    dashboard_address=None,
                    **job_args,
                )
                sched = _comms.scheduler_address(job.client)
                message = [(job.name, sched, job.info, None)]
            except Exception as exc:  # tell the other ranks instead of leaving them waiting
                message = [(None, None, None, f"{type(exc).__name__}: {exc}")]
                dist.broadcast_object_list(message, src=0)
                raise
        dist.broadcast_object_list(message, src=0)
        name, sched, info, error = message[0]
        if error is not None:
            raise JobError(f"SharedJob.start: rank 0 could not start the job: {error}")
        return cls(name, sched, info, job)

    def feeder(self, **kwargs: Any) -> Any:
        """This rank's :class:`~omniload_dask.trainer.feeder.Feeder` (rank from
        torch.distributed unless ``rank``/``dp_rank`` is given)."""
        from omniload_dask.trainer.feeder import Feeder

        return Feeder(self.name, address=self.address, **kwargs)

    def close(self) -> None:
        """Wait for every rank (a barrier), then stop the job on rank 0. A collective."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.barrier()
        if self.job is not None:
            self.job.close()
            self.job = None

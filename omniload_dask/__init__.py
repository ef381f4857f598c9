"""omniload-dask: one data plane for many sources and many trainer ranks, built on Dask.

The public API::

    from omniload_dask import Job, load_plan
    job = Job.start(load_plan("plans/quickstart.yaml"))
    for micro_batch in job.feeder(dp_rank=0):
        ...

Importing this package does not import torch or distributed, nor start anything: the parts
that need Dask (``Job``, ``Feeder``, ``OmniloadPlugin``, ``local_cluster``) load on first use.
"""

from typing import TYPE_CHECKING, Any

from .errors import (
    CheckpointError,
    InternalError,
    JobError,
    OmniloadError,
    PlanError,
    RecordError,
    SourceError,
    TokenizerError,
)
from .plan import Plan, load_plan, parse_plan
from .sources import decode_sample_id

if TYPE_CHECKING:
    from .adaptive import OmniloadAdaptive
    from .feeder import Feeder
    from .job import Job, local_cluster
    from .scheduler_plugin import OmniloadPlugin

_LAZY = {
    "Feeder": "feeder",
    "Job": "job",
    "OmniloadAdaptive": "adaptive",
    "OmniloadPlugin": "scheduler_plugin",
    "local_cluster": "job",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "Feeder",
    "InternalError",
    "Job",
    "JobError",
    "OmniloadAdaptive",
    "OmniloadError",
    "OmniloadPlugin",
    "Plan",
    "PlanError",
    "RecordError",
    "SourceError",
    "TokenizerError",
    "decode_sample_id",
    "load_plan",
    "local_cluster",
    "parse_plan",
]

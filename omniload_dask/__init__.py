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

from omniload_dask.errors import (
    CheckpointError,
    InternalError,
    JobError,
    OmniloadError,
    PlanError,
    RecordError,
    SourceError,
    TokenizerError,
)
from omniload_dask.plan import Plan, load_plan, parse_plan
from omniload_dask.sources import decode_sample_id

if TYPE_CHECKING:
    from omniload_dask.cluster.adaptive import OmniloadAdaptive
    from omniload_dask.cluster.job import Job, local_cluster
    from omniload_dask.cluster.plugin import OmniloadPlugin
    from omniload_dask.trainer.feeder import Feeder

_LAZY = {
    "Feeder": "omniload_dask.trainer.feeder",
    "Job": "omniload_dask.cluster.job",
    "OmniloadAdaptive": "omniload_dask.cluster.adaptive",
    "OmniloadPlugin": "omniload_dask.cluster.plugin",
    "local_cluster": "omniload_dask.cluster.job",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
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

"""omniload-dask: one data plane for many sources and many trainer ranks, built on Dask.

The public API::

    from omniload_dask import Job, load_plan
    job = Job.start(load_plan("plans/quickstart.yaml"))
    for micro_batch in job.feeder(dp_rank=0):
        ...

Importing this package does not import torch or start anything.
"""

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
from .feeder import Feeder
from .job import Job, local_cluster
from .plan import Plan, load_plan, parse_plan
from .scheduler_plugin import OmniloadPlugin
from .sources import decode_sample_id

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "Feeder",
    "InternalError",
    "Job",
    "JobError",
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

"""omniload-dask: one data plane for many sources and many trainer ranks, built on Dask.

The public API::

    from omniload_dask import Job, load_plan
    job = Job.start(load_plan("plans/quickstart.yaml"))
    for micro_batch in job.feeder(dp_rank=0):
        ...

Importing this package does not import torch, dask, distributed or fsspec, nor start anything:
the parts that need them (``Job``, ``Feeder``, ``OmniloadPlugin``, ``OmniloadAdaptive``,
``local_cluster``, and ``decode_sample_id`` with the sources) load on first use.

The subpackages, by role:

- ``plan``: the YAML plan, parsed and validated into frozen specs (errors name the field).
- ``core``: the pure data plane, no I/O: cursors, read-ahead, live changes, figures, state.
- ``batching``: mixing, document cost, balancing across DP ranks, packing, batch formats.
- ``sources``: one module per file format (JSON Lines, Parquet, WebDataset), and sample ids.
- ``preprocess``: what workers do to records: tokenize, decode images, place image tokens.
- ``checkpoint``: differential checkpoints on any fsspec URL, and resuming from them.
- ``cluster``: the Dask adapter: scheduler plugin, worker tasks, job start/attach, adaptive.
- ``trainer``: the Feeder in each trainer rank, and the torch dataset adapter.
- ``observe``: monitoring, the dashboard page, Prometheus metrics, ``omniload status``.
- ``cli``: the ``omniload`` command.  ``demo``: demo data from fixed seeds.

Beside them: ``errors`` (the exception tree), ``testing`` (the inline data plane and stream
checks for tests and benchmarks), ``preload`` (``dask scheduler --preload omniload_dask.preload``).
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

if TYPE_CHECKING:
    from omniload_dask.cluster.adaptive import OmniloadAdaptive
    from omniload_dask.cluster.job import Job, local_cluster
    from omniload_dask.cluster.plugin import OmniloadPlugin
    from omniload_dask.sources.ids import decode_sample_id
    from omniload_dask.trainer.feeder import Feeder

_LAZY = {
    "Feeder": "omniload_dask.trainer.feeder",
    "Job": "omniload_dask.cluster.job",
    "OmniloadAdaptive": "omniload_dask.cluster.adaptive",
    "OmniloadPlugin": "omniload_dask.cluster.plugin",
    "decode_sample_id": "omniload_dask.sources.ids",
    "local_cluster": "omniload_dask.cluster.job",
}


def __getattr__(name: str) -> Any:
    """Import the parts that need Dask (or fsspec) when they are first asked for."""
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

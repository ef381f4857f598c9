"""Checkpoints of the data plane: differential snapshots on any fsspec URL, and resuming from them.

``store`` owns the checkpoint folder (the manifest, :class:`Checkpoint` that reads and verifies
it, :class:`CheckpointWriter` that appends deltas and compacts bases); ``resume`` owns what
resuming needs on top (checking that the plans agree, the source registry, a changed plan taking
over). The data plane's state itself (snapshots and deltas) is :mod:`omniload_dask.core.state`'s.
"""

from omniload_dask.checkpoint.resume import (
    apply_new_plan,
    check_catalogs,
    compare_resume_keys,
    load_for_resume,
    registry_plan,
)
from omniload_dask.checkpoint.store import FORMAT, VERSION, Checkpoint, CheckpointWriter

__all__ = [
    "FORMAT",
    "VERSION",
    "Checkpoint",
    "CheckpointWriter",
    "apply_new_plan",
    "check_catalogs",
    "compare_resume_keys",
    "load_for_resume",
    "registry_plan",
]

"""Preload module: ``dask scheduler --preload omniload_dask.preload`` installs the data plane."""

from __future__ import annotations

from typing import Any

from omniload_dask.cluster.plugin import OmniloadPlugin


def dask_setup(scheduler: Any) -> None:
    scheduler.add_plugin(OmniloadPlugin(), idempotent=True)

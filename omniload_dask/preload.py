"""The scheduler preload that installs the data plane on a Dask scheduler started by hand::

    dask scheduler --preload omniload_dask.preload

Dask imports this module in the scheduler's process and calls :func:`dask_setup`, which adds
:class:`~omniload_dask.cluster.plugin.OmniloadPlugin`; jobs are then started from any client
(``Job.start(plan, address=...)``). Without the preload, ``Job.start`` registers the plugin on
the running scheduler itself; registering it twice is harmless.
"""

from __future__ import annotations

from typing import Any

from omniload_dask.cluster.plugin import OmniloadPlugin


def dask_setup(scheduler: Any) -> None:
    """Dask's preload hook: add the data-plane plugin to ``scheduler`` (once)."""
    scheduler.add_plugin(OmniloadPlugin(), idempotent=True)

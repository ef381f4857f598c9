"""The preload for a Dask cluster started by hand, on the scheduler and on the workers::

    dask scheduler --preload omniload_dask.preload
    dask worker tcp://scheduler:8786 --nthreads 3 --resources omniload-read=2 \\
        --preload omniload_dask.preload

Dask imports this module in the scheduler's or worker's process and calls :func:`dask_setup`.
On the scheduler it adds :class:`~omniload_dask.cluster.plugin.OmniloadPlugin`; jobs are then
started from any client (``Job.start(plan, address=...)``). Without the preload,
``Job.start`` registers the plugin on the running scheduler itself; registering it twice is
harmless.

On both, importing it makes the loader's cluster settings this process's Dask defaults (the
settings the embedded cluster runs with, :mod:`omniload_dask.cluster.settings`; a value the
user configured wins). Dask reads most of them after it imported the preload; the few a worker
read before (its event-loop tick, disk counters) :func:`dask_setup` sets on the worker.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from typing import Any

from omniload_dask.cluster import settings
from omniload_dask.cluster.plugin import OmniloadPlugin
from omniload_dask.internals import server as _server

settings.apply_defaults()


# The readers' libraries, imported by a worker while it waits for its first job: pyarrow (Arrow,
# Parquet) pulls pandas in on its first array conversion, which takes seconds on a busy host;
# the order (pyarrow whole before pandas) is the one pyarrow's own lazy import takes.
WARM_MODULES = ("pyarrow", "pyarrow.ipc", "pyarrow.parquet", "pyarrow.compute", "pandas")


def warm_imports(modules: tuple[str, ...] = WARM_MODULES) -> list[str]:
    """Import ``modules`` (those not installed are left out); returns the ones imported. A
    job's first discovery and first reads then do not pay for them, so its first batch does
    not wait on Python imports."""
    done = []
    for name in modules:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
            done.append(name)
    return done


def dask_setup(server: Any) -> None:
    """Dask's preload hook: add the data-plane plugin to a scheduler (once); tune a worker and
    import its readers' libraries in the background (:func:`warm_imports`)."""
    if _server.is_scheduler(server):
        server.add_plugin(OmniloadPlugin(), idempotent=True)
    else:
        _server.tune_server(server)
        threading.Thread(target=warm_imports, name="omniload-warm-imports", daemon=True).start()

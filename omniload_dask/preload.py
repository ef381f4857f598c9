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


# The readers' libraries, for a cluster whose jobs read Arrow, Parquet or MDS: pyarrow pulls
# pandas in on its first array conversion, which takes seconds on a busy host; the order
# (pyarrow whole before pandas) is the one pyarrow's own lazy import takes. Not imported by
# default: they cost a worker about 100 MiB and half a CPU-second, which a text job never
# needs and which competes with its first reads.
READER_MODULES = ("pyarrow", "pyarrow.ipc", "pyarrow.parquet", "pyarrow.compute", "pandas")
WARM_KEY = "omniload.warm-imports"  # Dask config (env: DASK_OMNILOAD__WARM_IMPORTS)


def warm_modules() -> tuple[str, ...]:
    """The modules a worker imports in the background before its first job: the Dask config
    ``omniload.warm-imports``, a list of module names, or ``readers`` for
    :data:`READER_MODULES`; none by default."""
    import dask.config

    value = dask.config.get(WARM_KEY, [])
    if value == "readers":
        return READER_MODULES
    if not isinstance(value, (list, tuple)) or not all(isinstance(m, str) for m in value):
        raise TypeError(
            f"Dask config {WARM_KEY} must be a list of module names or 'readers', got {value!r}"
        )
    return tuple(value)


def warm_imports(modules: tuple[str, ...]) -> list[str]:
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
    import the configured modules in the background (:func:`warm_modules`)."""
    if _server.is_scheduler(server):
        server.add_plugin(OmniloadPlugin(), idempotent=True)
    else:
        _server.tune_server(server)
        modules = warm_modules()
        if modules:
            threading.Thread(
                target=warm_imports, args=(modules,), name="omniload-warm-imports", daemon=True
            ).start()

"""The Dask settings and process environment that a loader's cluster runs best with.

The embedded cluster (:func:`.job.local_cluster`) sets them itself; a cluster started by hand
gets the same through the preload, on the scheduler and on every worker::

    dask scheduler --preload omniload_dask.preload
    dask worker tcp://scheduler:8786 --nthreads 3 --resources omniload-read=2 \\
        --preload omniload_dask.preload

What they change, and why (the effects are measured by the head-to-head benchmark; the
figures live in ``BENCHMARKS.md``, by date and commit):

- ``worker-saturation: inf``: reads and constructions are coarse tasks; with root-task
  queuing a small task waits for a slot the scheduler hands out in turns, and starts later.
- the workers' statistical profiler off (a stack sample of every thread every 10 ms), disk I/O
  counters off, process memory checked every 0.5 s instead of 0.1 s, and the event-loop health
  tick (it only warns) every 0.2 s instead of 20 ms: work that serves nobody in a loader's
  cluster and costs the workers' event loop CPU on every tick.
- Dask's developer logs at 100 entries instead of 1,000 (``low-level-log-length``: every
  comm's last sent batches, the scheduler's transitions and events): a job sends a few small
  graphs a step, and the scheduler kept the last 1,000 batches of each comm, serialized graphs
  and all, and their turnover kept fragmenting the heap (its free space grew, what was in use
  did not): the scheduler's memory crept up with the steps; with 100 it stays small.
- ``TOKENIZERS_PARALLELISM=false`` in the worker processes: a Hugging Face tokenizer would
  otherwise run each ``encode_batch`` on its own thread pool, one thread per core, inside every
  one of Dask's task threads; on a small machine those pools fight the task threads for the
  cores, and reads run in parallel anyway.

They go in as Dask *defaults* (:func:`dask.config.update_defaults`): a value the user set in
their own Dask config or in a ``DASK_*`` variable stays as the user set it, and so does a
``TOKENIZERS_PARALLELISM`` already in the environment.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = [
    "DASK_SETTINGS",
    "LOG_ENTRIES",
    "TICK_SECONDS",
    "apply_defaults",
    "nested",
    "single_threaded_tokenizers",
]

TICK_SECONDS = 0.2
LOG_ENTRIES = 100  # Dask's developer logs: messages, transitions, events (Dask: 1,000)
DASK_SETTINGS: dict[str, Any] = {
    "distributed.scheduler.worker-saturation": "inf",
    "distributed.worker.profile.enabled": False,
    "distributed.admin.system-monitor.disk": False,
    "distributed.worker.memory.monitor-interval": "500ms",
    "distributed.admin.tick.interval": f"{int(TICK_SECONDS * 1000)}ms",
    "distributed.admin.low-level-log-length": LOG_ENTRIES,
}


def nested(flat: dict[str, Any]) -> dict[str, Any]:
    """``{"a.b.c": v}`` as ``{"a": {"b": {"c": v}}}`` (the form Dask's defaults take)."""
    out: dict[str, Any] = {}
    for dotted, value in flat.items():
        *path, last = dotted.split(".")
        node = out
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return out


def apply_defaults() -> None:
    """Make :data:`DASK_SETTINGS` this process's Dask defaults (user values win) and keep
    tokenizer thread pools off (:func:`single_threaded_tokenizers`)."""
    import dask.config

    dask.config.update_defaults(nested(DASK_SETTINGS))
    single_threaded_tokenizers()


def single_threaded_tokenizers() -> None:
    """Encode in the calling thread: no Hugging Face tokenizer thread pool in this process
    (unless ``TOKENIZERS_PARALLELISM`` is set already). Called in every read task, so that a
    worker started without the preload gets it too."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

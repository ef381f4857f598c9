"""The nanny preload that keeps a ``dask worker`` through a scheduler restart::

    dask worker tcp://scheduler:8786 --nthreads 3 --resources omniload-read=2 \\
        --preload-nanny omniload_dask.rejoin

A Dask worker whose scheduler connection breaks closes, and by default it asks its nanny to
close too, so the whole ``dask worker`` process exits and someone must start it again. With
this preload the nanny declines that one request (:func:`~omniload_dask.internals.server.
keep_nanny_on_scheduler_loss`): the worker process still exits, and the nanny starts a fresh
one, which waits for a scheduler at the same address (for ever, or ``--death-timeout``
seconds) and joins it. Every other way of closing a worker (a Dask cluster's ``close()``,
``client.shutdown()``, retiring it, SIGTERM) closes the nanny as before.

The embedded cluster needs nothing of this: its scheduler lives in the trainer's process.
"""

from __future__ import annotations

from typing import Any

from omniload_dask.internals import server as _server


def dask_setup(nanny: Any) -> None:
    """Dask's preload hook (``--preload-nanny``): keep ``nanny`` when its scheduler is lost."""
    _server.keep_nanny_on_scheduler_loss(nanny)

"""The data plane's own client, watched: a lost connection never stalls a job silently.

The plugin submits reads and constructions through one Dask client on the scheduler. If that
client's connection breaks (an overloaded host, ``TCP_USER_TIMEOUT``), the scheduler forgets
what it held and Dask cancels its futures, while the feeders keep polling. Every
``WATCH_SECONDS`` the watchdog looks::

    client on its first connection, and the scheduler keeps every key it holds    fine
    its connection broke (even if Dask reconnected it: the scheduler may still
    remove the old connection's client, same id, and forget its keys silently)   a new client
                                                                                 replaces it;
                                                                                 the jobs
                                                                                 submit again
    connected, but the scheduler forgot keys a job holds                         submit again
    no new client can connect within RECONNECT_TIMEOUT                           the jobs fail,
                                                                                 saying so

Reads and constructions are deterministic, so what is submitted again is what was lost.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from omniload_dask.cluster.lifecycle import RECONNECT_TIMEOUT, DataPlaneClient
from omniload_dask.cluster.running import RunningJob
from omniload_dask.core.events import Cause
from omniload_dask.internals import server as _server

__all__ = ["WATCH_SECONDS", "check_client", "watch_client"]

logger = logging.getLogger(__name__)
WATCH_SECONDS = 1.0
SETTLE_SECONDS = 2.0  # a key submitted this long ago must be known to the scheduler


async def watch_client(
    scheduler: Any, data_client: DataPlaneClient, jobs: Callable[[], list[RunningJob]]
) -> None:
    """Check ``data_client`` and the ``jobs()`` on it every ``WATCH_SECONDS``, for ever."""
    while True:
        await asyncio.sleep(WATCH_SECONDS)
        try:
            await check_client(scheduler, data_client, jobs())
        except Exception:  # the watchdog must outlive whatever went wrong once
            logger.exception("omniload: checking the data plane's client failed")


async def check_client(
    scheduler: Any, data_client: DataPlaneClient, jobs: list[RunningJob]
) -> None:
    """One look (see the module docstring)."""
    client = data_client.current
    if client is None or not jobs or not _server.scheduler_running(scheduler):
        return
    if not data_client.healthy():
        try:
            client = await asyncio.wait_for(data_client.replace(), RECONNECT_TIMEOUT)
        except Exception as exc:
            for run in jobs:
                run.fail(
                    "the data plane lost its connection to the scheduler and could not "
                    f"connect again: {type(exc).__name__}: {exc}",
                    Cause.CONNECTION,
                )
            return
        for run in jobs:
            run.on_client_lost(client)
        return
    for run in jobs:
        settled = run.executor.held_for(SETTLE_SECONDS)
        if run.executor.lost() or _server.unwanted(scheduler, client, settled):
            run.on_client_lost(client)

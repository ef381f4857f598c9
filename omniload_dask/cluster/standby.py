"""Standby copies: a second in-memory copy of upcoming batches and shards, on another worker.

With ``loader.standby`` on, every batch a rank will fetch and every shard a construction will
read is replicated once it is in memory (the paper's "shadow loader"): losing one worker then
costs no recomputation, the feeder fetches from the other holder. Replication is Dask's own
Active Memory Manager's, driven by a policy (see :func:`~omniload_dask.internals.amm.
install_standby`); this module decides which keys it covers and when it runs::

    read or batch key reaches memory, the job still holds it  ->  keep(key)
    a burst of keep() calls within 20 ms                       ->  one memory-manager run
    the job releases the key (or stops)                        ->  forget(keys)
    a worker leaves                                            ->  worker_lost(address): the
                                                                   others stop fetching from
                                                                   it; keys left with one copy
                                                                   get a new second one

It is best effort: without an AMM, or when replication fails, lineage still recomputes lost
data.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

from omniload_dask.cluster.serving import PEER_GONE_HANDLER
from omniload_dask.core.keys import is_batch, is_read
from omniload_dask.internals import amm
from omniload_dask.internals import server as _server

__all__ = ["StandbyCopies", "is_standby_key"]

logger = logging.getLogger(__name__)
COALESCE_SECONDS = 0.02  # one memory-manager run for the batches that finish within this


def is_standby_key(key: Any) -> bool:
    """Whether ``key`` is of a kind that gets standby copies (batches and shards)."""
    return is_batch(key) or is_read(key)


class StandbyCopies:
    """The keys that get a second copy, on one scheduler (shared by its jobs)."""

    def __init__(self, scheduler: Any) -> None:
        self._scheduler = scheduler
        self._policy = amm.install_standby(scheduler, is_standby_key)
        self._run_soon = False
        self._tasks: set[asyncio.Task[None]] = set()

    def keep(self, key: str) -> None:
        """Ask for a second copy of ``key`` (in memory now) on another worker."""
        if self._policy is None:
            return
        self._policy.keys.add(key)
        if not self._run_soon:
            self._run_soon = True
            asyncio.get_running_loop().call_later(COALESCE_SECONDS, self._run)

    def worker_lost(self, address: str) -> None:
        """``address`` left: tell the other workers, and replace the copies it held."""
        loop = asyncio.get_running_loop()
        task = loop.create_task(
            _server.tell_workers_gone(self._scheduler, address, PEER_GONE_HANDLER)
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if self._policy is not None and not self._run_soon:
            self._run_soon = True
            loop.call_later(COALESCE_SECONDS, self._run)

    def forget(self, keys: Iterable[str]) -> None:
        """Stop keeping copies of ``keys`` (released: Dask drops every copy)."""
        if self._policy is not None:
            self._policy.keys.difference_update(keys)

    def _run(self) -> None:
        """One memory-manager run for the keys kept since the last one."""
        self._run_soon = False
        try:
            amm.run_memory_manager(self._scheduler)
        except Exception:  # replication is best effort: lineage still recomputes lost data
            logger.exception("omniload: standby replication failed")

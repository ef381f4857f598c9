"""When a running job writes its checkpoint: deltas queued on every data-plane run, flushed
off the event loop when due.

The coordinator records a small delta per step (:meth:`Coordinator.take_deltas`); the
:class:`~omniload_dask.checkpoint.store.CheckpointWriter` turns them into files. This module
schedules the two on the scheduler's event loop without ever blocking it::

    every data-plane run      tick(): queue the new deltas
    flush_seconds later       tick(): flush them (and the ranks' positions) in a thread;
                              one flush at a time
    compact_every steps on    that flush also writes a new base snapshot
    the job stops             final_flush(): wait for the flush in flight, flush the rest

A failed flush is logged and kept (``error``) for ``stats()``; the job runs on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from omniload_dask.checkpoint import Checkpoint, CheckpointWriter
from omniload_dask.core.coordinator import Coordinator
from omniload_dask.plan import CheckpointSpec, Plan
from omniload_dask.plan.credentials import scrub, secret_values

__all__ = ["CheckpointSchedule", "open_writer"]

logger = logging.getLogger(__name__)


async def open_writer(
    plan: Plan, coord: Coordinator, resumed: Checkpoint | None
) -> CheckpointWriter:
    """The plan's checkpoint writer, with its first base written (in a thread).

    ``resumed`` is the checkpoint the job resumes from, if any: the writer continues it.
    """
    spec = plan.checkpoint
    assert spec is not None
    writer = CheckpointWriter(
        spec.url,
        plan,
        compact_every=spec.compact_every,
        keep_bases=spec.keep_bases,
        storage_options=dict(spec.storage_options),
    )
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, writer.start, coord.state_dict(), resumed)
    coord.take_deltas()  # the base holds them
    return writer


class CheckpointSchedule:
    """Queues one job's checkpoint deltas and flushes them when due, in a thread.

    ``on_more()`` is called when deltas arrived while a flush ran, so that the job's next
    data-plane run flushes them.
    """

    def __init__(
        self,
        writer: CheckpointWriter,
        spec: CheckpointSpec,
        coord: Coordinator,
        on_more: Callable[[], None],
    ) -> None:
        self.writer = writer
        self.error: str | None = None  # the last failed flush
        self._spec = spec
        self._coord = coord
        self._on_more = on_more
        self._flushing: asyncio.Future[Any] | None = None
        self._last_flush = time.monotonic()
        # A snapshot was due at the last flush, with steps in flight: the job lets its steps
        # in flight through (it holds none back for its block), and the next tick takes it.
        self.snapshot_waits = False
        # what storage errors may echo: taken out of the log line and the error shown
        self._secrets = secret_values([spec.storage_options, {"url": spec.url}])

    def tick(self, force: bool = False) -> asyncio.Future[Any] | None:
        """Queue the new deltas; start a flush when one is due (or ``force``).

        Returns the flush in flight, if any.
        """
        writer, coord = self.writer, self._coord
        deltas = coord.take_deltas()
        if deltas:
            writer.add(deltas)
        due = time.monotonic() - self._last_flush >= self._spec.flush_seconds
        due = due or force or (self.snapshot_waits and not coord.view.busy)
        if not writer.pending() or not due:
            return self._flushing
        if self._flushing is not None and not self._flushing.done():
            return self._flushing
        # The ranks' positions go with each flush (O(ranks): not on every tick).
        writer.add([], dict(enumerate(coord.view.rank_positions())))
        latest = writer.manifest.bases[-1]["step"] if writer.manifest.bases else 0
        # No snapshot while a step is being dealt (its figures are not counted yet): the
        # next flush compacts instead.
        wanted = coord.view.next_step - latest >= self._spec.compact_every
        compact = wanted and not coord.view.busy
        self.snapshot_waits = wanted and not compact
        state = coord.state_dict() if compact else None
        self._last_flush = time.monotonic()
        self._flushing = asyncio.get_running_loop().run_in_executor(None, writer.flush, state)
        self._flushing.add_done_callback(self._flushed)
        return self._flushing

    async def final_flush(self) -> None:
        """Wait for the flush in flight, then write every delta still queued."""
        if self._flushing is not None:
            with contextlib.suppress(Exception):
                await self._flushing
        self._flushing = None
        fut = self.tick(force=True)
        if fut is not None:
            await fut

    def stats(self) -> dict[str, Any]:
        """The checkpoint's figures (what ``stats()["checkpoint"]`` shows)."""
        return self.writer.stats()

    def _flushed(self, fut: asyncio.Future[Any]) -> None:
        """A flush ended: keep its error, or have the deltas that came meanwhile flushed."""
        exc = fut.exception() if not fut.cancelled() else None
        if exc is not None:
            self.error = scrub(str(exc), self._secrets)
            logger.error("omniload checkpoint flush failed: %s", self.error)
        elif self.writer.pending():
            self._on_more()  # more arrived meanwhile

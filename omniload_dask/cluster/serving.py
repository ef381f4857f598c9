"""Serving parts of blocks from worker memory: a worker handler installed by a WorkerPlugin.

A construction task builds the batches of a block of DP groups under one key; a fetching agent
wants its own group's part (or its cp slice) only. The data plane registers :class:`PartServer`
on every worker (now and joining later); it adds the ``omniload_parts`` handler, which a
fetcher calls over Dask's comms (no Client)::

    fetcher -> worker   omniload_parts(parts=[[block key, part], ...])
    worker  -> fetcher  [part's GroupBatch or None, ...]     (None: not held here)

When a worker leaves, the data plane calls ``omniload_peer_gone(address=...)`` on the others:
a construction fetching a shard from the lost worker then asks the scheduler for the shard's
standby copy at once, instead of retrying the dead address for Dask's 30 s connect timeout.

A part travels packed (:mod:`omniload_dask.batching.wire`: plain fields in the reply's
msgpack frame and one buffer in a frame of its own, :func:`wire_part`); the construction task
packed it as it built it, so serving a part only sends it, and the fetcher unpacks it. A part
that does not pack travels as Dask serializes task results (numpy buffers out of band). The
handler counts what it sends (``sent_bytes``, ``sent_parts``) for the scale benchmark.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

from dask.sizeof import sizeof
from distributed.diagnostics.plugin import WorkerPlugin

from omniload_dask.batching.formats import BatchBlock
from omniload_dask.batching.wire import PART_HANDLER, is_packed
from omniload_dask.cluster import sizeof as _sizeof  # noqa: F401  (registers batch sizes)
from omniload_dask.internals import comms as _comms
from omniload_dask.internals import server as _server

__all__ = ["PEER_GONE_HANDLER", "PartServer", "wire_part"]

PEER_GONE_HANDLER = "omniload_peer_gone"
DROP_EVERY = 0.2  # seconds between drops of a lost worker's connection attempts


def connect_timeout() -> float:
    """Dask's connect timeout in seconds (``distributed.comm.timeouts.connect``)."""
    import dask
    from dask.utils import parse_timedelta

    return float(parse_timedelta(dask.config.get("distributed.comm.timeouts.connect"), "s") or 30)


class PartServer(WorkerPlugin):
    """Serves parts of the blocks a worker holds (see the module docstring)."""

    name = "omniload-parts"
    idempotent = True

    def __init__(self) -> None:
        self.worker: Any = None
        self.sent_bytes = 0
        self.sent_parts = 0
        self.calls = 0
        self.peers_gone: deque[str] = deque(maxlen=64)  # the latest workers lost, for tests
        self._dropping: dict[str, asyncio.Task[None]] = {}

    def setup(self, worker: Any) -> None:
        """Install the handler on ``worker``."""
        self.worker = worker
        _server.add_handlers(
            worker, "", {PART_HANDLER: self.parts, PEER_GONE_HANDLER: self.peer_gone}
        )

    def peer_gone(self, address: str) -> None:
        """The scheduler lost the worker at ``address``: stop waiting to connect to it.

        Fetches that started before this call fail now; one that starts a little later (the
        worker had an older list of who holds what) is failed by a later drop, so no task
        waits on the lost worker for Dask's connect timeout. The drops go on that long.
        """
        address = str(address)
        self.peers_gone.append(address)
        _server.drop_peer(self.worker, address)
        if address not in self._dropping:
            task = asyncio.get_running_loop().create_task(self._keep_dropping(address))
            self._dropping[address] = task
            task.add_done_callback(lambda _: self._dropping.pop(address, None))

    async def _keep_dropping(self, address: str) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + connect_timeout()
        while loop.time() < deadline:
            await asyncio.sleep(DROP_EVERY)
            _server.drop_peer(self.worker, address)

    def teardown(self, worker: Any) -> None:
        """Stop dropping lost workers' connections (the worker closes)."""
        for task in list(self._dropping.values()):
            task.cancel()

    def parts(self, parts: list[Any]) -> list[Any]:
        """The asked parts of blocks held here, in order (None where not held)."""
        self.calls += 1
        out: list[Any] = []
        for key, part in parts:
            block = _server.worker_value(self.worker, str(key))
            value = block.parts.get(int(part)) if isinstance(block, BatchBlock) else None
            if value is None:
                out.append(None)
                continue
            # packed by its construction (:func:`~omniload_dask.batching.wire.packed`),
            # unless it would not pack
            self.sent_bytes += sizeof(value)
            self.sent_parts += 1
            out.append(wire_part(value))
        return out


def wire_part(value: Any) -> Any:
    """A part held by a worker as the part handler sends it: a packed part with its buffer
    in a frame of its own (not copied into the msgpack frame), anything else as Dask
    serializes task results."""
    if is_packed(value):
        return {**value, "buffer": _comms.wire(value["buffer"])}
    return _comms.wire(value)

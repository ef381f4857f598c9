"""Serving parts of blocks from worker memory: a worker handler installed by a WorkerPlugin.

A construction task builds the batches of a block of DP groups under one key; a fetching agent
wants its own group's part (or its cp slice) only. The data plane registers :class:`PartServer`
on every worker (now and joining later); it adds the ``omniload_parts`` handler, which a
fetcher calls over Dask's comms (no Client)::

    fetcher -> worker   omniload_parts(parts=[[block key, part], ...])
    worker  -> fetcher  {"parts": [part or None, ...],       (None: not held here)
                         "buffer": the packed parts' buffers, joined}

When a worker leaves, the data plane calls ``omniload_peer_gone(address=...)`` on the others:
a construction fetching a shard from the lost worker then asks the scheduler for the shard's
standby copy at once, instead of retrying the dead address for Dask's 30 s connect timeout.

A part travels packed (:mod:`omniload_dask.batching.wire`: plain fields in the reply's
msgpack frame, and the buffers of all the parts of a reply joined in a frame of their own,
:func:`wire_parts`); the construction task
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

from omniload_dask.batching.block import BatchBlock
from omniload_dask.batching.wire import PART_HANDLER, is_packed, join_parts
from omniload_dask.cluster import sizeof as _sizeof  # noqa: F401  (registers batch sizes)
from omniload_dask.internals import comms as _comms
from omniload_dask.internals import server as _server

__all__ = ["PEER_GONE_HANDLER", "PartServer", "wire_parts"]

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

    def parts(self, parts: list[Any]) -> dict[str, Any]:
        """The asked parts of blocks held here, in order (None where not held), packed ones
        with their buffers joined (:func:`wire_parts`)."""
        self.calls += 1
        out: list[Any] = []
        for key, part in parts:
            block = _server.worker_value(self.worker, str(key))
            value = block.parts.get(int(part)) if isinstance(block, BatchBlock) else None
            if value is not None:
                # packed by its construction (:func:`~omniload_dask.batching.wire.packed`),
                # unless it would not pack; a packed part's bytes are its buffer's and fields'
                # (Dask's sizeof of its dict costs microseconds a part)
                self.sent_bytes += (
                    value["buffer"].nbytes + len(value["micro"])
                    if is_packed(value)
                    else sizeof(value)
                )
                self.sent_parts += 1
            out.append(value)
        return wire_parts(out)


def wire_parts(values: list[Any]) -> dict[str, Any]:
    """Parts held by a worker as the part handler replies with them: the packed ones' buffers
    joined into one, in a frame of its own (:func:`~omniload_dask.batching.wire.join_parts`),
    anything else as Dask serializes task results; the fetcher reads the reply with
    :func:`~omniload_dask.batching.wire.split_parts`."""
    items, buffer = join_parts(values)
    joined = [v is None or (isinstance(v, dict) and "span" in v) for v in items]
    reply: dict[str, Any] = {
        "parts": [v if plain else _comms.wire(v) for v, plain in zip(items, joined, strict=True)]
    }
    if buffer is not None:
        reply["buffer"] = _comms.wire(buffer)
    return reply

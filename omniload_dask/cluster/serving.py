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

A part travels packed (:func:`pack_part`): its arrays copied into one buffer, described by a
few plain fields in the reply's msgpack frame, and the buffer out of band in a frame of its
own, so that neither side pickles the part or splits it into a frame per array (packing is
one copy per array; pickling a :class:`GroupBatch` walks every array and field, several
times the cost on both sides)::

    {"step": 40, "group": 1,
     "micro": msgpack of [[["input_ids", "<u4", [8192], 0], ["num_tokens", None, 8190, 0],
              ...], ...],   field: [name, dtype (None: a plain value), shape or value, offset]
     "buffer": uint8 array}                                       (its own frame on the wire)

The construction task packs every part of its block as it builds it (:func:`packed`), so
serving a part only sends it. The buffer is a numpy array, not a byte string, because of the
block's standby copy (pickled by Dask for the worker that keeps it): pickle protocol 5 sends
an array out of band, without copying it, while a byte string is copied into the pickle and
then searched end to end by Dask for a reference to ``__main__`` (on the sending worker's
event loop, in time that grows with the block). The buffer is read-only
where it is held; the fetcher unpacks a part (:func:`unpack_part`) into arrays that view one
writable copy of it. A part holding anything else (object arrays, numpy scalars)
or larger than ``PACK_LIMIT`` travels as Dask serializes task results (numpy buffers out of
band). The handler counts what it sends (``sent_bytes``, ``sent_parts``) for the scale
benchmark.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

import msgpack
import numpy as np
from dask.sizeof import sizeof
from distributed.diagnostics.plugin import WorkerPlugin

from omniload_dask.batching.formats import BatchBlock, GroupBatch
from omniload_dask.cluster import internals as _dask
from omniload_dask.cluster import sizeof as _sizeof  # noqa: F401  (registers batch sizes)

__all__ = [
    "PACK_LIMIT",
    "PART_HANDLER",
    "PEER_GONE_HANDLER",
    "PartServer",
    "is_packed",
    "pack_part",
    "packed",
    "unpack_part",
    "wire_part",
]

PART_HANDLER = "omniload_parts"
PEER_GONE_HANDLER = "omniload_peer_gone"
DROP_EVERY = 0.2  # seconds between drops of a lost worker's connection attempts
PACK_LIMIT = 16 * 2**20  # bytes: larger parts (many image patches) go out of band as they are
_ALIGN = 8  # each array starts at a multiple of this in the packed buffer
_PLAIN = (int, float, str, bool, type(None))  # values msgpack gives back as they were


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
        _dask.add_handlers(
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
        _dask.drop_peer(self.worker, address)
        if address not in self._dropping:
            task = asyncio.get_running_loop().create_task(self._keep_dropping(address))
            self._dropping[address] = task
            task.add_done_callback(lambda _: self._dropping.pop(address, None))

    async def _keep_dropping(self, address: str) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + connect_timeout()
        while loop.time() < deadline:
            await asyncio.sleep(DROP_EVERY)
            _dask.drop_peer(self.worker, address)

    def teardown(self, worker: Any) -> None:
        """Stop dropping lost workers' connections (the worker closes)."""
        for task in list(self._dropping.values()):
            task.cancel()

    def parts(self, parts: list[Any]) -> list[Any]:
        """The asked parts of blocks held here, in order (None where not held)."""
        self.calls += 1
        out: list[Any] = []
        for key, part in parts:
            block = _dask.worker_value(self.worker, str(key))
            value = block.parts.get(int(part)) if isinstance(block, BatchBlock) else None
            if value is None:
                out.append(None)
                continue
            # packed by its construction (:func:`packed`), unless it would not pack
            self.sent_bytes += sizeof(value)
            self.sent_parts += 1
            out.append(wire_part(value))
        return out


def packed(batch: Any) -> Any:
    """``batch`` as a worker serves it: packed (:func:`pack_part`) where it packs within
    ``PACK_LIMIT``, else ``batch`` itself (it then travels as Dask serializes task results)."""
    if not isinstance(batch, GroupBatch) or sizeof(batch) > PACK_LIMIT:
        return batch
    out = pack_part(batch)
    return out if out is not None else batch


def wire_part(value: Any) -> Any:
    """A part held by a worker as the part handler sends it: a packed part with its buffer
    in a frame of its own (not copied into the msgpack frame), anything else as Dask
    serializes task results."""
    if is_packed(value):
        return {**value, "buffer": _dask.wire(value["buffer"])}
    return _dask.wire(value)


def is_packed(value: Any) -> bool:
    """Whether ``value`` is a packed part (what :func:`pack_part` returns)."""
    return isinstance(value, dict) and "buffer" in value and "micro" in value


def pack_part(batch: Any) -> dict[str, Any] | None:
    """``batch`` (a :class:`GroupBatch`) as plain fields and one buffer (module docstring);
    None where it holds a value that would not come back the same."""
    if not isinstance(batch, GroupBatch):
        return None
    arrays: list[tuple[int, np.ndarray]] = []
    offset = 0
    micro = []
    for mb in batch.micro_batches:
        fields: list[list[Any]] = []
        for name, value in mb.items():
            if isinstance(value, np.ndarray):
                if value.dtype.hasobject:
                    return None
                offset += -offset % _ALIGN
                fields.append([name, value.dtype.str, list(value.shape), offset])
                arrays.append((offset, value))
                offset += value.nbytes
            elif type(value) in _PLAIN:
                fields.append([name, None, value, 0])
            else:
                return None
        micro.append(fields)
    buffer = np.zeros(offset, np.uint8)
    for start, value in arrays:
        if value.size:  # (a memoryview cannot cast an empty many-dimensional array)
            flat = np.ascontiguousarray(value).reshape(-1).view(np.uint8)
            buffer[start : start + flat.size] = flat
    # Read-only: a fetcher in the worker's own process (Dask's inproc comms pass objects as
    # they are) must not get a view it could write into; the fetcher copies it once.
    buffer.flags.writeable = False
    # The fields go as one msgpack string: Dask sizes every reply before it writes it (its
    # sizeof walks nested lists item by item: five times the cost of packing the part).
    fields_packed = msgpack.packb(micro, use_bin_type=True)
    return {"step": batch.step, "group": batch.group, "micro": fields_packed, "buffer": buffer}


def unpack_part(packed: Any) -> Any:
    """The :class:`GroupBatch` of a packed part (anything else is returned as is). Its arrays
    view one writable copy of the buffer (none where it came writable)."""
    if not isinstance(packed, dict):
        return packed
    buffer = packed["buffer"]
    if not (isinstance(buffer, np.ndarray) and buffer.flags.writeable):
        buffer = bytearray(buffer)  # read-only (bytes, a read-only frame): one copy, writable
    described = packed["micro"]
    if isinstance(described, bytes):
        described = msgpack.unpackb(described, raw=False)
    micro = []
    for fields in described:
        mb: dict[str, Any] = {}
        for name, dtype, shape, offset in fields:
            if dtype is None:
                mb[name] = shape
                continue
            kind = np.dtype(dtype)
            count = int(np.prod(shape, dtype=np.int64))
            mb[name] = np.frombuffer(buffer, kind, count, offset).reshape(shape)
        micro.append(mb)
    return GroupBatch(step=int(packed["step"]), group=int(packed["group"]), micro_batches=micro)

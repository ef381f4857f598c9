"""A fetching agent's connections to the data plane and the workers, without a Dask Client.

A ``distributed.Client`` heartbeats and polls the scheduler every few seconds: at thousands of
fetching agents that alone would be a large share of a scheduler's budget. An agent needs two
things only, to call the data plane's handlers on the scheduler and to get parts of blocks
from the workers that hold them, and a :class:`Link` does both over Dask's own comms (pools of
connections, TLS from a ``distributed.Security``). Every link of a process runs on one event
loop in a background thread; each keeps its own connections, so simulated agents sharing a
process connect as real ones would::

    link = Link("tcp://scheduler:8786")              # security=Security(...) for TLS
    link.call("info", job="quickstart")              -> the job's info (plain data)
    link.fetch([(key, part), ...], who_has)          -> {(key, part): GroupBatch}
    link.close()

A lost connection is opened again on the next call (a restarted scheduler at the same address
is simply found again); callers retry what failed (see :func:`.fetch.retryable`). Before it
opens a comm to a worker (or to a scheduler it lost), a link checks with a bare TCP connect
that the address does not refuse (:func:`refused`): a killed worker then costs no wait for
Dask's connect retries, and the other holder is asked at once. (The server logs such a check
at INFO as "closed before handshake completed"; ``tls://`` addresses are not checked.)
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import zlib
from collections import defaultdict, deque
from collections.abc import Coroutine, Sequence
from typing import Any

# Dask's comms are the link's whole transport: imported with the Feeder (as a training script's
# imports, at its top), not on the way to its first batch.
import distributed  # noqa: F401

from omniload_dask.batching.wire import PART_HANDLER, split_parts, unpack_part
from omniload_dask.internals import comms as _comms

__all__ = [
    "CALL_SLACK",
    "FETCH_TIMEOUT",
    "SCHEDULER_CONNECT_TIMEOUT",
    "WORKER_CONNECT_TIMEOUT",
    "Link",
    "io_loop",
]

SCHEDULER_CONNECT_TIMEOUT = 10.0
WORKER_CONNECT_TIMEOUT = 1.0  # then the standby copy, or the data plane is asked again
CALL_SLACK = 30.0  # seconds a call may take beyond what the data plane holds it for
FETCH_TIMEOUT = SCHEDULER_CONNECT_TIMEOUT + CALL_SLACK  # seconds a fetch from workers may take

_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def io_loop() -> asyncio.AbstractEventLoop:
    """The process's event loop for links, running in a daemon thread (made on first use)."""
    global _loop
    with _loop_lock:
        if _loop is None or _loop.is_closed():
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name="omniload-io", daemon=True)
            thread.start()
            _loop = loop
        return _loop


class Link:
    """One fetching agent's connections: to the scheduler at ``address`` and to workers.

    ``salt`` spreads agents over the holders of a block (its first copy or its standby).
    """

    def __init__(self, address: str, security: Any = None, *, salt: int = 0) -> None:
        self.address = address
        self.security = security
        self.salt = salt
        self._loop = io_loop()
        self._scheduler = _comms.connection_pool(security, SCHEDULER_CONNECT_TIMEOUT, limit=4)
        self._workers = _comms.connection_pool(security, WORKER_CONNECT_TIMEOUT)
        self._closed = False
        self._unreachable: set[str] = set()  # workers whose last fetch failed
        self._scheduler_lost = False  # the last call failed on its connection
        self.failed_fetches = 0  # fetches from a worker that failed (then another was tried)
        self.fetch_errors: deque[tuple[str, str]] = deque(maxlen=8)  # the latest: (worker, error)
        self._run(self._start(), SCHEDULER_CONNECT_TIMEOUT)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop this link's calls run on (see :func:`io_loop`)."""
        return self._loop

    async def _start(self) -> None:
        await _comms.start_pool(self._scheduler)
        await _comms.start_pool(self._workers)

    def call(self, handler: str, /, *, wait: float = 0.0, **kwargs: Any) -> Any:
        """Call the data plane's handler ``omniload_<handler>`` (which may hold the call for
        ``wait`` seconds); the reply as plain data, with lists."""
        return self._run(self.acall(handler, kwargs), wait + CALL_SLACK)

    async def acall(self, handler: str, kwargs: dict[str, Any]) -> Any:
        """:meth:`call` as a coroutine on the links' loop (:meth:`run` several in one go)."""
        return _lists(await self._call(handler, kwargs))

    async def _call(self, handler: str, kwargs: dict[str, Any]) -> Any:
        if (
            self._scheduler_lost
            and not _comms.pooled(self._scheduler, self.address)
            and await refused(self.address, SCHEDULER_CONNECT_TIMEOUT)
        ):  # the scheduler is down (restarting): the caller's backoff decides when to retry,
            # not Dask's connect, whose backoff grows to seconds while it is refused
            raise ConnectionRefusedError(f"the scheduler at {self.address} refused the connection")
        try:
            reply = await _comms.rpc(self._scheduler, self.address, "omniload_" + handler, **kwargs)
        except OSError:
            self._scheduler_lost = True
            raise
        self._scheduler_lost = False
        return reply

    def warm(self, workers: Sequence[str]) -> None:
        """Connect to ``workers`` in the background (not waited for): an agent's first fetch
        from one of them then finds its comm open, instead of setting one up while its rank
        waits for the first batch. A worker that cannot be reached is left to the fetch."""
        for address in workers:
            asyncio.run_coroutine_threadsafe(self._warm(address), self._loop)

    async def _warm(self, address: str) -> None:
        with contextlib.suppress(Exception):  # (the fetch meets the error, if it needs it)
            if not _comms.pooled(self._workers, address):
                await _comms.connect_pooled(self._workers, address)

    def fetch(
        self, refs: list[tuple[str, int]], who_has: dict[str, list[str]]
    ) -> dict[tuple[str, int], Any]:
        """The parts ``refs`` = (block key, part), from the workers holding them: one call per
        worker, a second holder tried for what the first could not give. A part no holder
        gave is left out."""
        return dict(self._run(self.afetch(refs, who_has), FETCH_TIMEOUT))

    async def afetch(
        self, refs: list[tuple[str, int]], who_has: dict[str, list[str]]
    ) -> dict[tuple[str, int], Any]:
        """:meth:`fetch` as a coroutine on the link's loop (one hand-off for a whole round
        trip, see :func:`omniload_dask.trainer.fetch.fetch_steps`)."""
        got: dict[tuple[str, int], Any] = {}
        pending = list(dict.fromkeys(refs))
        order = {ref: self._order(who_has.get(ref[0]) or [], ref[0]) for ref in pending}
        for attempt in range(2):
            by_worker: dict[str, list[tuple[str, int]]] = defaultdict(list)
            for ref in pending:
                holders = order[ref]
                if len(holders) > attempt:
                    by_worker[holders[attempt]].append(ref)
            if not by_worker:
                break
            replies = await asyncio.gather(
                *(self._from_worker(addr, mine) for addr, mine in by_worker.items()),
                return_exceptions=True,
            )
            for addr, mine, reply in zip(by_worker, by_worker.values(), replies, strict=True):
                if isinstance(reply, BaseException):
                    if not isinstance(reply, (OSError, asyncio.TimeoutError)):
                        raise reply
                    self._unreachable.add(addr)  # tried last until it answers again
                    self.failed_fetches += 1
                    self.fetch_errors.append((addr, f"{type(reply).__name__}: {reply}"))
                    continue
                self._unreachable.discard(addr)
                for ref, value in zip(mine, reply, strict=True):
                    if value is not None:
                        got[ref] = value
            pending = [ref for ref in pending if ref not in got]
            if not pending:
                break
        return got

    def _order(self, holders: list[str], key: str) -> list[str]:
        """The holders of ``key`` in the order to try them: spread over agents by ``salt``,
        workers that could not be reached lately last (a worker just killed may still be
        listed until the scheduler notices)."""
        if not holders:
            return holders
        first = (self.salt + zlib.crc32(key.encode())) % len(holders)
        turned = holders[first:] + holders[:first]
        if self._unreachable:
            turned.sort(key=lambda addr: addr in self._unreachable)
        return turned

    async def _from_worker(self, address: str, refs: list[tuple[str, int]]) -> list[Any]:
        if not _comms.pooled(self._workers, address) and await refused(
            address, WORKER_CONNECT_TIMEOUT
        ):  # a killed worker: no waiting for Dask's connect retries, the other holder now
            raise ConnectionRefusedError(f"worker {address} refused the connection")
        reply = await _comms.rpc(
            self._workers, address, PART_HANDLER, parts=[[k, p] for k, p in refs]
        )
        values = split_parts(list(reply["parts"]), reply.get("buffer"))
        return [unpack_part(value) for value in values]

    def connections(self) -> int:
        """Comms this link holds open now (to the scheduler and to workers)."""
        return _comms.open_comms(self._scheduler) + _comms.open_comms(self._workers)

    def close(self) -> None:
        """Close every connection (idempotent)."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):  # best effort: the loop may be going away at exit
            self._run(self._close(), 10.0)

    async def _close(self) -> None:
        await _comms.close_pool(self._scheduler)
        await _comms.close_pool(self._workers)

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float) -> Any:
        """Run ``coro`` (made of :meth:`acall` and :meth:`afetch`) on the links' loop and wait
        for it (at most ``timeout`` s): one hand-off between threads for all of it."""
        return self._run(coro, timeout)

    def _run(self, coro: Coroutine[Any, Any, Any], timeout: float) -> Any:
        """Run ``coro`` on the links' loop and wait for it (at most ``timeout`` s)."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise


async def refused(address: str, timeout: float) -> bool:
    """Whether a plain TCP connection to ``address`` (``tcp://`` only) is refused at once.

    Dask's ``connect`` retries a refused connection until its timeout; a link asks this first
    before it opens a comm to a worker, since a refusal means that no process listens there
    (a killed worker; its nanny starts the new one on another port). False for other schemes
    (a TLS server would log a bare probe) and when the host does not answer in time.
    """
    from distributed.comm import get_address_host_port, parse_address

    if parse_address(address)[0] != "tcp":
        return False
    host, port = get_address_host_port(address)
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except ConnectionRefusedError:
        return True
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    return False


def _lists(value: Any) -> Any:
    """msgpack turns lists into tuples: turn them back, all the way down."""
    if isinstance(value, (list, tuple)):
        return [_lists(v) for v in value]
    if isinstance(value, dict):
        return {k: _lists(v) for k, v in value.items()}
    return value

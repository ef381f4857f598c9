"""Calls over Dask's comms: a fetching agent's, without a ``Client``, and a client's.

A fetching agent (a feeder, a group leader, a node agent) needs no ``Client``: it calls the
data plane's handlers and the workers' part handler (:mod:`omniload_dask.cluster.serving`) with
Dask's comms (``ConnectionPool``), and fetches no futures: the data plane holds each block until
every rank of its groups has passed it. A process that has a client (the CLI, ``Job``) calls the
same handlers with :func:`call`. Either way an argument must fit msgpack
(:func:`check_sendable`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omniload_dask.errors import JobError


def scheduler_address(client: Any) -> str | None:
    """The address of the scheduler ``client`` talks to (None if it has none yet)."""
    return client.scheduler.address if client.scheduler is not None else None


def connection_pool(security: Any, connect_timeout: float, limit: int = 64) -> Any:
    """Dask's pool of comms (``distributed.core.ConnectionPool``) with the client side of
    ``security`` (a ``distributed.Security``; None: Dask's config, ``distributed.comm.tls.*``).

    Call :func:`start_pool` on the event loop that will use it. A fetching agent uses two:
    one to the scheduler, one to the workers (with a short ``connect_timeout``: Dask retries
    a refused connection until ``distributed.comm.timeouts.connect``, and a worker just killed
    would hold the agent that long before it tries the standby copy).
    """
    from distributed import Security
    from distributed.core import ConnectionPool

    args = (security or Security()).get_connection_args("client")
    return ConnectionPool(limit=limit, connection_args=args, timeout=connect_timeout)


async def start_pool(pool: Any) -> None:
    """Start ``pool`` on the running event loop."""
    await pool.start()


async def close_pool(pool: Any) -> None:
    """Close every comm of ``pool``."""
    await pool.close()


async def rpc(pool: Any, address: str, handler: str, /, **kwargs: Any) -> Any:
    """Call the handler ``handler`` of the Dask server at ``address`` (a scheduler's
    ``omniload_*`` handlers, or a worker's part handler, :mod:`omniload_dask.cluster.serving`) through ``pool``; a
    remote error is raised here."""
    return await getattr(pool(address), handler)(**kwargs)


async def connect_pooled(pool: Any, address: str) -> None:
    """Open a comm to ``address`` and leave it in ``pool`` for the next call there."""
    comm = await pool.connect(address)
    pool.reuse(address, comm)


def pooled(pool: Any, address: str) -> bool:
    """Whether ``pool`` holds a comm to ``address`` that is not known to be closed."""
    comms = [*pool.available.get(address, ()), *pool.occupied.get(address, ())]
    return any(not comm.closed() for comm in comms)


def open_comms(pool: Any) -> int:
    """Comms ``pool`` holds open now."""
    return int(pool.open)


def security_of(client: Any) -> Any:
    """The ``distributed.Security`` a client connects with."""
    return getattr(client, "security", None)


def wire(value: Any) -> Any:
    """``value`` marked for Dask's serialization in a handler's reply (buffers out of band)."""
    from distributed.protocol import to_serialize

    return to_serialize(value)


def call(client: Any, handler: str, /, *, call_timeout: float | None = None, **kwargs: Any) -> Any:
    """Call the scheduler handler ``omniload_<handler>`` from a synchronous client (waiting at
    most ``call_timeout`` seconds, if given).

    The reply comes back as plain data with lists (msgpack turns lists into tuples).
    """
    check_sendable(handler, kwargs)  # (msgpack would raise a bare OverflowError)
    method = getattr(client.scheduler, "omniload_" + handler)
    return _lists(client.sync(method, callback_timeout=call_timeout, **kwargs))


def _lists(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_lists(v) for v in value]
    if isinstance(value, dict):
        return {k: _lists(v) for k, v in value.items()}
    return value


def probe_scheduler(address: str, timeout: float, security: Any = None) -> None:
    """Open and close one connection to ``address`` (raises OSError/ValueError if it can't),
    with the client side of ``security`` (None: Dask's config).

    Checking first keeps a failed ``Client(...)`` from leaving a half-built client behind,
    whose clean-up prints a traceback at exit.
    """
    import asyncio

    from distributed import Security
    from distributed.comm import connect

    args = (security or Security()).get_connection_args("client")

    async def probe() -> None:
        comm = await connect(address, timeout=timeout, **args)
        await comm.close()

    asyncio.run(probe())


def check_sendable(handler: str, kwargs: Mapping[str, Any]) -> None:
    """Refuse, before sending, an argument holding an integer that msgpack cannot carry (outside
    ``-2**63 .. 2**64 - 1``): a JobError naming the handler and the argument."""

    def fits(value: Any) -> bool:
        if isinstance(value, int) and not isinstance(value, bool):
            return -(2**63) <= value < 2**64
        if isinstance(value, (list, tuple)):
            return all(fits(v) for v in value)
        if isinstance(value, Mapping):
            return all(fits(v) for v in value.values())
        return True

    for name, value in kwargs.items():
        if not fits(value):
            raise JobError(
                f"{handler}: {name} must hold integers from 0 to 2**63 - 1, got {value!r}"
            )

"""The Dask servers' internals: the scheduler's, workers' and nanny's state and hooks.

- Workers attach a read task's sample metadata to the task's own finished message (the worker
  task state's ``metadata``), which the scheduler passes to plugins' ``transition`` hooks as
  ``metadata=...``: no extra RPC and no ordering race with the result landing in memory.
- Workers serve parts of blocks from their memory (``worker.data``, :func:`worker_value`); a
  worker told that a peer left drops its comms to it (:func:`drop_peer`).
- The data plane's own client is trusted only on its first stream (:func:`client_connected`):
  the scheduler may forget every key of a client Dask reconnected.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from omniload_dask.fixes import own_message

logger = logging.getLogger(__name__)

METADATA_FIELD = "omniload"


def set_task_metadata(value: Any) -> bool:
    """Attach ``value`` to the running task's finished message; False outside a Dask worker."""
    try:
        from distributed.worker import get_worker, thread_state
    except ImportError:  # pragma: no cover - distributed is a dependency
        return False
    try:
        worker = get_worker()
        key = thread_state.key
    except (ValueError, AttributeError):
        return False
    ts = worker.state.tasks.get(key)
    if ts is None:
        return False
    ts.metadata[METADATA_FIELD] = value
    return True


def metadata_of(kwargs: dict[str, Any]) -> Any:
    """The value a task attached with :func:`set_task_metadata`, from transition kwargs."""
    metadata = kwargs.get("metadata") or {}
    return metadata.get(METADATA_FIELD)


def task_duration(kwargs: dict[str, Any]) -> float | None:
    """Compute seconds of a finished task, from transition kwargs (``startstops``)."""
    total = 0.0
    found = False
    for ss in kwargs.get("startstops") or ():
        if ss.get("action") == "compute":
            total += float(ss["stop"]) - float(ss["start"])
            found = True
    return total if found else None


def holders(scheduler: Any, key: str) -> list[str] | None:
    """Addresses of the workers holding ``key`` in memory, or None if it is not in memory."""
    ts = scheduler.tasks.get(key)
    if ts is None or ts.state != "memory" or not ts.who_has:
        return None
    return [ws.address for ws in ts.who_has]


def failure_text(scheduler: Any, key: str, kwargs: dict[str, Any]) -> str:
    """What went wrong with the erred task ``key``, from transition kwargs or its task state."""
    text = kwargs.get("exception_text")
    if not text:
        ts = scheduler.tasks.get(key)
        if ts is not None and ts.state == "erred":
            text = getattr(ts, "exception_text", "") or "task failed"
    return own_message(str(text or "failed"))  # not a repr of one of our errors


def worker_count(scheduler: Any) -> int:
    """Workers the scheduler has now."""
    return len(scheduler.workers)


def task_count(scheduler: Any) -> int:
    """Tasks the scheduler keeps state for (released ones included until it forgets them)."""
    return len(scheduler.tasks)


def is_scheduler(server: Any) -> bool:
    """Whether a preload's ``server`` is a Dask scheduler (else a worker or a nanny)."""
    from distributed import Scheduler

    return isinstance(server, Scheduler)


def tune_server(server: Any) -> None:
    """Apply to a running server what Dask read from its config before a preload could set
    it: the event-loop tick's period and the disk I/O counters of its system monitor."""
    import dask.config
    from dask.utils import parse_timedelta

    tick = parse_timedelta(dask.config.get("distributed.admin.tick.interval"), default="ms")
    callback = getattr(server, "periodic_callbacks", {}).get("tick")
    if callback is not None and tick:
        callback.callback_time = tick * 1000
        server._tick_interval = tick
    monitor = getattr(server, "monitor", None)
    if monitor is not None and not dask.config.get("distributed.admin.system-monitor.disk"):
        monitor.monitor_disk_io = False


def add_handlers(server: Any, prefix: str, handlers: dict[str, Any]) -> None:
    """Serve each of ``handlers`` as the RPC ``prefix + name`` of ``server`` (a scheduler or
    a worker)."""
    for name, handler in handlers.items():
        server.handlers[prefix + name] = handler


def scheduler_security(scheduler: Any) -> Any:
    """A ``distributed.Security`` for the clients the scheduler opens to itself (the data
    plane's client), or None where the scheduler has none.

    ``dask scheduler --tls-cert ...`` sets only the scheduler's own certificate; a client
    connection needs a client certificate, so the scheduler's stands in where no client
    certificate is configured (the same CA signed it, so the scheduler accepts it).
    """
    sec = getattr(scheduler, "security", None)
    if sec is None:
        return None
    from distributed import Security

    return Security(
        require_encryption=sec.require_encryption,
        tls_ca_file=sec.tls_ca_file,
        tls_ciphers=sec.tls_ciphers,
        tls_min_version=sec.tls_min_version,
        tls_max_version=sec.tls_max_version,
        tls_client_cert=sec.tls_client_cert or sec.tls_scheduler_cert,
        tls_client_key=sec.tls_client_key or sec.tls_scheduler_key,
        extra_conn_args=dict(sec.extra_conn_args or {}),
    )


READ_RESOURCE = "omniload-read"


def worker_threads(scheduler: Any) -> tuple[int, int]:
    """``(workers, read slots)``: threads, or the read resource where every worker has it."""
    workers = getattr(scheduler, "workers", None) or {}
    if read_resource(scheduler):
        return len(workers), sum(int(ws.resources[READ_RESOURCE]) for ws in workers.values())
    return len(workers), sum(int(getattr(ws, "nthreads", 1)) for ws in workers.values())


def worker_addresses(scheduler: Any, most: int) -> list[str]:
    """The workers' addresses, sorted, where there are at most ``most`` workers (else none)."""
    workers = getattr(scheduler, "workers", None) or {}
    return sorted(workers) if len(workers) <= most else []


def read_resource(scheduler: Any) -> bool:
    """True when every worker offers the ``omniload-read`` resource (Dask worker resources).

    Read tasks then ask for one unit of it, so a worker runs at most that many reads at once
    and keeps its other threads for constructions, which are short and must not queue behind
    a read. The embedded cluster sets this up; on other clusters start workers with
    ``--resources omniload-read=2`` and one thread more than that (two reads a tokenizing
    thread, :data:`~omniload_dask.plan.READ_SLOTS_PER_THREAD`).
    """
    workers = getattr(scheduler, "workers", None) or {}
    return bool(workers) and all(
        (getattr(ws, "resources", None) or {}).get(READ_RESOURCE, 0) > 0 for ws in workers.values()
    )


def worker_read_slots() -> int | None:
    """Inside a Dask worker, how many reads this process may run at once: its workers'
    ``omniload-read`` resource, else their threads (several workers where a cluster runs
    them in one process); None elsewhere."""
    try:
        from distributed.worker import Worker, get_worker

        workers = {get_worker(), *Worker._instances}
    except (ImportError, ValueError):
        return None
    slots = 0
    for worker in workers:
        state = worker.state
        slots += int((state.total_resources or {}).get(READ_RESOURCE) or state.nthreads)
    return max(1, slots)


def worker_value(worker: Any, key: str) -> Any:
    """The value of ``key`` in ``worker``'s memory (unspilled if need be), or None."""
    return worker.data.get(key)


def client_stream(client: Any) -> Any:
    """The stream ``client`` talks to the scheduler over (Dask's reconnect makes a new one)."""
    return client.scheduler_comm


def client_connected(scheduler: Any, client: Any, stream: Any) -> bool:
    """Whether ``client`` runs on its first ``stream`` and ``scheduler`` knows it.

    A client Dask reconnected (another stream, the same id) is not trusted: the scheduler may
    remove the old connection's client after the new one registered, and forget every key the
    client holds without telling it.
    """
    return (
        getattr(client, "status", None) == "running"
        and client.scheduler_comm is stream
        and client.id in scheduler.clients
    )


def unwanted(scheduler: Any, client: Any, keys: Any) -> list[str]:
    """The ``keys`` that ``scheduler`` no longer keeps for ``client`` (it forgot them)."""
    state = scheduler.clients.get(client.id)
    out = []
    for key in keys:
        ts = scheduler.tasks.get(key)
        if state is None or ts is None or state not in ts.who_wants:
            out.append(key)
    return out


def break_connection(client: Any) -> None:
    """Abort ``client``'s connection to the scheduler (tests: a lost connection)."""
    client.scheduler_comm.comm.abort()


def _tasks_running(dask_worker: Any) -> int:
    return len(dask_worker.state.executing)


def wait_workers_idle(client: Any, timeout: float) -> bool:
    """Wait up to ``timeout`` s until no worker runs a task (True if they all went idle).

    A stopped job's reads still run to their end on the workers (a thread cannot be
    interrupted); closing the cluster under them makes every worker log a CancelledError.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            if not any(client.run(_tasks_running).values()):
                return True
        except Exception:  # best effort: workers may be going away already
            return False
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def scheduler_plugin(scheduler: Any, name: str) -> Any:
    """The plugin registered on ``scheduler`` under ``name``, or None."""
    return getattr(scheduler, "plugins", {}).get(name)


def scheduler_running(scheduler: Any) -> bool:
    """False once the scheduler is closing or closed."""
    from distributed.core import Status

    return getattr(scheduler, "status", None) not in (Status.closing, Status.closed)


def run_on_scheduler_loop(scheduler: Any, fn: Any, timeout: float = 10.0) -> Any:
    """``fn()`` on the scheduler's event loop, where the data plane's state may be read.

    Direct when already there (handlers, the dashboard, ``/metrics``); from another thread
    (say, a trainer's own Prometheus exporter in the process of an embedded LocalCluster) it
    is handed to the loop and waited for.
    """
    import asyncio

    loop = scheduler.loop.asyncio_loop
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        return fn()

    async def call() -> Any:
        return fn()

    return asyncio.run_coroutine_threadsafe(call(), loop).result(timeout)


SCHEDULER_LOST = "worker-handle-scheduler-connection-broken"  # a worker's close reason


def keep_nanny_on_scheduler_loss(nanny: Any) -> None:
    """Have ``nanny`` start a new worker process when its worker closes for a lost scheduler.

    A worker whose stream to the scheduler breaks closes itself and first calls its nanny's
    ``close_gracefully`` handler, which marks the nanny as closing: it then exits with the
    worker. Wrapped here, that call with the scheduler-lost reason is declined, so the nanny
    treats the worker's exit as a crash and instantiates a new worker process (Dask's own
    restart path), which keeps trying to connect to the scheduler's address. The old process
    is killed at once: what it holds is of no use without its scheduler, and a read running
    in one of its threads would otherwise delay its exit (and the rejoin) until it ends. Its
    address is forgotten first, so the nanny does not try to unregister it from a scheduler
    that is gone (up to 10 s) before it starts the new process.
    """
    import os
    import signal

    original = nanny.handlers["close_gracefully"]

    def close_gracefully(reason: str = "nanny-close-gracefully") -> Any:
        if reason == SCHEDULER_LOST:
            logger.warning("omniload: scheduler lost; the nanny restarts its worker to rejoin")
            pid = nanny.pid
            if nanny.process is not None:
                nanny.process.worker_address = None  # set again by the next process
            if pid:
                os.kill(pid, signal.SIGKILL)
            return None
        return original(reason=reason)

    nanny.handlers["close_gracefully"] = close_gracefully


def drop_peer(worker: Any, address: str) -> None:
    """Close ``worker``'s comms to ``address`` and fail its attempts to connect there.

    A worker fetching a task's input from a peer that just died keeps retrying the refused
    connection until ``distributed.comm.timeouts.connect`` (30 s by default), and the task
    waits that long although the scheduler knows the peer is gone. Failing the attempt makes
    the worker drop the peer and ask the scheduler where else the input is (or will be).
    """
    worker.rpc.remove(address, reason=f"omniload: worker {address} left the cluster")


async def tell_workers_gone(scheduler: Any, address: str, handler: str) -> None:
    """Call ``handler(address=...)`` on every worker of ``scheduler`` (errors ignored)."""
    await scheduler.broadcast(msg={"op": handler, "address": address}, on_error="ignore")

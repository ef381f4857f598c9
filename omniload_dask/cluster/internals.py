"""Every use of Dask internals in one place, so an upgrade of distributed touches one file.

"Internals" are the parts of distributed that are not its documented API: the scheduler's task,
worker and client state, what the ``transition`` hook's keyword arguments hold, the worker's task
state and memory, the comm layer (``ConnectionPool``, handlers, ``to_serialize``), the nanny's
handlers, the dashboard's Bokeh application; the Active Memory Manager's policy classes are in
:mod:`omniload_dask.cluster.amm`, the bounds on Dask's per-key memory in :mod:`.forgetting`. Everything else in the package uses Dask's public API only.

- What Dask remembers of every new key and every submit (``key_split``'s cache, the spans'
  metadata) is bounded in :mod:`omniload_dask.cluster.forgetting`, which reaches into the
  same internals.
- Workers attach a read task's sample metadata to the task's own finished message (the worker
  task state's ``metadata``), which the scheduler passes to plugins' ``transition`` hooks as
  ``metadata=...``: no extra RPC and no ordering race with the result landing in memory.
- A fetching agent (a feeder, a group leader, a node agent) needs no ``Client``: it calls the
  data plane's handlers and the workers' part handler (:mod:`.serving`) with Dask's comms
  (``ConnectionPool``), and fetches no futures: the data plane holds each block until every
  rank of its groups has passed it. Workers serve parts from their memory (``worker.data``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from omniload_dask.cluster.arguments import check_sendable
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


def scheduler_address(client: Any) -> str | None:
    """The address of the scheduler ``client`` talks to (None if it has none yet)."""
    return client.scheduler.address if client.scheduler is not None else None


READ_RESOURCE = "omniload-read"


def worker_threads(scheduler: Any) -> tuple[int, int]:
    """``(workers, read slots)``: threads, or the read resource where every worker has it."""
    workers = getattr(scheduler, "workers", None) or {}
    if read_resource(scheduler):
        return len(workers), sum(int(ws.resources[READ_RESOURCE]) for ws in workers.values())
    return len(workers), sum(int(getattr(ws, "nthreads", 1)) for ws in workers.values())


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


# ---------------------------------------------------------------------- comms, no Client
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
    ``omniload_*`` handlers, or a worker's :mod:`.serving` handler) through ``pool``; a
    remote error is raised here."""
    return await getattr(pool(address), handler)(**kwargs)


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


def worker_value(worker: Any, key: str) -> Any:
    """The value of ``key`` in ``worker``'s memory (unspilled if need be), or None."""
    return worker.data.get(key)


def wire(value: Any) -> Any:
    """``value`` marked for Dask's serialization in a handler's reply (buffers out of band)."""
    from distributed.protocol import to_serialize

    return to_serialize(value)


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


# ---------------------------------------------------------------------- dashboard
def add_dashboard_page(
    scheduler: Any, route: str, make_document: Any, nav_name: str | None = None
) -> bool:
    """Serve a Bokeh page at ``route`` on the scheduler's running dashboard; link it in the nav.

    ``make_document(scheduler, extra, doc)`` builds a session's document, as Dask's own pages
    do (``extra`` holds the navigation's template variables). The page gets a Bokeh server
    application of its own, added to the scheduler's HTTP application next to Dask's; it is
    stopped with the scheduler's other HTTP applications. Returns False where the scheduler has
    no Bokeh dashboard (``dashboard_address=None`` or bokeh missing). Idempotent per scheduler.
    """
    try:
        from bokeh.server.server import BokehTornado
        from distributed.dashboard.core import BokehApplication
        from distributed.dashboard.scheduler import template_variables
        from tornado.ioloop import IOLoop
    except ImportError:
        return False
    http = getattr(scheduler, "http_application", None)
    apps = [app for app in getattr(http, "applications", ()) if isinstance(app, BokehTornado)]
    if http is None or not apps:
        return False
    if any(route in app.app_paths for app in apps):
        return True
    variables = template_variables(scheduler)  # memoized: the dict Dask's pages render from
    if nav_name and nav_name not in variables["pages"]:
        variables["pages"].append(nav_name)  # the same list object: every page's nav shows it
    prefix = getattr(apps[0], "_prefix", "") or "/"
    app = BokehApplication({route: make_document}, scheduler, prefix, variables)
    http.add_application(app)
    app.initialize(IOLoop.current())
    app.start()
    return True


def style_dashboard_document(doc: Any, extra: dict[str, Any]) -> None:
    """Give ``doc`` the look of Dask's pages: their template (with navigation) and theme."""
    from distributed.dashboard.components.scheduler import BOKEH_THEME, env

    doc.template = env.get_template("simple.html")
    doc.template_variables.update(extra)
    doc.theme = BOKEH_THEME


def scheduler_plugin(scheduler: Any, name: str) -> Any:
    """The plugin registered on ``scheduler`` under ``name``, or None."""
    return getattr(scheduler, "plugins", {}).get(name)


def scheduler_running(scheduler: Any) -> bool:
    """False once the scheduler is closing or closed."""
    from distributed.core import Status

    return getattr(scheduler, "status", None) not in (Status.closing, Status.closed)


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


# ---------------------------------------------------------------------- worker life
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

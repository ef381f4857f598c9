"""Every use of Dask internals in one place, so an upgrade of distributed touches one file.

- Workers attach a read task's sample metadata to the task's own finished message (the worker
  task state's ``metadata``), which the scheduler passes to plugins' ``transition`` hooks as
  ``metadata=...``: no extra RPC and no ordering race with the result landing in memory.
- A feeder fetches batches by key; the scheduler side registers the feeder's client as wanting
  those keys (``client_desires_keys``), since ``Future(key, client)`` alone does not.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

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


def desire_keys(scheduler: Any, keys: Iterable[str], client: str) -> list[str]:
    """Register ``client`` as wanting ``keys`` (those the scheduler knows); return them."""
    known = [k for k in keys if k in scheduler.tasks]
    if known:
        scheduler.client_desires_keys(keys=known, client=client)
    return known


def known(scheduler: Any, key: str) -> bool:
    ts = scheduler.tasks.get(key)
    return ts is not None and ts.state not in ("forgotten", "erred")


def erred_text(scheduler: Any, key: str) -> str | None:
    ts = scheduler.tasks.get(key)
    if ts is None or ts.state != "erred":
        return None
    return str(getattr(ts, "exception_text", "") or "task failed")


def worker_count(scheduler: Any) -> int:
    return len(scheduler.workers)


def inform_desire(client: Any, keys: list[str]) -> None:
    """Ask the scheduler (in order, on the client's stream) to report on ``keys`` again.

    The data plane already registered the client as wanting them; this second message makes the
    scheduler send their state after the client has created its futures, so none is missed.
    """
    if keys:
        client._send_to_scheduler(
            {"op": "client-desires-keys", "keys": list(keys), "client": client.id}
        )


def call(client: Any, handler: str, /, **kwargs: Any) -> Any:
    """Call the scheduler handler ``omniload_<handler>`` from a synchronous client.

    The reply comes back as plain data with lists (msgpack turns lists into tuples).
    """
    return _lists(client.sync(getattr(client.scheduler, "omniload_" + handler), **kwargs))


def _lists(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_lists(v) for v in value]
    if isinstance(value, dict):
        return {k: _lists(v) for k, v in value.items()}
    return value

"""Bounds on what Dask remembers of every new key and every submit (Dask internals, kept in
this package).

A job's keys are new every step and it submits a few tasks every step, so whatever Dask keeps
per key name or per ``update_graph`` for as long as the process or a span lives grows with the
run. The plugin calls both functions once per built block (``tests/test_memory.py``)::

    block in memory -> trim_key_cache()                 key_split's LRU: emptied past 10,000
                    -> trim_span_metadata(sched, key)   the span's metadata: cut past 1,000

Dask's developer logs (each comm's last batches, transitions, events) are bounded by a setting
instead (:data:`omniload_dask.cluster.settings.LOG_ENTRIES`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["KEY_CACHE_ENTRIES", "SPAN_ENTRIES", "trim_key_cache", "trim_span_metadata"]

KEY_CACHE_ENTRIES = 10_000  # key names dask.utils.key_split may remember before it forgets
SPAN_ENTRIES = 1_000  # submits a span's metadata may remember (collections, ids seen)


def trim_key_cache(limit: int | None = None) -> bool:
    """Empty ``dask.utils.key_split``'s cache once it holds over ``limit`` key names
    (:data:`KEY_CACHE_ENTRIES` by default).

    The scheduler splits every new task's key (its prefix and group names) through that
    function, which remembers the last 100,000 names it saw: about 200 bytes each. A job's keys
    are new every step (a block and its reads), so a long job filled it with names never asked
    again: 0.4 KB of scheduler memory per step, up to about 20 MB. Emptying it costs only a
    string split per key asked again. Returns whether it emptied it.
    """
    from dask.utils import key_split

    info = getattr(key_split, "cache_info", None)
    if info is None or info().currsize <= (KEY_CACHE_ENTRIES if limit is None else limit):
        return False
    key_split.cache_clear()
    return True


def trim_span_metadata(scheduler: Any, key: str, limit: int | None = None) -> int:
    """Bound what Dask's spans remember of every ``update_graph``; returns entries dropped.

    Each ``Client.submit`` sends a small ``SpanMetadata`` (``{"type": "Future"}``) that the
    scheduler's spans extension adds to the span of the submitted tasks: it appends the dict
    to the span's ``collections`` list and the metadata's ``id()`` to ``Span._metadata_seen``,
    a set shared by all spans that is never emptied. A span lives as long as its tasks keep
    coming, and a job submits a few tasks every step, so both grew by about 250 bytes a
    step, never freed (plain dicts of strings and ints: no ``gc``-tracked object grows).

    Past ``limit`` entries (:data:`SPAN_ENTRIES` by default) this keeps one of each distinct
    collection in each span, ``key``'s task group's first (what the dashboard shows of it) and
    empties the seen-set; the set only keeps one ``update_graph`` from adding its metadata
    once per task, and is not needed between calls. Safe from a ``transition`` hook: the
    spans extension adds a submit's metadata in one synchronous loop that calls no plugin.
    """
    try:
        from distributed.spans import Span
    except ImportError:  # pragma: no cover - distributed is a dependency
        return 0
    bound = SPAN_ENTRIES if limit is None else limit
    dropped = 0
    seen = getattr(Span, "_metadata_seen", None)
    if isinstance(seen, set) and len(seen) > bound:
        dropped += len(seen)
        seen.clear()
    ts = scheduler.tasks.get(key)
    spans = getattr(getattr(scheduler, "extensions", {}).get("spans"), "spans", {})
    group = getattr(ts, "group", None)
    # The span of ``key``'s group first; then every span, since the job's other submits (its
    # reads) may sit in another span than its blocks (newer Dask versions put them apart).
    first = spans.get(getattr(group, "span_id", None))
    for span in [first, *spans.values()] if first is not None else list(spans.values()):
        metadata = getattr(span, "_metadata", None)
        collections = metadata.get("collections") if isinstance(metadata, dict) else None
        if isinstance(collections, list) and len(collections) > bound:
            distinct: list[Any] = []
            for entry in collections:
                if entry not in distinct:
                    distinct.append(entry)
            kept = distinct[-bound:]
            dropped += len(collections) - len(kept)
            collections[:] = kept
    return dropped

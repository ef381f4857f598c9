"""Prometheus metrics of every running job, on the scheduler's own ``/metrics`` endpoint.

Dask serves ``/metrics`` from ``prometheus_client``'s process-wide registry; the data plane adds
one collector to it, which reads the jobs' figures at scrape time (no background work). Every
name starts with ``omniload_``; labels are ``job``, plus ``source`` or ``rank``::

    omniload_steps_fetched_total{job="quickstart"} 118.0
    omniload_source_tokens_total{job="quickstart",source="web"} 951032.0
    omniload_feeder_wait_seconds{job="quickstart",quantile="0.99",rank="3"} 0.0019

A figure the data plane does not have yet is left out, never filled in: a rank's feeder waits
appear once its feeder has reported; ``omniload_checkpoint_age_seconds`` once the coordinator
reports checkpoints; ``omniload_source_quota`` once it reports quotas.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Iterator
from typing import Any

from omniload_dask.internals import server as _server

__all__ = ["METRICS", "register"]

logger = logging.getLogger(__name__)
PREFIX = "omniload_"

# name -> (kind, help); counters get "_total" appended by prometheus_client.
METRICS: dict[str, tuple[str, str]] = {
    "job_failed": ("gauge", "1 if the job stopped on an error, else 0"),
    "uptime_seconds": ("gauge", "Seconds since the job started"),
    "workers": ("gauge", "Dask workers the job's scheduler has"),
    "steps_drawn": ("counter", "Global batches the data plane has drawn"),
    "steps_fetched": ("counter", "Steps every rank has fetched, since the job started"),
    "batches_built": ("counter", "Batch construction tasks finished"),
    "extra_micro_steps": ("counter", "Micro-steps added beyond the plan's to fit a step"),
    "capacity_used_ratio": ("gauge", "Tokens delivered / (dp x micro-batches x seq_len)"),
    "balance_efficiency": ("gauge", "Mean/max of the DP groups' costs, last step drawn"),
    "balance_efficiency_mean": ("gauge", "Balance efficiency, mean over all steps drawn"),
    "balance_efficiency_min": ("gauge", "Balance efficiency, lowest step drawn"),
    "held_batches": ("gauge", "Constructed batches held until their ranks fetch them"),
    "futures_held": ("gauge", "Dask futures the data plane holds (reads and batches)"),
    "checkpoint_age_seconds": ("gauge", "Seconds since the last data-plane checkpoint"),
    "source_weight": ("gauge", "Target share of the source in the mix"),
    "source_realised_share": ("gauge", "Realised share of the source over the recent steps"),
    "source_documents": ("counter", "Documents of the source drawn into global batches"),
    "source_tokens": ("counter", "Tokens of the source drawn into global batches"),
    "source_read_units": ("counter", "Read tasks of the source finished"),
    "source_read_records": ("counter", "Records read (decoded) from the source"),
    "source_read_tokens": ("counter", "Tokens produced by tokenizing the source"),
    "source_read_seconds": ("counter", "Task seconds spent reading and decoding the source"),
    "source_tokenize_seconds": ("counter", "Task seconds spent tokenizing the source"),
    "source_records_skipped": ("counter", "Bad or empty records of the source skipped"),
    "source_records_filtered": ("counter", "Records the source's filter or transform dropped"),
    "source_truncated_tokens": ("counter", "Tokens cut off long documents of the source"),
    "source_epoch": ("gauge", "Epoch the source's cursor is in"),
    "source_units_in_flight": ("gauge", "Read units of the source submitted and not released"),
    "source_reads_pending": ("gauge", "Read tasks of the source not finished yet"),
    "source_read_window": ("gauge", "Read units the data plane keeps submitted ahead"),
    "source_quota": ("gauge", "Read-task quota of the source"),
    "rank_step": ("gauge", "Next step the rank will fetch"),
    "feeder_wait_seconds": ("gauge", "Trainer's wait for a micro-batch, recent quantiles"),
    "feeder_buffered_steps": ("gauge", "Steps the feeder held ahead when it last asked"),
    "feeder_prefetch_steps": ("gauge", "Steps the feeder keeps ahead at most"),
}

_plugins: weakref.WeakSet[Any] = weakref.WeakSet()
_registered = False


def register(plugin: Any) -> bool:
    """Export ``plugin``'s jobs on ``/metrics``; False if prometheus_client is missing."""
    global _registered
    try:
        from prometheus_client import REGISTRY
    except ImportError:
        return False
    _plugins.add(plugin)
    if not _registered:
        REGISTRY.register(_Collector())
        _registered = True
    return True


def unregister(plugin: Any) -> None:
    """Stop exporting ``plugin``'s jobs (its scheduler closes)."""
    _plugins.discard(plugin)


class _Collector:
    """Reads every live plugin's jobs at scrape time (a job name is exported once)."""

    def describe(self) -> list[Any]:
        return []  # names vary with the jobs; skip the registry's duplicate check at startup

    def collect(self) -> Iterator[Any]:
        families = _families()
        seen: set[str] = set()
        for plugin in list(_plugins):
            scheduler = getattr(plugin, "scheduler", None)
            if scheduler is None or not _server.scheduler_running(scheduler):
                continue
            try:
                jobs = _server.run_on_scheduler_loop(scheduler, lambda p=plugin: _all_stats(p))
            except Exception:  # a scrape must never fail because of the data plane
                logger.exception("omniload: reading the jobs for /metrics failed")
                continue
            for name, stats in jobs.items():
                if name in seen:  # two schedulers in one process: the first one wins
                    continue
                seen.add(name)
                _add_job(families, name, stats)
        yield from families.values()


def _all_stats(plugin: Any) -> dict[str, dict[str, Any]]:
    """``stats()`` of each of ``plugin``'s jobs (runs on its scheduler's event loop)."""
    out = {}
    for name in sorted(plugin.jobs):
        try:
            out[name] = plugin.stats(name)
        except Exception:  # one job's figures failing must not hide the others'
            logger.exception("omniload: metrics of job %r failed", name)
    return out


def _families() -> dict[str, Any]:
    """One empty metric family per name of :data:`METRICS`, with its labels."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    out: dict[str, Any] = {}
    for name, (kind, text) in METRICS.items():
        labels = ["job"]
        if name.startswith("source_"):
            labels.append("source")
        elif name.startswith(("rank_", "feeder_")):
            labels.append("rank")
        if name == "feeder_wait_seconds":
            labels.append("quantile")
        cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
        out[name] = cls(PREFIX + name, text, labels=labels)
    return out


def _add_job(families: dict[str, Any], job: str, stats: dict[str, Any]) -> None:
    """Add one job's samples from its ``stats()``; a figure it lacks is left out."""

    def put(name: str, value: Any, *labels: str) -> None:
        if value is not None:
            families[name].add_metric([job, *labels], float(value))

    recent = stats.get("efficiency_recent") or []
    checkpoint = stats.get("checkpoint")
    put("job_failed", 1 if stats.get("error") else 0)
    put("uptime_seconds", stats.get("uptime"))
    put("workers", stats.get("workers"))
    put("steps_drawn", stats.get("steps_drawn"))
    put("steps_fetched", stats.get("steps_fetched"))
    put("batches_built", stats.get("batches_built"))
    put("extra_micro_steps", stats.get("extra_micro_steps"))
    capacity = stats.get("capacity_tokens") or 0
    put("capacity_used_ratio", stats["tokens"] / capacity if capacity else None)
    put("balance_efficiency", recent[-1] if recent else None)
    put("balance_efficiency_mean", stats.get("efficiency_mean"))
    put("balance_efficiency_min", stats.get("efficiency_min"))
    put("held_batches", stats.get("held_batches"))
    put("futures_held", stats.get("futures_held"))
    if checkpoint and checkpoint.get("time") is not None:
        put("checkpoint_age_seconds", max(0.0, time.time() - float(checkpoint["time"])))
    for src in stats.get("sources", []):
        name = str(src["name"])
        put("source_weight", src.get("target_share"), name)
        put("source_realised_share", src.get("realised_share"), name)
        put("source_documents", src.get("documents"), name)
        put("source_tokens", src.get("tokens"), name)
        put("source_read_units", src.get("reads_done"), name)
        put("source_read_records", src.get("records_read"), name)
        put("source_read_tokens", src.get("tokens_read"), name)
        put("source_read_seconds", src.get("decode_seconds"), name)
        put("source_tokenize_seconds", src.get("tokenize_seconds"), name)
        put("source_records_skipped", src.get("skipped"), name)
        put("source_records_filtered", src.get("filtered"), name)
        put("source_truncated_tokens", src.get("truncated_tokens"), name)
        put("source_epoch", src.get("epoch"), name)
        put("source_units_in_flight", src.get("units_in_flight"), name)
        put("source_reads_pending", src.get("reads_pending"), name)
        put("source_read_window", src.get("read_window"), name)
        put("source_quota", src.get("quota"), name)
    for rank, state in sorted((int(r), s) for r, s in (stats.get("ranks") or {}).items()):
        label = str(rank)
        put("rank_step", state.get("position"), label)
        for quantile, key in (("0.5", "wait_p50"), ("0.99", "wait_p99")):
            put("feeder_wait_seconds", state.get(key), label, quantile)
        put("feeder_buffered_steps", state.get("buffered"), label)
        put("feeder_prefetch_steps", state.get("prefetch"), label)

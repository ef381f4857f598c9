"""A long run on tiny data keeps held futures, tasks and worker memory flat."""

from __future__ import annotations

import psutil
import pytest

from omniload_dask import Job
from omniload_dask.cluster.settings import LOG_ENTRIES
from omniload_dask.plan import parse_plan

from .datagen import plan_dict, texts, write_jsonl

STEPS = 3000


def sample(job: Job) -> dict[str, int]:
    sched = job.cluster.scheduler
    plugin = sched.plugins["omniload"]
    run = plugin.jobs[job.name]
    worker_rss = job.client.run(lambda: psutil.Process().memory_info().rss)
    return {
        "futures": len(run.futures),
        "tasks": len(sched.tasks),
        "held": len(run.coord.components.delivery.held),
        "retained_steps": len(run.coord.components.delivery.steps),
        "units": sum(len(s.units) for s in run.coord.view.streams),
        "managed": sum(ws.nbytes for ws in sched.workers.values()),
        "worker_rss": sum(worker_rss.values()),
        "rss": psutil.Process().memory_info().rss,
    }


@pytest.mark.slow
def test_thousands_of_steps_keep_memory_flat(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", texts(300, seed=1, mean_words=6))
    write_jsonl(tmp_path / "b.jsonl", texts(300, seed=2, mean_words=12))
    plan = parse_plan(
        plan_dict(
            [
                {
                    "name": "a",
                    "format": "jsonl",
                    "path": str(tmp_path / "a.jsonl"),
                    "unit_bytes": 4096,
                },
                {
                    "name": "b",
                    "format": "jsonl",
                    "path": str(tmp_path / "b.jsonl"),
                    "unit_bytes": 4096,
                },
            ],
            name="longrun",
            batch={"seq_len": 64, "micro_batches": 1, "global_tokens": 256},
            layout={"dp": 2},
        )
    )
    with Job.start(plan, workers=2, dashboard_address=None) as job:
        feeders = [job.feeder(dp_rank=g, output="numpy").steps() for g in range(2)]
        marks = {}
        for step in range(1, STEPS + 1):
            for f in feeders:
                next(f)
            if step in (STEPS // 3, STEPS):
                marks[step] = sample(job)
        assert job.stats()["sources"][0]["epoch"] >= 5  # the sources went round many times
    early, late = marks[STEPS // 3], marks[STEPS]
    window = 4 * (plan.loader.prefetch + plan.loader.lookahead) + 8
    for m in (early, late):
        assert m["futures"] <= 2 * window + 16
        assert m["tasks"] <= 2 * window + 16
        assert m["retained_steps"] <= plan.loader.retain_steps + window
    assert late["managed"] <= 2 * early["managed"] + (1 << 20)
    assert late["worker_rss"] - early["worker_rss"] < 32 << 20
    # This process holds the scheduler: Dask keeps a little per finished task (bounded logs,
    # a key-name cache; dask/distributed#7977), about 1 KiB per step here. Far below 16 KiB.
    assert late["rss"] - early["rss"] < (STEPS - STEPS // 3) * (16 << 10)


def dask_bookkeeping(dask_scheduler) -> dict[str, int]:
    """What Dask remembers per new key and per submit, read on the scheduler's loop."""
    from dask.utils import key_split
    from distributed.spans import Span

    spans = dask_scheduler.extensions["spans"].spans.values()
    return {
        "message_log": max(len(c.recent_message_log) for c in dask_scheduler.stream_comms.values()),
        "transition_log": len(dask_scheduler.transition_log),
        "key_names": key_split.cache_info().currsize,
        "metadata_seen": len(getattr(Span, "_metadata_seen", ())),  # (gone in newer Dask)
        "span_collections": max(len((s.metadata or {}).get("collections", ())) for s in spans),
    }


def test_dask_bookkeeping_of_new_keys_and_submits_stays_bounded(tmp_path, monkeypatch):
    """Every step's block key is a new name and every step submits tasks: the scheduler's
    ``key_split`` cache (100,000 names) filled with the names, about 200 bytes a step, and
    the span the tasks belong to kept a ``{"type": "Future"}`` and an ``id`` per submit,
    about 250 bytes more, for as long as the job ran. The plugin trims both past a bound."""
    from dask.utils import key_split

    from omniload_dask.internals import forgetting

    monkeypatch.setattr(forgetting, "KEY_CACHE_ENTRIES", 100)
    monkeypatch.setattr(forgetting, "SPAN_ENTRIES", 50)
    trim, emptied = forgetting.trim_key_cache, []
    monkeypatch.setattr(forgetting, "trim_key_cache", lambda: emptied.append(trim()))
    trim_spans, dropped = forgetting.trim_span_metadata, []
    monkeypatch.setattr(
        forgetting, "trim_span_metadata", lambda s, k: dropped.append(trim_spans(s, k))
    )
    write_jsonl(tmp_path / "a.jsonl", texts(200, seed=3, mean_words=6))
    plan = parse_plan(
        plan_dict(
            [{"name": "a", "format": "jsonl", "path": str(tmp_path / "a.jsonl")}],
            name="keycache",
            batch={"seq_len": 64, "micro_batches": 1, "global_tokens": 64},
            layout={"dp": 1},
            loader={"steps_per_task": 1},  # a block, a key and its submits every step
        )
    )
    key_split.cache_clear()
    with Job.start(plan, workers=1, dashboard_address=None) as job:
        steps = job.feeder(output="numpy").steps()
        marks = []
        for step in range(1, 401):
            next(steps)
            if step % 20 == 0:
                marks.append(job.client.run_on_scheduler(dask_bookkeeping))
    # Never many more than the bound (a block's submits come between two trims) ...
    assert max(m["key_names"] for m in marks) <= 100 + 50
    assert max(m["metadata_seen"] for m in marks) <= 50 + 50
    assert max(m["span_collections"] for m in marks) <= 50 + 50
    # Dask's developer logs (each comm's last batches, graphs and all) at the loader's length.
    for name in ("message_log", "transition_log"):
        assert max(m[name] for m in marks) <= LOG_ENTRIES
    assert marks[-1]["transition_log"] == LOG_ENTRIES  # (full: the bound is what holds it)
    # ... checked for every block built ...
    assert len(emptied) >= 400 and len(dropped) >= 400
    # ... and trimmed as they piled up past it (400 steps submit more than 400 tasks).
    assert sum(emptied) >= 3
    assert sum(dropped) >= 300

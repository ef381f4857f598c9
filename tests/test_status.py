"""The terminal view and the metrics, from a stats dict: figures that plug in later show up."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from omniload_dask.observe import metrics
from omniload_dask.observe.status import format_status


def stats(ranks: int = 2, **extra: Any) -> dict[str, Any]:
    source = {
        "name": "web",
        "weight": 1.0,
        "target_share": 1.0,
        "realised_share": 1.0,
        "epoch": 0,
        "documents": 10,
        "tokens": 1000,
        "skipped": 0,
        "truncated_tokens": 0,
        "units_in_flight": 3,
        "reads_pending": 1,
        "read_window": 3,
        "records_per_s": 5.0,
        "tokens_per_s": 500.0,
        "bad_examples": [],
    }
    out: dict[str, Any] = {
        "name": "j",
        "run_id": "abc",
        "error": None,
        "uptime": 12.0,
        "workers": 2,
        "steps_drawn": 9,
        "steps_fetched": 7,
        "start_step": 0,
        "steps_per_second": 1.5,
        "tokens": 1000,
        "capacity_tokens": 2000,
        "efficiency_recent": [0.99],
        "efficiency_mean": 0.98,
        "efficiency_min": 0.9,
        "checkpoint": None,
        "sources": [source],
        "ranks": {
            r: {"position": 7, "wait_p50": 1e-5, "wait_p99": r * 1e-3, "buffered": 1, "prefetch": 2}
            for r in range(ranks)
        },
    }
    out.update(extra)
    return out


def test_status_shows_the_read_ahead_window_until_quotas_and_checkpoints_exist():
    text = format_status(stats(), now=100.0)
    assert "checkpoint: none yet" in text
    assert "every rank fetched through step 6" in text and "1.50 steps/s" in text
    assert " window " in text.splitlines()[4] and " quota " not in text

    later = stats(checkpoint={"step": 5, "time": 90.0})
    later["sources"][0]["quota"] = 4
    text = format_status(later, now=100.0)
    assert "checkpoint: step 5, 10 s ago" in text
    header, row = text.splitlines()[4:6]
    assert header.split()[-2:] == ["quota", "skipped"] and row.split()[-2:] == ["4", "0"]


def test_status_of_many_ranks_lists_those_that_wait_longest():
    text = format_status(stats(ranks=20), now=0.0)
    rows = [line.split() for line in text.splitlines() if line.startswith("    ")]
    assert [int(r[0]) for r in rows] == list(range(12, 20))
    assert "... 12 more ranks (shown: longest p99 waits)" in text


def test_status_of_a_failed_job_says_why():
    assert "failed: source 'web': boom" in format_status(stats(error="source 'web': boom"))


def test_metrics_of_a_stats_dict_include_the_figures_that_plug_in_later():
    class One:
        def __init__(self, data: dict[str, Any]) -> None:
            self.data = data

        def collect(self):
            families = metrics._families()
            metrics._add_job(families, "j", self.data)
            yield from families.values()

    def scrape(data: dict[str, Any]) -> dict[str, dict[tuple, float]]:
        registry = CollectorRegistry()
        registry.register(One(data))
        out: dict[str, dict[tuple, float]] = {}
        for family in text_string_to_metric_families(generate_latest(registry).decode()):
            for s in family.samples:
                out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
        return out

    now = scrape(stats())
    assert "omniload_checkpoint_age_seconds" not in now and "omniload_source_quota" not in now
    assert (
        now["omniload_feeder_wait_seconds"][(("job", "j"), ("quantile", "0.99"), ("rank", "1"))]
        == 1e-3
    )
    assert now["omniload_capacity_used_ratio"][(("job", "j"),)] == 0.5
    assert all(name.startswith("omniload_") for name in now)

    later = stats(checkpoint={"step": 5, "time": time.time() - 30})
    later["sources"][0]["quota"] = 4
    got = scrape(later)
    assert got["omniload_checkpoint_age_seconds"][(("job", "j"),)] >= 30
    assert got["omniload_source_quota"][(("job", "j"), ("source", "web"))] == 4


def test_status_and_jobs_mark_feeders_that_stopped_asking_as_idle():
    from omniload_dask.observe.status import IDLE_AFTER, format_jobs, job_state

    ranks = {
        0: {"position": 7, "reported_ago": 0.5},
        1: {"position": 7, "reported_ago": IDLE_AFTER + 30},
        2: {"position": 0},
    }
    s = stats(ranks=3)
    s["ranks"] = ranks
    text = format_status(s, now=100.0)
    assert (
        "  ranks: 1 fetching, 1 idle (no request for 10 s: finished or paused), 1 not started"
        in text
    )
    rows = {line.split()[0]: line for line in text.splitlines() if line.startswith("     ")}
    assert rows["0"].endswith("0.5 s ago") and rows["1"].endswith("40 s ago (idle)")
    assert rows["2"].endswith("never")
    assert job_state(s) == "running"
    s["ranks"] = {r: v for r, v in ranks.items() if r != 0}
    assert job_state(s) == "idle" and " · idle · " in format_status(s, now=100.0)
    s["ranks"] = {2: ranks[2]}
    assert job_state(s) == "waiting for ranks"
    assert job_state({**s, "error": "boom"}) == "failed"
    header, row = format_jobs([stats(ranks=2, uptime=300.0)]).splitlines()
    assert header.split() == ["job", "state", "step", "drawn", "ranks", "age"]
    assert row.split() == ["j", "waiting", "for", "ranks", "7", "9", "0/2", "fetching", "5", "min"]
    assert format_jobs([]) == "no omniload job runs on this scheduler"

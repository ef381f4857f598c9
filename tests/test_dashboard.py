"""Watching a running job: the dashboard page, /metrics and ``omniload status``, all real.

One job on a LocalCluster with worker processes and its dashboard on loopback serves every test
here; the browser test drives Debian's Chromium headless through Selenium and chromedriver
(skipped where they are not installed, unless ``OMNILOAD_REQUIRE_BROWSER=1``, as in CI).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import prometheus_client
import pytest
from distributed import Client, LocalCluster
from prometheus_client.parser import text_string_to_metric_families

from omniload_dask import Job
from omniload_dask.cli import main
from omniload_dask.observe.dashboard import JobPage

from .conftest import make_plan
from .datagen import texts, write_jsonl, write_parquet

ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"
SOURCES = ["web", "code", "books"]
DEADLINE = 120.0  # seconds to wait for something that must happen (a failure, not a benchmark)


class Watched:
    """The running job, its dashboard address and one feeder per rank."""

    def __init__(self, job: Job) -> None:
        self.job = job
        link = job.dashboard_link
        assert link is not None
        self.base = link.rsplit("/", 1)[0]
        self.address = job.client.scheduler.address
        self.feeders = [
            # prefetch 2 (not two blocks of steps): a rank reports how far it fetched with each
            # request, and a shallow prefetch asks again about every step
            job.feeder(rank=r, output="numpy", prefetch=2)
            for r in range(job.plan.layout.world_size)
        ]
        self.steps = 0

    def consume(self, steps: int) -> None:
        """Every rank takes ``steps`` more steps (rank by rank; within the draw window)."""
        for feeder in self.feeders:
            it = feeder.steps()
            for _ in range(steps):
                next(it)
        self.steps += steps

    def get(self, path: str) -> str:
        with urllib.request.urlopen(self.base + path, timeout=30) as reply:
            assert reply.status == 200
            return reply.read().decode()


@pytest.fixture(scope="module")
def watched() -> Iterator[Watched]:
    root = Path(tempfile.mkdtemp(prefix="omniload-dashboard-"))
    write_jsonl(
        root / "web" / "a.jsonl",
        texts(120, seed=1, prefix="wa"),
        raw_lines={7: "{not json"},  # one bad record: skipped and counted
    )
    write_jsonl(root / "web" / "b.jsonl", texts(80, seed=2, prefix="wb"))
    write_jsonl(
        root / "code" / "c.jsonl.zst",
        texts(60, seed=3, mean_words=80, prefix="c"),
        compression="zstd",
    )
    write_parquet(
        root / "books" / "d.parquet", texts(50, seed=4, mean_words=200, prefix="bk"), column="body"
    )
    plan = make_plan(root, name="watched", on_error="skip", layout={"dp": 2})
    with Job.start(plan, workers=2, dashboard_address="127.0.0.1:0") as job:
        w = Watched(job)
        w.consume(8)  # (the first read unit of web, with the bad record, is passed by then)
        yield w
    shutil.rmtree(root, ignore_errors=True)


def wait_for(check: Callable[[], Any], what: str) -> Any:
    deadline = time.monotonic() + DEADLINE
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.2)


# ---------------------------------------------------------------------- page (HTTP)
def test_page_is_served_and_linked_from_the_dask_navigation(watched):
    page = watched.get("/omniload")
    assert 'href="omniload"' in page  # in the navigation bar of Dask's template
    assert "bokeh" in page.lower()
    assert 'href="omniload"' in watched.get("/status")  # Dask's own pages link to it too


def _page_figures(dask_scheduler: Any) -> dict[str, Any]:
    """Runs on the scheduler's event loop: build the page like a browser session would."""
    page = JobPage(dask_scheduler)
    page.update()
    return {
        "select": list(page.select.options),
        "summary": page.summary.text,
        "read_rate": [float(max(ys)) for ys in page.read_rate.data["ys"]],
        "mix": [len(ys) for ys in page.mix_realised.data["ys"]],
        "efficiency": len(page.efficiency.data["step"]),
        "ranks": list(page.feeders.data["rank"]),
        "table": list(page.table.data["source"]),
        "skipped": list(page.table.data["skipped"]),
    }


def test_page_document_fills_every_figure_from_the_data_plane(watched):
    got = watched.job.client.run_on_scheduler(_page_figures)
    assert got["select"] == ["watched"]
    assert "<b>watched</b>" in got["summary"] and "checkpoint: none yet" in got["summary"]
    assert re.search(r"padding \d+\.\d\d%", got["summary"])  # empty positions drawn
    assert all(peak > 0 for peak in got["read_rate"])  # every source was read
    assert got["mix"] == [got["efficiency"]] * 3 and got["efficiency"] > 0
    assert got["ranks"] == ["0", "1"]
    assert got["table"] == SOURCES
    assert got["skipped"][0] == 1


# ---------------------------------------------------------------------- /metrics
def scrape(w: Watched) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(w.get("/metrics")):
        for sample in family.samples:
            if sample.name.startswith("omniload_"):
                out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted({"job": "watched", **labels}.items())))]


def test_metrics_parse_and_their_counters_move_as_steps_are_consumed(watched):
    before = scrape(watched)
    names = {name for name, _ in before}
    for name in (
        "omniload_steps_drawn_total",
        "omniload_steps_fetched_total",
        "omniload_source_tokens_total",
        "omniload_source_read_records_total",
        "omniload_source_read_tokens_total",
        "omniload_source_records_skipped_total",
        "omniload_source_units_in_flight",
        "omniload_source_read_window",
        "omniload_balance_efficiency",
        "omniload_feeder_wait_seconds",
        "omniload_feeder_buffered_steps",
        "omniload_rank_step",
        "omniload_workers",
    ):
        assert name in names, name
    assert "omniload_checkpoint_age_seconds" not in names  # no checkpoints yet: not faked
    for source in SOURCES:
        assert value(before, "omniload_source_read_units_total", source=source) > 0
    assert value(before, "omniload_source_records_skipped_total", source="web") == 1
    assert value(before, "omniload_workers") == 2
    for rank in ("0", "1"):
        assert value(before, "omniload_feeder_wait_seconds", rank=rank, quantile="0.99") >= 0
    fetched = value(before, "omniload_steps_fetched_total")

    watched.consume(16)  # past the end of the block of 8 steps drawn ahead
    # A rank reports how far it fetched with its next request: at least as far as it consumed.
    after = wait_for(
        lambda: (
            (s := scrape(watched))
            and value(s, "omniload_steps_fetched_total") >= watched.steps
            and s
        ),
        "omniload_steps_fetched_total to count the steps consumed",
    )
    assert value(after, "omniload_steps_fetched_total") > fetched
    tokens = "omniload_source_tokens_total"
    assert sum(v for (n, _), v in after.items() if n == tokens) > sum(
        v for (n, _), v in before.items() if n == tokens
    )
    assert value(after, "omniload_steps_drawn_total") > value(before, "omniload_steps_drawn_total")
    for key, old in before.items():
        if key[0].endswith("_total"):
            assert after[key] >= old, key  # counters never go back


def test_metrics_are_right_when_collected_off_the_scheduler_thread(watched):
    # e.g. a trainer's own exporter of the default registry, next to an embedded cluster
    text = prometheus_client.generate_latest().decode()
    samples = {
        s.name: s
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.labels.get("job") == "watched"
    }
    assert samples["omniload_steps_fetched_total"].value >= watched.steps


# ---------------------------------------------------------------------- omniload status
def test_status_once_prints_the_jobs_figures(watched, capsys):
    assert main(["status", "--address", watched.address, "--job", "watched", "--once"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("omniload job watched · run ")
    assert "checkpoint: none yet" in out and "2 workers" in out
    for source in SOURCES:
        assert f"\n  {source} " in out
    assert "last skipped (web): " in out
    ranks = [line.split() for line in out.splitlines() if line.startswith("     ")]
    assert [r[0] for r in ranks] == ["0", "1"]


def test_status_names_what_is_wrong(watched, capsys):
    assert main(["status", "--address", watched.address, "--job", "nope", "--once"]) == 2
    err = capsys.readouterr().err
    assert "no omniload job named 'nope'" in err and "(running: watched)" in err
    assert main(["status", "--address", "not an address", "--once"]) == 2
    assert "not a scheduler address: 'not an address'" in capsys.readouterr().err
    assert main(["status", "--address", watched.address, "--interval", "0"]) == 2
    assert "--interval must be > 0" in capsys.readouterr().err


def _empty_page(dask_scheduler: Any) -> str:
    page = JobPage(dask_scheduler)
    page.update()
    return page.summary.text


def test_status_and_page_on_a_scheduler_without_the_data_plane(capsys):
    with LocalCluster(n_workers=0, processes=False, dashboard_address="127.0.0.1:0") as cluster:
        assert main(["status", "--address", cluster.scheduler_address, "--once"]) == 2
        with Client(cluster) as client:
            assert "No omniload job runs" in client.run_on_scheduler(_empty_page)
    assert "runs no omniload data plane" in capsys.readouterr().err


# ---------------------------------------------------------------------- the page in Chromium
ALL_TEXT = """
function collect(node, out) {
  if (node.shadowRoot) collect(node.shadowRoot, out);
  for (const child of node.childNodes) {
    if (child.nodeType === Node.TEXT_NODE) out.push(child.textContent);
    else collect(child, out);
  }
  return out;
}
return collect(document.body, []).join(' ');
"""
COUNT_CANVASES = """
function count(node) {
  let n = node.tagName === 'CANVAS' && node.width > 0 && node.height > 0 ? 1 : 0;
  if (node.shadowRoot) n += count(node.shadowRoot);
  for (const child of node.children || []) n += count(child);
  return n;
}
return count(document.body);
"""
MODEL = """
if (typeof Bokeh === 'undefined' || Bokeh.documents.length === 0) return null;
const model = Bokeh.documents[0].get_model_by_name(arguments[0]);
if (model === null) return null;
if (model.data === undefined) return model.text;
const data = model.data instanceof Map ? Object.fromEntries(model.data) : model.data;
const out = {};
for (const [key, column] of Object.entries(data)) out[key] = Array.from(column, v =>
  (v !== null && typeof v === 'object' && v.length !== undefined) ? Array.from(v) : v);
return out;
"""


@pytest.fixture(scope="module")
def chromium() -> Iterator[Any]:
    browser = os.environ.get("OMNILOAD_CHROMIUM") or shutil.which("chromium")
    driver = os.environ.get("OMNILOAD_CHROMEDRIVER") or shutil.which("chromedriver")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        browser = None
    if not browser or not driver:
        reason = "needs selenium, Debian's chromium and chromium-driver (scripts/setup.sh)"
        if os.environ.get("OMNILOAD_REQUIRE_BROWSER") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    profile = tempfile.mkdtemp(prefix="omniload-chromium-")
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        "--window-size=1400,1500",
    ):
        options.add_argument(flag)
    # An explicit chromedriver path: Selenium Manager (which would download one) never runs.
    session = webdriver.Chrome(options=options, service=Service(driver))
    try:
        yield session
    finally:
        session.quit()
        shutil.rmtree(profile, ignore_errors=True)


@pytest.mark.slow
def test_page_renders_live_in_headless_chromium(watched, chromium):
    chromium.get(watched.base + "/omniload")
    model = lambda name: chromium.execute_script(MODEL, name)  # noqa: E731

    efficiency = wait_for(
        lambda: (data := model("omniload-efficiency")) and data["step"] and data,
        "the page to show the balance efficiency per step",
    )
    text = chromium.execute_script(ALL_TEXT)
    for source in SOURCES:
        assert source in text  # the per-source table
    assert "watched" in text and "checkpoint: none yet" in text
    assert chromium.find_elements("css selector", 'a[href="omniload"]')  # the nav link
    assert chromium.execute_script(COUNT_CANVASES) >= 7  # seven plots drawn

    # Every plot has data in the browser: one line per source, a bar per rank or source.
    for name in ("omniload-read-rate", "omniload-tokenize-rate"):
        data = model(name)
        assert data["source"] == SOURCES
        assert all(len(ys) > 0 for ys in data["ys"]) and any(max(ys) > 0 for ys in data["ys"])
    mix = model("omniload-mix-realised")
    assert mix["source"] == SOURCES and all(len(ys) == len(efficiency["step"]) for ys in mix["ys"])
    feeders = model("omniload-feeders")
    assert feeders["rank"] == ["0", "1"] and all(p is not None for p in feeders["p99"])
    reads = model("omniload-reads")
    assert reads["source"] == SOURCES and all(v >= 0 for v in reads["limit"])
    assert model("omniload-sources")["skipped"] == [1, 0, 0]

    # Live: the page follows the job as the ranks consume more steps.
    def fetched_through() -> int:
        found = re.search(r"every rank fetched through step (\d+)", model("omniload-summary"))
        return int(found.group(1)) if found else -1

    watched.consume(3)
    wait_for(
        lambda: fetched_through() >= watched.steps - 1,
        f"the summary to show that every rank fetched step {watched.steps - 1}",
    )
    ARTIFACTS.mkdir(exist_ok=True)
    assert chromium.save_screenshot(str(ARTIFACTS / "dashboard.png"))

"""The Omniload page on the Dask dashboard: a live view of each job's data plane.

The scheduler plugin calls :func:`install` when it starts: it adds ``/omniload`` to the
scheduler's running dashboard (linked from the navigation bar of Dask's pages) and exports the
jobs' figures on ``/metrics`` (see :mod:`omniload_dask.observe.metrics`). The page is a Bokeh
document like Dask's own; it runs on the scheduler's event loop and reads the data plane
directly, once a second::

    Job [quickstart v]  run 1a2b3c4d · running · up 41 s · 2 workers · checkpoint: none yet
                        steps drawn 230 · every rank fetched through step 228 · 5.1 steps/s
    read + decode (records/s)      | tokenize (tokens/s)        per source, over time
    mixture: realised vs target    | balance efficiency          per step
    feeder wait p50/p99 per rank   | prefetch depth per rank
    read tasks per source (pending, in memory, window or quota)
    table per source: shares, epoch, documents, tokens, rates, skipped, truncated, last bad record

Figures that do not exist yet stay visibly absent: "checkpoint: none yet" until the coordinator
reports ``stats()["checkpoint"] = {"step": ..., "time": ...}``, and the read-ahead window per
source until it reports ``stats()["sources"][i]["quota"]``.

:class:`JobPage` is one browser session: the job selector and summary, and the page's data (one
Bokeh ``ColumnDataSource`` per plot group, refreshed from the data plane); the plots and the
table that draw that data are laid out by :mod:`omniload_dask.observe.page_layout`.
"""

from __future__ import annotations

import html
import logging
import time
from typing import Any

import numpy as np

from omniload_dask.internals import dashboard as _dashboard
from omniload_dask.internals import server as _server
from omniload_dask.observe import metrics
from omniload_dask.observe.formatting import (
    checkpoint_text,
    efficiency_text,
    fetched_text,
    format_si,
)
from omniload_dask.observe.monitoring import realised_shares
from omniload_dask.observe.page_layout import MIX_WINDOW, build_body, palette

__all__ = ["NAV_NAME", "ROUTE", "JobPage", "install"]

logger = logging.getLogger(__name__)
ROUTE = "/omniload"
NAV_NAME = "omniload"
UPDATE_MS = 1000
STEPS_SHOWN = 512
RATE_BINS = 60


def install(scheduler: Any, plugin: Any) -> dict[str, bool]:
    """Add the page to ``scheduler``'s dashboard and ``plugin``'s jobs to ``/metrics``."""
    return {
        "metrics": metrics.register(plugin),
        "page": _dashboard.add_dashboard_page(scheduler, ROUTE, job_page_document, NAV_NAME),
    }


def job_page_document(scheduler: Any, extra: dict[str, Any], doc: Any) -> None:
    """Build one browser session's document (called by the dashboard's Bokeh server)."""
    page = JobPage(scheduler)
    page.update()
    doc.title = "Dask: Omniload"
    doc.add_root(page.root)
    doc.add_periodic_callback(page.update, UPDATE_MS)
    _dashboard.style_dashboard_document(doc, extra)


class JobPage:
    """The widgets and data of one browser session; :meth:`update` refreshes them.

    The data sources (``read_rate``, ``token_rate``, ``mix_realised``, ``mix_target``,
    ``efficiency``, ``feeders``, ``reads``, ``table``) are named, so a browser finds them as
    ``Bokeh.documents[0].get_model_by_name("omniload-...")``; they and the plots drawing them
    are made anew whenever the page shows another run of a job.
    """

    def __init__(self, scheduler: Any) -> None:
        from bokeh.layouts import column, row
        from bokeh.models.widgets import Div, Select

        self.scheduler = scheduler
        self.job: str | None = None
        self.names: list[str] = []
        self.colors: dict[str, str] = {}
        self._run_id: str | None = None
        self._last_step = -1
        self.select = Select(title="Job", options=[], value="", width=220, name="omniload-job")
        self.select.on_change("value", self._on_select)
        self.summary = Div(name="omniload-summary", sizing_mode="stretch_width")
        self.body = column(sizing_mode="stretch_width")
        self.root = column(
            row(self.select, self.summary, sizing_mode="stretch_width"),
            self.body,
            sizing_mode="stretch_width",
            name="omniload-root",
        )
        self._new_sources()

    # ------------------------------------------------------------------ refresh
    def update(self) -> None:
        """Show the selected job's figures now (called once a second); never raises."""
        try:
            self._update()
        except Exception:  # keep the session alive; the next tick may succeed
            logger.exception("omniload dashboard page: update failed")

    def _update(self) -> None:
        """Follow the jobs that run now; rebuild for a new run; refresh what changed."""
        plugin = _server.scheduler_plugin(self.scheduler, "omniload")
        jobs = sorted(plugin.jobs) if plugin is not None else []
        if list(self.select.options) != jobs:
            self.select.options = jobs
        if self.job not in jobs:
            self.job = jobs[0] if jobs else None
            self.select.value = self.job or ""
        if self.job is None or plugin is None:
            self.summary.text = "<p>No omniload job runs on this scheduler.</p>"
            self.body.children = []
            self._run_id = None
            return
        run = plugin.jobs[self.job]
        stats = plugin.stats(self.job)
        if stats["run_id"] != self._run_id:
            self._build(stats)
            self._run_id = stats["run_id"]
            self._last_step = -1
        now = time.time()
        self.summary.text = summary_html(stats, now)
        self._refresh_rates(run, now)
        if stats["next_step"] != self._last_step:
            self._refresh_steps(run, stats)
            self._last_step = stats["next_step"]
        self._refresh_ranks(stats)
        self._refresh_sources(stats)

    def _on_select(self, attr: str, old: Any, new: Any) -> None:
        """The browser picked another job: show it now (Bokeh's ``on_change`` callback)."""
        if new and new != self.job:
            self.job = new
            self._run_id = None
            self.update()

    def _build(self, stats: dict[str, Any]) -> None:
        """New data sources and plots for another run (its sources and ranks)."""
        names = [str(s["name"]) for s in stats["sources"]]
        ranks = [str(r) for r in sorted(int(r) for r in stats["ranks"])]
        self.names = names
        self.colors = dict(zip(names, palette(len(names)), strict=True))
        quota = any(s.get("quota") is not None for s in stats["sources"])
        self._new_sources()
        self.body.children = build_body(self, names, ranks, quota, stats.get("mixing_by", "tokens"))

    def _new_sources(self) -> None:
        """Empty data sources, named for the browser (see the class docstring)."""
        from bokeh.models import ColumnDataSource

        def lines(name: str) -> ColumnDataSource:
            return ColumnDataSource({"xs": [], "ys": [], "color": [], "source": []}, name=name)

        self.read_rate = lines("omniload-read-rate")
        self.token_rate = lines("omniload-tokenize-rate")
        self.mix_realised = lines("omniload-mix-realised")
        self.mix_target = lines("omniload-mix-target")
        self.efficiency = ColumnDataSource(
            {"step": [], "efficiency": []}, name="omniload-efficiency"
        )
        self.feeders = ColumnDataSource(
            {"rank": [], "p50": [], "p99": [], "buffered": [], "prefetch": []},
            name="omniload-feeders",
        )
        self.reads = ColumnDataSource(
            {"source": [], "pending": [], "in_memory": [], "limit": []}, name="omniload-reads"
        )
        self.table = ColumnDataSource({}, name="omniload-sources")

    # ------------------------------------------------------------------ data
    def _refresh_rates(self, run: Any, now: float) -> None:
        """Throughput per source over time, from the job's monitor (binned read events)."""
        t, records, tokens = run.monitor.throughput_series(now, RATE_BINS)
        for cds, values in ((self.read_rate, records), (self.token_rate, tokens)):
            cds.data = {
                "xs": [t] * len(self.names),
                "ys": list(values),
                "color": [self.colors[n] for n in self.names],
                "source": self.names,
            }

    def _refresh_steps(self, run: Any, stats: dict[str, Any]) -> None:
        """Per step: the realised vs target mix and the balance efficiency, from the
        coordinator's recent step figures (only when a new step was drawn)."""
        figures = list(run.coord.view.history)[-(STEPS_SHOWN + MIX_WINDOW) :]
        steps, target, realised = realised_shares(
            figures, len(self.names), stats.get("mixing_by", "tokens"), MIX_WINDOW
        )
        steps, target, realised = (
            steps[-STEPS_SHOWN:],
            target[-STEPS_SHOWN:],
            realised[-STEPS_SHOWN:],
        )
        colors = [self.colors[n] for n in self.names]
        for cds, values in ((self.mix_realised, realised), (self.mix_target, target)):
            cds.data = {
                "xs": [steps] * len(self.names),
                "ys": list(values.T) if len(values) else [[] for _ in self.names],
                "color": colors,
                "source": self.names,
            }
        self.efficiency.data = {
            "step": steps,
            "efficiency": np.asarray([f.efficiency for f in figures[-STEPS_SHOWN:]]),
        }

    def _refresh_ranks(self, stats: dict[str, Any]) -> None:
        """Per rank: its feeder's last reported waits (in ms) and prefetch depth."""
        ranks = sorted(int(r) for r in stats["ranks"])
        states = {int(r): s for r, s in stats["ranks"].items()}
        nan = float("nan")

        def ms(value: float | None) -> float:
            return nan if value is None else value * 1e3

        self.feeders.data = {
            "rank": [str(r) for r in ranks],
            "p50": np.asarray([ms(states[r].get("wait_p50")) for r in ranks]),
            "p99": np.asarray([ms(states[r].get("wait_p99")) for r in ranks]),
            "buffered": np.asarray([states[r].get("buffered", nan) for r in ranks], dtype=float),
            "prefetch": np.asarray([states[r].get("prefetch", nan) for r in ranks], dtype=float),
        }

    def _refresh_sources(self, stats: dict[str, Any]) -> None:
        """Per source: read tasks in flight against their limit, and the table's row."""
        sources = stats["sources"]

        def limit(s: dict[str, Any]) -> Any:
            return s["quota"] if s.get("quota") is not None else s.get("read_window", 0)

        self.reads.data = {
            "source": self.names,
            "pending": [s["reads_pending"] for s in sources],
            "in_memory": [s["units_in_flight"] - s["reads_pending"] for s in sources],
            "limit": [limit(s) for s in sources],
        }
        self.table.data = {
            "source": self.names,
            "target": [s["target_share"] for s in sources],
            "realised": [s["realised_share"] for s in sources],
            "epoch": [s["epoch"] for s in sources],
            "documents": [s["documents"] for s in sources],
            "tokens": [s["tokens"] for s in sources],
            "records_per_s": [s["records_per_s"] for s in sources],
            "tokens_per_s": [s["tokens_per_s"] for s in sources],
            "in_flight": [s["units_in_flight"] for s in sources],
            "limit": [limit(s) for s in sources],
            "skipped": [s["skipped"] for s in sources],
            "filtered": [s.get("filtered", 0) for s in sources],
            "truncated": [s["truncated_tokens"] for s in sources],
            "last_bad": [(s.get("bad_examples") or [""])[-1] for s in sources],
        }


def padding_text(stats: dict[str, Any]) -> str:
    """The share of empty positions in the micro-batches drawn (``""`` before the first)."""
    share = stats.get("padding_share")
    return f"padding {share:.2%}" if share is not None else ""


def summary_html(stats: dict[str, Any], now: float) -> str:
    """The page's header: the job's state, progress and balance, as HTML."""
    capacity = stats.get("capacity_tokens") or 0
    status = (
        f"<span style='color:#c0392b'>failed: {html.escape(str(stats['error']))}</span>"
        if stats.get("error")
        else "running"
    )
    skipped = sum(s["skipped"] for s in stats["sources"])
    rate = stats.get("steps_per_second")
    first = [
        f"<b>{html.escape(str(stats['name']))}</b>",
        f"run {html.escape(str(stats['run_id']))}",
        status,
        f"up {stats['uptime']:.0f} s",
        f"<span class='omniload-workers'>{stats['workers']} workers</span>",
        f"checkpoint: {checkpoint_text(stats.get('checkpoint'), now)}",
    ]
    second = [
        f"steps drawn {stats['steps_drawn']}",
        fetched_text(stats),
        f"{rate:.2f} steps/s" if rate is not None else "- steps/s",
        f"tokens drawn {format_si(stats['tokens'])}",
        f"balance efficiency {efficiency_text(stats, ', ')}",
        f"capacity used {stats['tokens'] / capacity:.1%}" if capacity else "",
        padding_text(stats),
        f"records skipped {skipped}",
    ]
    return (
        "<div style='font-size:14px;line-height:1.6;padding-top:18px'>"
        + " · ".join(first)
        + "<br/>"
        + " · ".join(p for p in second if p)
        + "</div>"
    )

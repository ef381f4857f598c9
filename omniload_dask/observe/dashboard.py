"""The Omniload page on the Dask dashboard: a live view of each job's data plane.

The scheduler plugin calls :func:`install` when it starts: it adds ``/omniload`` to the
scheduler's running dashboard (linked from the navigation bar of Dask's pages) and exports the
jobs' figures on ``/metrics`` (see :mod:`omniload_dask.observe.metrics`). The page is a Bokeh document
like Dask's own; it runs on the scheduler's event loop and reads the data plane directly, once a
second::

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
"""

from __future__ import annotations

import html
import logging
import time
from typing import Any

import numpy as np

from omniload_dask.cluster import internals as _dask
from omniload_dask.observe import metrics
from omniload_dask.observe.monitoring import checkpoint_text, format_si, realised_shares

__all__ = ["NAV_NAME", "ROUTE", "JobPage", "install"]

logger = logging.getLogger(__name__)
ROUTE = "/omniload"
NAV_NAME = "omniload"
UPDATE_MS = 1000
STEPS_SHOWN = 512
MIX_WINDOW = 16  # steps behind each point of the realised-mix curve
RATE_BINS = 60


def install(scheduler: Any, plugin: Any) -> dict[str, bool]:
    """Add the page to ``scheduler``'s dashboard and ``plugin``'s jobs to ``/metrics``."""
    return {
        "metrics": metrics.register(plugin),
        "page": _dask.add_dashboard_page(scheduler, ROUTE, job_page_document, NAV_NAME),
    }


def job_page_document(scheduler: Any, extra: dict[str, Any], doc: Any) -> None:
    """Build one browser session's document (called by the dashboard's Bokeh server)."""
    page = JobPage(scheduler)
    page.update()
    doc.title = "Dask: Omniload"
    doc.add_root(page.root)
    doc.add_periodic_callback(page.update, UPDATE_MS)
    _dask.style_dashboard_document(doc, extra)


def _palette(n: int) -> list[str]:
    from bokeh.palettes import Category10_10, turbo

    return list(Category10_10[:n]) if n <= 10 else list(turbo(n))


class JobPage:
    """The widgets of one browser session; :meth:`update` refreshes them from the data plane."""

    def __init__(self, scheduler: Any) -> None:
        from bokeh.layouts import column, row
        from bokeh.models.widgets import Div, Select

        self.scheduler = scheduler
        self.job: str | None = None
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

    # ------------------------------------------------------------------ refresh
    def update(self) -> None:
        try:
            self._update()
        except Exception:  # keep the session alive; the next tick may succeed
            logger.exception("omniload dashboard page: update failed")

    def _update(self) -> None:
        plugin = _dask.scheduler_plugin(self.scheduler, "omniload")
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
        self.summary.text = self._summary_html(stats, now)
        self._refresh_rates(run, now)
        if stats["next_step"] != self._last_step:
            self._refresh_steps(run, stats)
            self._last_step = stats["next_step"]
        self._refresh_ranks(stats)
        self._refresh_sources(stats)

    def _on_select(self, attr: str, old: Any, new: Any) -> None:
        if new and new != self.job:
            self.job = new
            self._run_id = None
            self.update()

    # ------------------------------------------------------------------ layout
    def _build(self, stats: dict[str, Any]) -> None:
        from bokeh.layouts import gridplot
        from bokeh.models import ColumnDataSource, FactorRange, NumeralTickFormatter
        from bokeh.models.annotations import Span
        from bokeh.models.widgets import DataTable, NumberFormatter, TableColumn

        names = [str(s["name"]) for s in stats["sources"]]
        ranks = [str(r) for r in sorted(int(r) for r in stats["ranks"])]
        self.colors = dict(zip(names, _palette(len(names)), strict=True))
        self.names = names
        quota = any(s.get("quota") is not None for s in stats["sources"])
        by = stats.get("mixing_by", "tokens")

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

        read_fig = _figure("Read + decode throughput per source", "records/s", "seconds")
        read_fig.multi_line(
            "xs", "ys", color="color", legend_field="source", line_width=2, source=self.read_rate
        )
        token_fig = _figure("Tokenize throughput per source", "tokens/s", "seconds")
        token_fig.multi_line(
            "xs", "ys", color="color", legend_field="source", line_width=2, source=self.token_rate
        )
        mix_fig = _figure(
            f"Mix: realised over {MIX_WINDOW} steps (solid) vs target (dashed)",
            f"share of {by}",
            "step",
        )
        mix_fig.multi_line(
            "xs",
            "ys",
            color="color",
            legend_field="source",
            line_width=1.5,
            line_alpha=0.7,
            source=self.mix_realised,
        )
        mix_fig.multi_line(
            "xs", "ys", color="color", line_dash="dashed", line_width=2.5, source=self.mix_target
        )
        for fig in (read_fig, token_fig):
            fig.yaxis.formatter = NumeralTickFormatter(format="0.[0]a")
        eff_fig = _figure("Balance efficiency per step (mean/max rank cost)", "efficiency", "step")
        eff_fig.line("step", "efficiency", line_width=1.5, source=self.efficiency)
        eff_fig.scatter("step", "efficiency", size=3, source=self.efficiency)
        eff_fig.add_layout(Span(location=1.0, dimension="width", line_dash="dotted"))
        wait_fig = _figure(
            "Feeder wait per rank (recent micro-batches)",
            "ms",
            "rank",
            x_range=FactorRange(factors=ranks),
        )
        wait_fig.vbar(x="rank", top="p99", width=0.7, legend_label="p99", source=self.feeders)
        wait_fig.scatter(
            "rank",
            "p50",
            marker="diamond",
            size=10,
            color="black",
            legend_label="p50",
            source=self.feeders,
        )
        depth_fig = _figure(
            "Prefetch depth per rank (steps buffered when it last asked)",
            "steps",
            "rank",
            x_range=FactorRange(factors=ranks),
        )
        depth_fig.vbar(
            x="rank", top="buffered", width=0.7, legend_label="buffered", source=self.feeders
        )
        depth_fig.scatter(
            "rank",
            "prefetch",
            marker="dash",
            size=24,
            line_width=3,
            color="black",
            legend_label="prefetch",
            source=self.feeders,
        )
        limit = "quota" if quota else "read-ahead window"
        reads_fig = _figure(
            f"Read tasks per source (in flight, {limit})",
            "read units",
            "source",
            x_range=FactorRange(factors=names),
        )
        reads_fig.vbar_stack(
            ["pending", "in_memory"],
            x="source",
            width=0.6,
            color=["#f28e2b", "#4e79a7"],
            legend_label=["reading", "read, held"],
            source=self.reads,
        )
        reads_fig.scatter(
            "source",
            "limit",
            marker="dash",
            size=40,
            line_width=3,
            color="black",
            legend_label=limit,
            source=self.reads,
        )
        pct = NumberFormatter(format="0.0%")
        num = NumberFormatter(format="0,0")
        rate = NumberFormatter(format="0,0.0")
        columns = [
            TableColumn(field="source", title="source"),
            TableColumn(field="target", title="target", formatter=pct),
            TableColumn(field="realised", title="realised", formatter=pct),
            TableColumn(field="epoch", title="epoch"),
            TableColumn(field="documents", title="documents", formatter=num),
            TableColumn(field="tokens", title="tokens", formatter=num),
            TableColumn(field="records_per_s", title="records/s", formatter=rate),
            TableColumn(field="tokens_per_s", title="tokens/s", formatter=num),
            TableColumn(field="in_flight", title="units in flight"),
            TableColumn(field="limit", title=limit),
            TableColumn(field="skipped", title="skipped", formatter=num),
            TableColumn(field="truncated", title="truncated tokens", formatter=num),
            TableColumn(field="last_bad", title="last skipped record", width=400),
        ]
        table = DataTable(
            source=self.table,
            columns=columns,
            height=28 * (len(names) + 1) + 8,
            sizing_mode="stretch_width",
            index_position=None,
            name="omniload-source-table",
        )
        grid = gridplot(
            [[read_fig, token_fig], [mix_fig, eff_fig], [wait_fig, depth_fig], [reads_fig, None]],
            sizing_mode="stretch_width",
            merge_tools=False,
        )
        self.body.children = [grid, table]

    # ------------------------------------------------------------------ data
    def _refresh_rates(self, run: Any, now: float) -> None:
        t, records, tokens = run.monitor.throughput_series(now, RATE_BINS)
        for cds, values in ((self.read_rate, records), (self.token_rate, tokens)):
            cds.data = {
                "xs": [t] * len(self.names),
                "ys": list(values),
                "color": [self.colors[n] for n in self.names],
                "source": self.names,
            }

    def _refresh_steps(self, run: Any, stats: dict[str, Any]) -> None:
        figures = list(run.coord.history)[-(STEPS_SHOWN + MIX_WINDOW) :]
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
            "truncated": [s["truncated_tokens"] for s in sources],
            "last_bad": [(s.get("bad_examples") or [""])[-1] for s in sources],
        }

    def _summary_html(self, stats: dict[str, Any], now: float) -> str:
        recent = stats.get("efficiency_recent") or []
        capacity = stats.get("capacity_tokens") or 0
        status = (
            f"<span style='color:#c0392b'>failed: {html.escape(str(stats['error']))}</span>"
            if stats.get("error")
            else "running"
        )
        skipped = sum(s["skipped"] for s in stats["sources"])
        eff = (
            f"last {recent[-1]:.4f}, mean {stats['efficiency_mean']:.4f}, "
            f"min {stats['efficiency_min']:.4f}"
            if recent
            else "-"
        )
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
            f"every rank fetched through step {stats['start_step'] + stats['steps_fetched'] - 1}"
            if stats["steps_fetched"]
            else "no step fetched by every rank yet",
            f"{rate:.2f} steps/s" if rate is not None else "- steps/s",
            f"tokens drawn {format_si(stats['tokens'])}",
            f"balance efficiency {eff}",
            f"capacity used {stats['tokens'] / capacity:.1%}" if capacity else "",
            f"records skipped {skipped}",
        ]
        return (
            "<div style='font-size:14px;line-height:1.6;padding-top:18px'>"
            + " · ".join(first)
            + "<br/>"
            + " · ".join(p for p in second if p)
            + "</div>"
        )


def _figure(title: str, y_label: str, x_label: str, **kwargs: Any) -> Any:
    """A figure of the page; its legend (filled by the glyphs) sits right of the plot."""
    from bokeh.models.annotations import Legend
    from bokeh.plotting import figure

    fig = figure(
        title=title,
        height=260,
        sizing_mode="stretch_width",
        tools="pan,wheel_zoom,box_zoom,reset,save",
        toolbar_location="above",
        **kwargs,
    )
    fig.xaxis.axis_label = x_label
    fig.yaxis.axis_label = y_label
    fig.add_layout(Legend(click_policy="hide", border_line_alpha=0), "right")
    return fig

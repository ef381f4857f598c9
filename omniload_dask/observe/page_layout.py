"""The layout of the Omniload dashboard page: its plots and the per-source table.

The page's data lives in named Bokeh ``ColumnDataSource`` objects that
:class:`~omniload_dask.observe.dashboard.JobPage` keeps and refreshes; this module only draws
them, once per run of a job (the sources, ranks and limits shown change with it)::

    read + decode (records/s)      | tokenize (tokens/s)          read_rate, token_rate
    mixture: realised vs target    | balance efficiency           mix_realised, mix_target,
                                                                  efficiency
    feeder wait p50/p99 per rank   | prefetch depth per rank      feeders
    read tasks per source (pending, in memory, window or quota)   reads
    table per source                                              table
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["MIX_WINDOW", "PageSources", "build_body", "palette"]

MIX_WINDOW = 16  # steps behind each point of the realised-mix curve


class PageSources(Protocol):
    """The page's data: one ``ColumnDataSource`` per plot group (see the module docstring)."""

    read_rate: Any
    token_rate: Any
    mix_realised: Any
    mix_target: Any
    efficiency: Any
    feeders: Any
    reads: Any
    table: Any


def palette(n: int) -> list[str]:
    """``n`` distinct line colours, one per source."""
    from bokeh.palettes import Category10_10, turbo

    return list(Category10_10[:n]) if n <= 10 else list(turbo(n))


def build_body(
    data: PageSources, names: list[str], ranks: list[str], quota: bool, by: str
) -> list[Any]:
    """The page's body for one run: the plot grid and the source table, drawing ``data``.

    ``names`` are the sources, ``ranks`` the trainer ranks (as text), ``quota`` whether the
    read limit shown is a quota (else the read-ahead window), ``by`` what the mix counts.
    """
    from bokeh.layouts import gridplot

    limit = "quota" if quota else "read-ahead window"
    grid = gridplot(
        [
            [*_throughput(data)],
            [*_mix_and_balance(data, by)],
            [*_feeders(data, ranks)],
            [_reads(data, names, limit), None],
        ],
        sizing_mode="stretch_width",
        merge_tools=False,
    )
    return [grid, _source_table(data, len(names), limit)]


def _throughput(data: PageSources) -> tuple[Any, Any]:
    from bokeh.models import NumeralTickFormatter

    read_fig = _figure("Read + decode throughput per source", "records/s", "seconds")
    read_fig.multi_line(
        "xs", "ys", color="color", legend_field="source", line_width=2, source=data.read_rate
    )
    token_fig = _figure("Tokenize throughput per source", "tokens/s", "seconds")
    token_fig.multi_line(
        "xs", "ys", color="color", legend_field="source", line_width=2, source=data.token_rate
    )
    for fig in (read_fig, token_fig):
        fig.yaxis.formatter = NumeralTickFormatter(format="0.[0]a")
    return read_fig, token_fig


def _mix_and_balance(data: PageSources, by: str) -> tuple[Any, Any]:
    from bokeh.models.annotations import Span

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
        source=data.mix_realised,
    )
    mix_fig.multi_line(
        "xs", "ys", color="color", line_dash="dashed", line_width=2.5, source=data.mix_target
    )
    eff_fig = _figure("Balance efficiency per step (mean/max rank cost)", "efficiency", "step")
    eff_fig.line("step", "efficiency", line_width=1.5, source=data.efficiency)
    eff_fig.scatter("step", "efficiency", size=3, source=data.efficiency)
    eff_fig.add_layout(Span(location=1.0, dimension="width", line_dash="dotted"))
    return mix_fig, eff_fig


def _feeders(data: PageSources, ranks: list[str]) -> tuple[Any, Any]:
    from bokeh.models import FactorRange

    wait_fig = _figure(
        "Feeder wait per rank (recent micro-batches)",
        "ms",
        "rank",
        x_range=FactorRange(factors=ranks),
    )
    wait_fig.vbar(x="rank", top="p99", width=0.7, legend_label="p99", source=data.feeders)
    wait_fig.scatter(
        "rank",
        "p50",
        marker="diamond",
        size=10,
        color="black",
        legend_label="p50",
        source=data.feeders,
    )
    depth_fig = _figure(
        "Prefetch depth per rank (steps buffered when it last asked)",
        "steps",
        "rank",
        x_range=FactorRange(factors=ranks),
    )
    depth_fig.vbar(
        x="rank", top="buffered", width=0.7, legend_label="buffered", source=data.feeders
    )
    depth_fig.scatter(
        "rank",
        "prefetch",
        marker="dash",
        size=24,
        line_width=3,
        color="black",
        legend_label="prefetch",
        source=data.feeders,
    )
    return wait_fig, depth_fig


def _reads(data: PageSources, names: list[str], limit: str) -> Any:
    from bokeh.models import FactorRange

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
        source=data.reads,
    )
    reads_fig.scatter(
        "source",
        "limit",
        marker="dash",
        size=40,
        line_width=3,
        color="black",
        legend_label=limit,
        source=data.reads,
    )
    return reads_fig


def _source_table(data: PageSources, rows: int, limit: str) -> Any:
    from bokeh.models.widgets import DataTable, NumberFormatter, TableColumn

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
        TableColumn(field="filtered", title="filtered", formatter=num),
        TableColumn(field="truncated", title="truncated tokens", formatter=num),
        TableColumn(field="last_bad", title="last skipped record", width=400),
    ]
    return DataTable(
        source=data.table,
        columns=columns,
        height=28 * (rows + 1) + 8,
        sizing_mode="stretch_width",
        index_position=None,
        name="omniload-source-table",
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

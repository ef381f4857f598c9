"""The monitoring figures, without Dask: rates, time bins, realised mix, feeder reports."""

from __future__ import annotations

import numpy as np
import pytest

from omniload_dask.core.coordinator import StepFigures
from omniload_dask.errors import JobError
from omniload_dask.observe.formatting import checkpoint_text, format_si
from omniload_dask.observe.monitoring import FeederReport, JobMonitor, realised_shares


def test_rates_count_only_reads_finished_in_the_window():
    mon = JobMonitor(2, started=100.0)
    mon.on_read(0, 101.0, records=10, tokens=1000, read_seconds=0.1, tokenize_seconds=0.2)
    mon.on_read(0, 109.0, records=20, tokens=2000, read_seconds=0.1, tokenize_seconds=0.2)
    mon.on_read(1, 111.0, records=5, tokens=500, read_seconds=None, tokenize_seconds=None)
    records, tokens = mon.rates(now=115.0, window=10.0)  # reads after t=105 count
    np.testing.assert_allclose(records, [2.0, 0.5])
    np.testing.assert_allclose(tokens, [200.0, 50.0])
    assert mon.records.tolist() == [30, 5]
    assert mon.read_units.tolist() == [2, 1]
    np.testing.assert_allclose(mon.tokenize_seconds, [0.4, 0.0])


def test_rates_of_a_young_job_use_its_age_not_the_whole_window():
    mon = JobMonitor(1, started=100.0)
    mon.on_read(0, 101.0, records=4, tokens=40, read_seconds=0, tokenize_seconds=0)
    records, _ = mon.rates(now=102.0, window=10.0)
    assert records.tolist() == [2.0]


def test_reads_of_an_unknown_source_are_ignored():
    mon = JobMonitor(1, started=0.0)
    mon.on_read(3, 1.0, records=4, tokens=40, read_seconds=0, tokenize_seconds=0)
    assert mon.read_units.tolist() == [0]


def test_throughput_series_puts_each_read_in_the_bin_of_its_finish_time():
    mon = JobMonitor(2, started=0.0)
    mon.on_read(0, 0.5, records=3, tokens=30, read_seconds=0, tokenize_seconds=0)
    mon.on_read(1, 2.5, records=7, tokens=70, read_seconds=0, tokenize_seconds=0)
    mon.on_read(0, 3.0, records=1, tokens=10, read_seconds=0, tokenize_seconds=0)  # == now
    ends, records, tokens = mon.throughput_series(now=3.0, bins=60)
    assert ends.tolist() == [1.0, 2.0, 3.0]  # 1 s bins: a 3 s old job has three
    assert records.tolist() == [[3, 0, 1], [0, 0, 7]]
    assert tokens.tolist() == [[30, 0, 10], [0, 0, 70]]


def test_throughput_series_widens_bins_to_cover_a_long_run():
    mon = JobMonitor(1, started=0.0)
    for t in range(1, 121):
        mon.on_read(0, float(t), records=1, tokens=1, read_seconds=0, tokenize_seconds=0)
    ends, records, _ = mon.throughput_series(now=120.0, bins=60)
    assert len(ends) == 60 and ends[-1] == 120.0 and ends[0] == 2.0
    np.testing.assert_allclose(records[0], 1.0)  # two reads per 2 s bin


def test_steps_per_second_follows_the_slowest_rank():
    mon = JobMonitor(1, started=0.0)
    assert mon.steps_per_second(now=1.0) is None
    mon.on_progress(1.0, 10)
    mon.on_progress(2.0, 10)  # no move: not logged again
    mon.on_progress(3.0, 14)
    assert mon.steps_per_second(now=5.0) == pytest.approx(4 / 4)


def test_feeder_reports_are_checked_field_by_field():
    report = FeederReport.parse(
        3,
        7.0,
        {"wait_p50": 0.001, "wait_p99": 0.01, "buffered": 1, "prefetch": 2, "samples": 9},
    )
    assert (report.rank, report.time, report.buffered, report.prefetch) == (3, 7.0, 1, 2)
    empty = FeederReport.parse(0, 0.0, {"wait_p50": None, "wait_p99": None, "prefetch": 2})
    assert empty.wait_p99 is None and empty.buffered == 0
    with pytest.raises(JobError, match=r"rank 3: buffered must be a number, got 'x'"):
        FeederReport.parse(3, 0.0, {"buffered": "x"})
    with pytest.raises(JobError, match=r"wait_p99 must be >= 0, got -1"):
        FeederReport.parse(3, 0.0, {"wait_p99": -1})
    with pytest.raises(JobError, match=r"unknown fields \['depth'\]"):
        FeederReport.parse(3, 0.0, {"depth": 1})


def _figure(step: int, tokens: list[int], docs: list[int], target: list[float]) -> StepFigures:
    return StepFigures(step, 1.0, 2, sum(tokens), sum(docs), tokens, docs, target)


def test_realised_shares_are_rolling_over_the_window_and_use_the_mixing_basis():
    figures = [
        _figure(0, [30, 10], [1, 3], [0.5, 0.5]),
        _figure(1, [10, 30], [1, 1], [0.5, 0.5]),
        _figure(2, [40, 0], [2, 0], [0.75, 0.25]),
    ]
    steps, target, realised = realised_shares(figures, 2, "tokens", window=2)
    assert steps.tolist() == [0, 1, 2]
    assert target.tolist() == [[0.5, 0.5], [0.5, 0.5], [0.75, 0.25]]
    np.testing.assert_allclose(realised, [[0.75, 0.25], [0.5, 0.5], [50 / 80, 30 / 80]])
    _, _, by_docs = realised_shares(figures, 2, "documents", window=1)
    np.testing.assert_allclose(by_docs, [[0.25, 0.75], [0.5, 0.5], [1.0, 0.0]])
    steps, target, realised = realised_shares([], 2, "tokens", window=4)
    assert steps.shape == (0,) and realised.shape == (0, 2)


def test_realised_shares_count_a_source_that_joined_after_the_steps_as_zero():
    # A source joins at the draw of a step whose figures are not counted yet (it is dealt
    # in a thread): the job lists three sources, every step counted so far has two.
    figures = [_figure(0, [30, 10], [1, 3], [0.5, 0.5]), _figure(1, [10, 30], [1, 1], [0.5, 0.5])]
    _, target, realised = realised_shares(figures, 3, "tokens", window=2)
    assert target.tolist() == [[0.5, 0.5, 0.0], [0.5, 0.5, 0.0]]
    np.testing.assert_allclose(realised, [[0.75, 0.25, 0.0], [0.5, 0.5, 0.0]])
    mixed = [*figures, _figure(2, [10, 10, 20], [1, 1, 2], [0.25, 0.25, 0.5])]
    _, _, realised = realised_shares(mixed, 3, "tokens", window=2)
    np.testing.assert_allclose(realised[-1], [20 / 80, 40 / 80, 20 / 80])


def test_checkpoint_and_number_texts():
    assert checkpoint_text(None, 10.0) == "none yet"
    assert checkpoint_text({"step": 40, "time": 4.0}, 10.0) == "step 40, 6 s ago"
    assert format_si(None) == "-"
    assert format_si(1_234_567) == "1.23M"
    assert format_si(12.5) == "12.5"

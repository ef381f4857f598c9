"""Timings on a machine whose speed drifts: each unit's figure is its time at the machine's
best speed, the drift fitted out from the other units timed around it; the timer goes on
timing the units not yet confirmed, within its bound.

Times here are scripted, never measured: these tests check the logic, not a machine."""

from __future__ import annotations

import numpy as np
import pytest

from omniload_dask.calibrate import CalibrationError, MicroBatch, StepTimer, judge_timings


def interleaved(base: np.ndarray, rounds: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Every unit once per round, in a shuffled order; times exact (``base``)."""
    rng = np.random.default_rng(seed)
    unit = np.concatenate([rng.permutation(len(base)) for _ in range(rounds)])
    return unit, base[unit].astype(np.float64)


def test_the_worked_example_of_the_module_doc():
    base = np.array([0.010, 0.020, 0.040])
    unit, seconds = interleaved(base, 6, seed=0)
    seconds[9:] *= 1.5  # rounds 4-6
    got = judge_timings(unit, seconds, 3, window=5)
    assert got.seconds.tolist() == pytest.approx(base.tolist())
    assert np.median(seconds[unit == 0]) == pytest.approx(0.0125)  # what the median reads
    assert got.slowest_state == pytest.approx(1.5)
    assert got.log_unit.tolist() == unit.tolist() and got.log_seconds.tolist() == seconds.tolist()


def test_a_slow_stretch_is_fitted_out_for_every_unit_even_where_it_holds_most_of_its_timings():
    base = np.linspace(0.01, 0.05, 40)
    unit, seconds = interleaved(base, 6, seed=1)
    rng = np.random.default_rng(2)
    seconds *= 1 + 0.04 * rng.random(len(seconds))  # jitter: up to 4 % more, every timing
    seconds[80:200] *= 1.5  # rounds 3-5 ran 1.5x slower, for every unit alike
    got = judge_timings(unit, seconds, 40, window=9, steady=10.0)  # every timing counts
    ratio = got.seconds / base
    assert ratio.max() / ratio.min() < 1.04  # one shared offset (the jitter), no 1.5x mix
    assert got.counted_share == 1.0
    # Leaving out the slow stretch (counting within 25 % of the best speed) keeps the quick
    # rounds.
    kept = judge_timings(unit, seconds, 40, window=9, steady=0.25)
    assert kept.counted_share == pytest.approx(0.5, abs=0.1)
    assert kept.seconds / base == pytest.approx(ratio, rel=0.04)
    # The best of each unit's timings mixes the states: a unit whose quick timings are
    # dropped reads 1.5x; the fit still reads it from its slow timings.
    quick = (unit == 7) & ((np.arange(len(unit)) < 80) | (np.arange(len(unit)) >= 200))
    got = judge_timings(unit[~quick], seconds[~quick], 40, window=9, steady=10.0)
    assert seconds[~quick][unit[~quick] == 7].min() > 1.45 * base[7]
    assert got.seconds[7] / base[7] == pytest.approx(np.median(ratio), rel=0.04)


def test_a_figure_is_confirmed_by_its_standard_error_and_complete_with_enough_timings():
    base = np.full(20, 0.02)
    unit, seconds = interleaved(base, 4, seed=3)
    noisy = np.flatnonzero(unit == 5)
    seconds[noisy] *= [1.0, 1.2, 0.9, 1.1]  # one unit's timings spread by 10 %
    got = judge_timings(unit, seconds, 20, keep=4, tolerance=0.015)
    assert got.error[5] > 0.015 and not got.confirmed[5] and not got.complete[5]
    assert np.delete(got.error, 5) == pytest.approx(0.0, abs=1e-12)
    assert np.delete(got.complete, 5).all()
    assert not judge_timings(unit, seconds, 20, keep=5).complete.any()  # 4 timings each
    single = judge_timings(unit[:20], seconds[:20], 20)  # one timing confirms nothing
    assert np.isinf(single.error).all() and not single.confirmed.any()
    assert single.summary()["timings"] == 20


def test_bad_timings_are_refused():
    with pytest.raises(ValueError, match="finite and > 0"):
        judge_timings(np.array([0, 1]), np.array([0.1, 0.0]), 2)
    with pytest.raises(ValueError, match="in range"):
        judge_timings(np.array([0, 2]), np.array([0.1, 0.1]), 2)
    with pytest.raises(ValueError, match="keep must be >= 1"):
        judge_timings(np.array([0]), np.array([0.1]), 1, keep=0)
    empty = judge_timings(np.zeros(0), np.zeros(0), 3)
    assert np.isinf(empty.seconds).all() and not empty.complete.any()


class ScriptedTimer(StepTimer):
    """A StepTimer whose timings are scripted: a micro-batch of n tokens takes n ms, times
    ``off[n](call)`` at its ``call``-th timing where ``off`` has n."""

    def __init__(self, off: dict | None = None) -> None:
        super().__init__(lambda batch: None, "cpu", vocab=8)
        self.off = off or {}
        self.calls: dict[int, int] = {}

    def run(self, step):
        tokens = int(step[0]["input_ids"].shape[0])
        self.calls[tokens] = call = self.calls.get(tokens, 0) + 1
        return tokens * 1e-3 * (self.off[tokens](call) if tokens in self.off else 1.0)


STEPS = [[MicroBatch((n,))] for n in range(20, 60)]
TIMES = [n * 1e-3 for n in range(20, 60)]


def test_settle_stops_when_every_unit_is_complete():
    got = ScriptedTimer().settle(STEPS, keep=3, min_repeats=3, max_repeats=10, warmup=0)
    assert got.complete.all() and got.timings.tolist() == [3] * 40
    assert got.seconds.tolist() == pytest.approx(TIMES)


def test_settle_times_the_incomplete_units_again_among_complete_ones_within_its_bound():
    timer = ScriptedTimer({25: lambda call: 1.5 if call == 2 else 1.0})  # 25, 37.5, 25 ms
    progress: list[tuple[int, int]] = []
    got = timer.settle(STEPS, keep=2, min_repeats=2, max_repeats=6, warmup=0,
                       progress=lambda done, total: progress.append((done, total)))  # fmt: skip
    # Unit 5 (25 tokens) is not confirmed by two timings 50 % apart; the round that times it
    # again mixes in 9 complete units (the window), and then it is.
    assert got.complete.all() and got.seconds.tolist() == pytest.approx(TIMES, rel=0.01)
    assert got.timings[5] == 3 and got.timings.sum() == 40 * 2 + 1 + 9
    assert progress[-1] == (90, 90)
    timer = ScriptedTimer({25: lambda call: 1 + 0.1 * call})  # every timing 10 % slower
    got = timer.settle(STEPS, keep=2, min_repeats=2, max_repeats=5, warmup=0)
    assert not got.complete[5] and got.timings[5] == 5 and got.timings.max() == 5
    assert got.complete_share == 39 / 40


def test_settle_refuses_bad_repeats():
    with pytest.raises(CalibrationError, match="min_repeats <= max_repeats"):
        ScriptedTimer().settle([[MicroBatch((8,))]], min_repeats=4, max_repeats=2)

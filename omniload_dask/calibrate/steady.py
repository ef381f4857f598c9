"""Each unit's time at the machine's best speed, from timings taken while that speed changed.
Pure numpy; :meth:`.runner.StepTimer.settle` takes the timings.

On a shared virtual machine the same micro-batch does not take the same time: the machine's
speed drifts (stretches of seconds to minutes run 1.5-2x slower, for every micro-batch
alike: another tenant, the host), and each timing has its own jitter of a few percent on
top. The best of a few timings per unit then compares a quick stretch for one unit with a
slow one for another. So the timings, taken in a shuffled order over all units, are read as

    seconds[i] = figure[unit[i]] * state[i] * jitter[i]

and fitted by alternating two robust steps (a median polish, over time):

- the machine's *state* at timing i is the median, over the ``window`` timings around it
  (other units: the shuffled order puts them there; not i itself), of each one's seconds
  over its unit's current figure;
- a unit's *figure* is the mean of the middle half (the interquartile mean) of its timings
  divided by their states, over the timings whose state is within ``steady`` of the best
  state (the 10th percentile: where the machine ran at its best speed; far slower stretches
  slow different work differently, and are left out).

The figures are scaled to the best state (seconds at the machine's best speed). A figure is
*confirmed* when its standard error (the spread of its unit's normalised timings, over the
square root of their count) is within ``tolerance`` of it, and *complete* when ``keep``
timings counted and it is confirmed: the timer goes on timing the others.

Worked example: units a, b, c of 10, 20 and 40 ms, six shuffled rounds, the machine 1.5x
slower from the fourth round on (window 5)::

    rounds 1-3   a 0.010  b 0.020  c 0.040     states 1.0 (the neighbours' ratios)
    rounds 4-6   a 0.015  b 0.030  c 0.060     states 1.5
    figures      a 0.010  b 0.020  c 0.040     (the median of each unit's timings, or their
                                                mean, would read 12.5, 25 and 50 ms)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

__all__ = ["Settled", "judge_timings"]

ITERATIONS = 8  # of the median polish: it settles in a few


@dataclass(frozen=True)
class Settled:
    """Each unit's figure and how it was reached (arrays indexed by unit)."""

    seconds: np.ndarray  # the figure: seconds at the machine's best speed
    error: np.ndarray  # its standard error, relative (inf with fewer than two timings)
    confirmed: np.ndarray  # bool: the error within the tolerance
    complete: np.ndarray  # bool: confirmed, from at least ``keep`` counted timings
    counted: np.ndarray  # timings that counted
    timings: np.ndarray  # timings taken
    counted_share: float  # of all timings, the share taken near the machine's best speed
    slowest_state: float  # the slowest state met, relative to the best (1.5: 1.5x slower)
    log_unit: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # in order
    log_seconds: np.ndarray = field(default_factory=lambda: np.zeros(0))  # ... the timings

    @property
    def confirmed_share(self) -> float:
        """The share of units whose figure is confirmed."""
        return float(self.confirmed.mean()) if len(self.confirmed) else 1.0

    @property
    def complete_share(self) -> float:
        """The share of units that need no more timings."""
        return float(self.complete.mean()) if len(self.complete) else 1.0

    def summary(self) -> dict[str, float | int]:
        """Plain data about the run: units, timings, what counted, what is confirmed."""
        finite = self.error[np.isfinite(self.error)]
        return {
            "units": len(self.seconds),
            "timings": int(self.timings.sum()),
            "counted_share": round(self.counted_share, 4),
            "confirmed_share": round(self.confirmed_share, 4),
            "complete_share": round(self.complete_share, 4),
            "median_error_pct": round(100 * float(np.median(finite)), 3) if len(finite) else -1,
            "slowest_state": round(self.slowest_state, 3),
        }


def judge_timings(
    unit: np.ndarray,
    seconds: np.ndarray,
    units: int,
    *,
    keep: int = 4,
    tolerance: float = 0.015,
    steady: float = 0.5,
    window: int = 9,
) -> Settled:
    """Figures of ``units`` units from timings ``seconds[i]`` of unit ``unit[i]``, in the
    order they were taken (module doc)."""
    unit = np.asarray(unit, dtype=np.int64)
    y = np.asarray(seconds, dtype=np.float64)
    if unit.shape != y.shape or (len(unit) and (unit.min() < 0 or unit.max() >= units)):
        raise ValueError("unit and seconds must be alike, with units in range(units)")
    if len(y) and (not np.all(np.isfinite(y)) or y.min() <= 0):
        raise ValueError("every timing must be finite and > 0")
    if keep < 1 or window < 2:
        raise ValueError(f"keep must be >= 1 and window >= 2, got {keep} and {window}")
    taken = np.bincount(unit, minlength=units)
    if not len(y):
        none = np.zeros(units, dtype=bool)
        return Settled(np.full(units, np.inf), np.full(units, np.inf), none, none,
                       taken, taken, 0.0, 1.0)  # fmt: skip
    figure = np.full(units, np.inf)
    for u in np.flatnonzero(taken):
        figure[u] = np.median(y[unit == u])
    counts = np.ones(len(y), dtype=bool)
    state = np.ones(len(y))
    for _ in range(ITERATIONS):
        state = _state(y / figure[unit], window)
        counts = state <= np.percentile(state, 10) * (1 + steady)
        figure = _figures(unit, y / state, counts, units, figure)
    best = float(np.percentile(state, 10))
    figure = figure * best  # seconds at the best state
    error = _errors(unit, y / state, counts, units)
    counted = np.bincount(unit[counts], minlength=units)
    confirmed = error <= tolerance
    return Settled(
        seconds=figure,
        error=error,
        confirmed=confirmed,
        complete=confirmed & (counted >= keep),
        counted=counted,
        timings=taken,
        counted_share=float(counts.mean()),
        slowest_state=float(state.max() / best),
        log_unit=unit,
        log_seconds=y,
    )


def _state(ratio: np.ndarray, window: int) -> np.ndarray:
    """The median of ``ratio`` over the ``window`` positions around each, itself left out
    (fewer at the ends; the ratio itself where it has no neighbour)."""
    half = window // 2
    padded = np.concatenate([np.full(half, np.nan), ratio, np.full(half, np.nan)])
    around = sliding_window_view(padded, 2 * half + 1).copy()
    around[:, half] = np.nan
    if len(ratio) < 2:
        return ratio.copy()
    return np.asarray(np.nanmedian(around, axis=1))


def _figures(
    unit: np.ndarray, z: np.ndarray, counts: np.ndarray, units: int, before: np.ndarray
) -> np.ndarray:
    """Each unit's interquartile mean of ``z`` over its counted timings (over all of them
    where none counted; ``before`` where it has none)."""
    out = before.copy()
    for u in np.unique(unit):
        mine = unit == u
        pick = z[mine & counts] if (mine & counts).any() else z[mine]
        v = np.sort(pick)
        cut = (len(v) + 1) // 4  # 3 timings: their median
        out[u] = float(v[cut : len(v) - cut].mean())
    return out


def _errors(unit: np.ndarray, z: np.ndarray, counts: np.ndarray, units: int) -> np.ndarray:
    """Each unit's relative standard error: 1.4826 MAD / sqrt(n) of its counted ``z``."""
    out = np.full(units, np.inf)
    for u in np.unique(unit[counts]):
        v = z[(unit == u) & counts]
        if len(v) > 1:
            med = float(np.median(v))
            out[u] = 1.4826 * float(np.median(np.abs(v - med))) / med / np.sqrt(len(v))
    return out

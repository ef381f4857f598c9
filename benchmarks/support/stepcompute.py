"""Measured step time of DP ranks: each rank's micro-batches through a real forward + backward.

Shared by the benchmarks that judge balance by measured time (``balance.py``,
``gpu_balance.py``). The model and the timing are the package's own
(:mod:`omniload_dask.calibrate`: a described transformer, :meth:`StepTimer.settle`); this
module turns a balancer's assignment, or a per-rank baseline, into each rank's list of
micro-batches, and measures a step::

    ranks = rank_micro_batches(plan)                       # [[MicroBatch, ...] per rank]
    seconds, settled = measure(timer, [ranks_a, ranks_b])  # rank times per variant
    efficiency(seconds[0])                                 # mean / max over the ranks

The unit of timing is one micro-batch's forward + backward, each micro-batch of each rank of
each variant its own unit (its own inputs, its own timings), all of them interleaved in a
shuffled order; a rank's step time is the sum of its micro-batches' figures, as a trainer's
step runs them one after another (the optimizer step, the same on every rank, is left out).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from omniload_dask.batching.balance import Assignment
from omniload_dask.calibrate import MicroBatch, Settled, StepTimer, features
from omniload_dask.plan.cost import CostModel

__all__ = [
    "baseline_micro_batches",
    "efficiency",
    "efficiency_bound",
    "measure",
    "predict",
    "rank_micro_batches",
]


def rank_micro_batches(plan: Assignment) -> list[list[MicroBatch]]:
    """Each group's non-empty micro-batches (piece lengths in output order)."""
    return [
        [MicroBatch(tuple(plan.length[idx].tolist())) for idx in cells if len(idx)]
        for cells in plan.bins
    ]


def baseline_micro_batches(
    rank_lengths: Sequence[np.ndarray], micro: int, seq_len: int
) -> list[list[MicroBatch]]:
    """A rank-local loader's packing: each rank's own documents (in stream order, split at
    ``seq_len``) first fit into ``micro`` micro-batches; a piece that fits nowhere is cut
    into the micro-batches with the most room (as ``balance.baseline_costs`` does)."""
    out = []
    for lengths in rank_lengths:
        room = [seq_len] * micro
        cells: list[list[int]] = [[] for _ in range(micro)]
        for n in np.asarray(lengths).tolist():
            while n > 0:
                piece = min(n, seq_len)
                n -= piece
                for m in range(micro):
                    if room[m] >= piece:
                        room[m] -= piece
                        cells[m].append(piece)
                        break
                else:
                    for m in sorted(range(micro), key=lambda k: -room[k]):
                        take = min(piece, room[m])
                        if take:
                            room[m] -= take
                            cells[m].append(take)
                            piece -= take
        out.append([MicroBatch(tuple(c)) for c in cells if c])
    return out


def measure(
    timer: StepTimer,
    variants: Sequence[Sequence[Sequence[MicroBatch]]],
    keep: int = 6,
    max_repeats: int = 24,
    tolerance: float = 0.015,
) -> tuple[list[np.ndarray], Settled]:
    """Seconds of every rank's step, per variant, and how the timings settled.

    Every micro-batch's figure is its time at the machine's best speed, fitted from at least
    ``keep`` and at most ``max_repeats`` timings, until its standard error is within
    ``tolerance`` (:meth:`StepTimer.settle`); a rank's seconds are the sum of its
    micro-batches' figures."""
    units = [[mb] for ranks in variants for rank in ranks for mb in rank]
    settled = timer.settle(units, keep=keep, min_repeats=keep,
                           max_repeats=max(keep, max_repeats), tolerance=tolerance)  # fmt: skip
    out, at = [], 0
    for ranks in variants:
        rank_seconds = []
        for rank in ranks:
            rank_seconds.append(float(settled.seconds[at : at + len(rank)].sum()))
            at += len(rank)
        out.append(np.asarray(rank_seconds))
    return out, settled


def predict(coefficients: np.ndarray, ranks: Sequence[Sequence[MicroBatch]]) -> np.ndarray:
    """Modelled seconds of each rank's step under fitted ``coefficients`` (``TERMS`` order)."""
    out = []
    for rank in ranks:
        rows = features([mb.pieces for mb in rank], [mb.images for mb in rank])
        out.append(float((rows @ coefficients).sum()))
    return np.asarray(out)


def efficiency(rank_seconds: np.ndarray) -> float:
    """mean / max of the ranks' step times (1.0: every rank finishes together)."""
    x = np.asarray(rank_seconds, dtype=np.float64)
    return float(x.mean() / x.max()) if len(x) and x.max() > 0 else 1.0


def efficiency_bound(
    plan: Assignment, cost: CostModel, rank_tokens: int, fixed: float = 0.0
) -> float:
    """An upper bound on the efficiency any split of ``plan``'s pieces can reach under ``cost``
    (``piece + linear * L + quadratic * L**2``), ranks holding at most ``rank_tokens`` each,
    ``fixed`` added to every rank.

    Some rank holds each piece i, and every rank holds at least ``need = total - (dp - 1) *
    rank_tokens`` tokens; so the slowest rank costs at least ``c(i) + rate * (need - L_i)``,
    where ``rate`` is the least a token can cost in any chunk of any piece (a chunk of x tokens
    costs ``piece + linear x + quadratic x**2 >= x (linear + 2 sqrt(piece * quadratic))``, and
    no chunk is longer than its piece). And of the ``k * dp + 1`` costliest pieces some rank
    holds ``k + 1``. Cutting pieces further and micro-batch limits are ignored: the bound is
    optimistic (the best split may be below it), tight when a few long pieces set the step.
    """
    costs = plan.group_costs + fixed
    mean = float(costs.mean())
    lengths = plan.length.astype(np.float64)
    p, q = cost.piece, cost.quadratic
    best = np.sqrt(p / q) if p > 0 and q > 0 else np.inf  # the cheapest chunk length per token
    nonlinear = np.where(lengths >= best, 2 * np.sqrt(p * q), p / lengths + q * lengths)
    rate = cost.linear + float(nonlinear.min())
    need = float(lengths.sum()) - (plan.groups - 1) * rank_tokens
    piece_cost = cost(plan.length)  # without the image terms
    slowest = float(np.max(piece_cost + rate * np.maximum(0.0, need - lengths)))
    # Pigeonhole: of the k * dp + 1 costliest pieces some rank holds k + 1, each costing at
    # least the (k * dp + 1)-th.
    ranked = np.sort(piece_cost)[::-1]
    k = np.arange(0, (len(ranked) - 1) // plan.groups + 1)
    if len(ranked):
        slowest = max(slowest, float(np.max((k + 1) * ranked[k * plan.groups])))
    return mean / max(mean, slowest + fixed)

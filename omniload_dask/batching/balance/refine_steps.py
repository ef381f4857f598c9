"""Pass 3 of the balancer (:mod:`.refine`) for several steps side by side.

At small DP sizes a round of the refinement costs what its numpy calls cost, not what its
arrays hold: a step of DP 8 has about 60 pieces, and a round makes some 140 calls of a few
microseconds each. :func:`refine_steps` puts the pieces and bins of several steps side by
side (:func:`~.placement.side_by_side`: step s's groups numbered from ``s * groups``) and runs
the rounds of all of them in one set of calls::

    steps 40..47 drawn, DP 8     -> one problem of 64 groups, in 8 blocks of 8
    each round, per step: its peak, whether it goes on, its pairs (its own groups only)
    then one _whole_round / _cut_round over every step's pairs

Every step keeps its own state: rounds, peak, the reasons :func:`~.refine.refine_groups`
stops for, its probe (from 9 pairs: :class:`~.refine.StepPairs`), whether its cut rounds
still weigh whole pieces, and its own running sums (:class:`~.weighing.Runs`). The changes,
and so the split, are those of the step alone, to the last bit. Up to ``STEPS_UP_TO`` (64)
groups, where a round weighs as many candidates whatever its number of pairs; one bucket,
steps of as many bins.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

import omniload_dask.batching.balance.refine as refine
from omniload_dask.batching.balance.pieces import Bins, Pieces, apart, side_by_side
from omniload_dask.batching.balance.refine import (
    StepPairs,
    _cut_round,
    _nothing,
    _probe,
    _whole_round,
    refine_groups,
)  # fmt: skip
from omniload_dask.batching.balance.tables import RoundTables
from omniload_dask.batching.cost import CostFunction

__all__ = ["refine_steps"]


def refine_steps(
    steps: Sequence[tuple[Pieces, Bins]], groups: int, cost: CostFunction, cut: bool
) -> list[tuple[Pieces, Bins]]:
    """Pass 3 for several steps at once: the same changes as :func:`refine_groups` makes on
    each step alone (and so the same split, to the last bit), in one set of numpy calls per
    round for all of them. At small DP sizes a round's time is mostly the calls' own cost,
    not the arrays' size: the planning of 8 steps at DP 8 takes 0.42-0.48x the time of 8
    alone (BENCHMARKS.md, session 26).

    The steps' pieces and bins go side by side (the groups of step s are numbered
    ``s * groups`` on); each step keeps its own rounds, peak and reasons to stop, pairs its
    own groups, and sums its own running totals (:class:`~.weighing.Runs`). For at most
    ``STEPS_UP_TO`` groups of one bucket, with as many bins in every step; returns each
    step's pieces and bins after the pass.
    """
    if len(steps) == 1 or groups < 2 or not all(len(p) for p, _ in steps):
        for p, bins in steps:
            refine_groups(p, bins, groups, cost, cut)
        return list(steps)
    shape = len(steps[0][1].room)
    if groups > refine.STEPS_UP_TO or any(
        len(b.offset) != 2 or len(b.room) != shape or (p.bin < 0).any() for p, b in steps
    ):
        raise ValueError("refine_steps: steps of one bucket, as many bins each, all placed")
    p, bins = side_by_side(steps, groups)
    _refine_side_by_side(p, bins, len(steps), groups, cost, cut)
    return apart(p, bins, steps, groups)


def _step_pairs(
    load: np.ndarray, steps: int, groups: int, tolerance: float, active: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, StepPairs]:
    """Each active step's pairs (:func:`~.refine._pairs` on its groups' loads) and probe
    (:func:`_probe`), side by side: heavy and light groups, which steps have pairs, and the
    round's :class:`~.refine.StepPairs`, in a few calls for all steps (a row's stable sort
    is the row alone's, as are its counts: :func:`~.refine.pair_counts`)."""
    rows = load.reshape(steps, groups)
    count = refine.pair_counts(rows, tolerance)
    count[~active] = 0
    has = count > 0
    if not has.any():
        none = np.zeros(0, np.int64)
        return none, none, has, StepPairs(groups // 2, none, none)
    order = (-rows).argsort(axis=1, kind="stable") + (np.arange(steps) * groups)[:, None]
    take = np.arange(groups)[None, :] < count[:, None]  # each step's first ``count``
    heavy, light = order[take], order[:, ::-1][take]
    of = np.arange(steps).repeat(count)
    probes = []
    if int(count.max()) > refine.PROBE_FROM:  # (a probe from that many pairs: large DP only)
        starts = count.cumsum() - count
        for s in (count > refine.PROBE_FROM).nonzero()[0].tolist():
            at, n = int(starts[s]), int(count[s])
            probe = _probe(load, heavy[at : at + n])
            if probe is not None:
                probes.append(probe + at)
    probe_at = np.concatenate(probes) if probes else np.zeros(0, np.int64)
    return heavy, light, has, StepPairs(groups // 2, of, probe_at)


def _refine_side_by_side(
    p: Pieces, bins: Bins, steps: int, groups: int, cost: CostFunction, cut: bool
) -> None:
    """:func:`refine_groups`'s rounds, each step with its own state (see :func:`refine_steps`)."""
    total = steps * groups
    fit_by_cut = cut and groups <= refine.CUT_EXCHANGES_UP_TO
    active = np.ones(steps, dtype=bool)
    peak = np.full(steps, np.inf)
    for _ in range(refine.ROUNDS):
        load = np.bincount(bins.group[p.bin], p.cost, total)
        top = load.reshape(steps, groups).max(axis=1)
        active &= ~(top > peak * (1 - refine.PROGRESS))
        peak = np.where(active, top, peak)
        heavy, light, has, pairs = _step_pairs(load, steps, groups, refine.TOLERANCE, active)
        active &= has
        if not active.any():
            break
        shared = RoundTables(p, bins, light, total, steps)
        score, commit = _whole_round(
            p, bins, load, heavy, light, cost if fit_by_cut else None, shared, pairs
        )
        found = np.isfinite(score)
        active &= np.bincount(heavy // groups, found, steps) > 0
        commit(found)
    if not cut:
        return
    load = np.bincount(bins.group[p.bin], p.cost, total).reshape(steps, groups)
    active = load.sum(axis=1) / groups < refine.CUT_FROM * load.max(axis=1)  # (row means)
    peak = np.full(steps, np.inf)
    weigh_whole = np.ones(steps, dtype=bool)
    for _ in range(
        refine.SMALL_CUT_ROUNDS if groups <= refine.CUT_EXCHANGES_UP_TO else refine.CUT_ROUNDS
    ):
        if not active.any():
            break
        load = np.bincount(bins.group[p.bin], p.cost, total)
        top = load.reshape(steps, groups).max(axis=1)
        active &= ~(top > peak * (1 - refine.PROGRESS))
        peak = np.where(active, top, peak)
        heavy, light, has, pairs = _step_pairs(load, steps, groups, 1 - refine.CUT_BELOW, active)
        active &= has
        if not active.any():
            break
        step_of = heavy // groups
        shared = RoundTables(p, bins, light, total, steps)
        whole = np.full(len(heavy), np.inf)
        commit_whole: Callable[[np.ndarray], None] = _nothing
        if weigh_whole[step_of].any():
            whole, commit_whole = _whole_round(p, bins, load, heavy, light, cost, shared, pairs)
            whole = np.where(weigh_whole[step_of], whole, np.inf)
        by_cut_score, commit_cut = _cut_round(p, bins, load, heavy, light, cost, shared, pairs)
        by_cut = by_cut_score < whole - refine.CUT_GAIN * load[heavy]
        by_whole = np.isfinite(whole) & ~by_cut
        active &= np.bincount(step_of, by_cut | by_whole, steps) > 0
        commit_whole(by_whole)
        commit_cut(by_cut)
        if refine.WHOLE_IN_CUT_ROUNDS != "always":
            weigh_whole &= np.bincount(step_of, by_whole, steps) > 0

"""Pass 3 of the balancer: even the heavy groups against the light ones, many pairs at once.

Each round pairs every step's heaviest groups with its lightest (:mod:`.pairs`) and, for every
pair at once in numpy, makes the change that best evens it: the move of a piece, the swap of
two, or the exchange of a piece for a run of short ones (:mod:`.whole`). A pair's groups are
its own in a round, so the changes of a round never meet::

    loads 12 9 7 4, mean 8: g0 and g1 are above it -> pairs (g0, g3) and (g1, g2)
    (g0, g3)  gap 8: move a piece of cost 4                 -> 8 . . 8
    (g1, g2)  gap 2: swap a piece of cost 3 for one of 2    -> . 8 8 .
    loads 8 8 8 8: even, the pass ends

Every change keeps each micro-batch within its tokens and leaves no more of them empty. The
step time is the heaviest group's: a round whose probe (a few of the pairs at the peak) finds no
change, or that does not lower the peak, ends the step's pass, so a step that cannot gain costs
one probe. With at most ``CUT_EXCHANGES_UP_TO`` groups and cutting allowed, an exchange may cut
the last piece of its run to fit exactly (cheap at that size; at thousands of groups it would
cut a document per group for a few ten-thousandths of efficiency).

Where cutting is allowed (``long_documents: split``) and a step is still below ``CUT_FROM``
after that, cut rounds follow while it is below ``CUT_BELOW``: per pair, the better of the
whole-piece change and a cut (:mod:`.cuts`), a cut taken only where it evens the pair clearly
better (``CUT_GAIN``). Once a cut round finds whole pieces better for no pair, the step's later
rounds weigh only cuts (what is left to even is what whole pieces could not: half a round's
time saved). The work is bounded: at most ``ROUNDS`` rounds of whole pieces and ``CUT_ROUNDS``
of cuts per step, ``SMALL_CUT_ROUNDS`` of cuts up to ``CUT_EXCHANGES_UP_TO`` groups; the cuts
made are what pass 5 (:mod:`.slide`) slides. ``benchmarks/real_balance.py`` measures what the
number of cut rounds buys.

Several steps run side by side (:func:`~.pieces.side_by_side`): every step keeps its own
rounds, peak, pairs, probe and reasons to stop, and its own running sums (:class:`~.tables.Runs`),
so its changes are those it makes alone, to the last bit; one step is the case ``steps = 1``.
Who tunes the pass sets this module's constants (read at each call).
"""

from __future__ import annotations

import numpy as np

from omniload_dask.batching.balance.cuts import cut_round
from omniload_dask.batching.balance.pairs import PROGRESS, step_pairs
from omniload_dask.batching.balance.pieces import Bins, Pieces
from omniload_dask.batching.balance.tables import RoundTables
from omniload_dask.batching.balance.whole import Round, nothing, whole_round
from omniload_dask.plan.cost import CostFunction

__all__ = ["CUT_BELOW", "CUT_ROUNDS", "ROUNDS", "SMALL_CUT_ROUNDS", "STEPS_UP_TO", "refine"]

TOLERANCE = 2e-3  # a group within 0.2% of the mean is even enough
ROUNDS = 8  # rounds of whole pieces per step ...
CUT_ROUNDS = 8  # ... and of cuts (most of them weigh cuts alone: see the module doc) ...
SMALL_CUT_ROUNDS = 12  # ... up to CUT_EXCHANGES_UP_TO groups
CUT_FROM = 0.98  # a step below this efficiency with whole pieces gets pieces cut ...
CUT_BELOW = 0.99  # ... while it is below this
CUT_EXCHANGES_UP_TO = 64  # groups up to which whole-piece rounds may cut an exchange to fit
CUT_GAIN = 1e-3  # a cut must even a pair this share of its heavy group better than whole
WHOLE_IN_CUT_ROUNDS = "until_unused"  # whole pieces weighed in cut rounds: or "always"
STEPS_UP_TO = CUT_EXCHANGES_UP_TO  # groups up to which steps are balanced side by side


def refine(p: Pieces, bins: Bins, steps: int, groups: int, cost: CostFunction, cut: bool) -> None:
    """Pass 3 (module doc) of ``steps`` steps side by side (step s: groups ``s * groups``
    on), each with pieces: changes ``p.bin`` (and, with ``cut``, cuts pieces) in place."""
    if groups < 2 or not len(p):
        return
    fit_by_cut = cut and groups <= CUT_EXCHANGES_UP_TO  # cheap there, and worth it
    load = _whole_rounds(p, bins, steps, groups, cost if fit_by_cut else None)
    if cut:
        _cut_rounds(p, bins, steps, groups, cost, load)


def _group_loads(p: Pieces, bins: Bins, total: int) -> np.ndarray:
    """Cost per group (of all steps side by side)."""
    return np.bincount(bins.group[p.bin], p.cost, total)


def _still_falling(active: np.ndarray, peak: np.ndarray, load: np.ndarray) -> None:
    """``active`` loses the steps whose last round did not lower their peak (their heaviest
    group sets their step time); ``peak`` takes the others' new one."""
    top = load.reshape(len(active), -1).max(axis=1)
    active &= ~(top > peak * (1 - PROGRESS))
    peak[active] = top[active]


def _whole_rounds(
    p: Pieces, bins: Bins, steps: int, groups: int, fit_cost: CostFunction | None
) -> np.ndarray:
    """Rounds of whole pieces (module doc); with ``fit_cost``, exchanges may cut to fit.
    Returns the group loads they leave."""
    total = steps * groups
    active = np.ones(steps, dtype=bool)
    peak = np.full(steps, np.inf)
    load = _group_loads(p, bins, total)
    for _ in range(ROUNDS):
        _still_falling(active, peak, load)
        pairs, has = step_pairs(load, steps, groups, TOLERANCE, active)
        active &= has
        if not np.count_nonzero(active):
            break
        tables = RoundTables(p, bins, pairs.light, total, steps) if steps > 1 else None
        score, commit = whole_round(p, bins, load, pairs, fit_cost, tables)
        found = np.isfinite(score)
        active &= np.bincount(pairs.step, found, steps) > 0  # (none found: the step is done)
        if not np.count_nonzero(
            found
        ):  # (nothing changed: the loads stand, and every step is done)
            break
        commit(found)
        load = _group_loads(p, bins, total)
    return load


def _cut_rounds(
    p: Pieces, bins: Bins, steps: int, groups: int, cost: CostFunction, load: np.ndarray
) -> None:
    """Rounds of cuts and whole pieces, for the steps still below ``CUT_FROM`` (module doc),
    from the group loads ``load`` that the whole rounds left."""
    total = steps * groups
    rows = load.reshape(steps, groups)
    active = rows.sum(axis=1) / groups < CUT_FROM * rows.max(axis=1)  # (row means, to the bit)
    peak = np.full(steps, np.inf)
    weigh_whole = np.ones(steps, dtype=bool)
    for r in range(SMALL_CUT_ROUNDS if groups <= CUT_EXCHANGES_UP_TO else CUT_ROUNDS):
        if not np.count_nonzero(active):
            break
        if r:  # (the first round's are those given)
            load = _group_loads(p, bins, total)
        _still_falling(active, peak, load)
        pairs, has = step_pairs(load, steps, groups, 1 - CUT_BELOW, active)
        active &= has
        if not np.count_nonzero(active):
            break
        step_of = pairs.step
        # Per pair, a cut only where it evens the pair clearly better than whole pieces do
        # (both weighed on the same tables: nothing changes between them).
        shared = RoundTables(p, bins, pairs.light, total, steps)
        whole: Round = (np.full(len(step_of), np.inf), nothing)
        if weigh_whole[step_of].any():
            whole = whole_round(p, bins, load, pairs, cost, shared)
        whole_score = np.where(weigh_whole[step_of], whole[0], np.inf)
        cut_score, commit_cut = cut_round(p, bins, load, pairs, cost, shared)
        by_cut = cut_score < whole_score - CUT_GAIN * load[pairs.heavy]
        by_whole = np.isfinite(whole_score) & ~by_cut
        active &= np.bincount(step_of, by_cut | by_whole, steps) > 0
        whole[1](by_whole)  # (pairs are disjoint: one's changes leave the others be)
        commit_cut(by_cut)
        # Once whole pieces even none of a step's pairs better than a cut, its later rounds
        # weigh cuts alone.
        if WHOLE_IN_CUT_ROUNDS != "always":
            weigh_whole &= np.bincount(step_of, by_whole, steps) > 0

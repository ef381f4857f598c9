"""Pass 3's pairs: which heavy group is evened against which light one in a round, and the probe.

Each round of the refinement (:mod:`.refine`) pairs, within each step, its heaviest groups with
its lightest (the heaviest with the lightest, the second with the second, ...): the groups more
than a tolerance of the peak above the mean, at most half of them::

    loads  g0 9   g1 4   g2 7   g3 5      mean 6.25, tolerance 0.2 x 9 = 1.8
    above the mean by more than 1.8: g0 (2.75) -> 1 pair: heavy g0, light g1
    (with g2 within the tolerance: 2 pairs, g0 with g1 and g2 with g3)

The step time is its heaviest group's, so a round helps a step only if every group at its peak
gets lighter. With many pairs a round first weighs a few of those at the peak (the *probe*):
if one of them cannot change, the step gets nothing from the round. Weighing the probe costs
nothing extra up to ``PROBE_ALONE_FROM`` pairs (its pairs are read from the round's scores);
from there, for one step alone, the probe's groups are weighed alone first (:func:`probed`:
their pieces and bins, every tie falling as among all groups), which spares the round.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from omniload_dask.batching.balance.pieces import Bins, Pieces

__all__ = ["PROGRESS", "Pairs", "pair_counts", "probed", "step_pairs"]

PROGRESS = 1e-4  # a round must lower the heaviest group by this share, or refinement stops
CANDIDATES = 8  # pieces of each group weighed for moves and swaps, spread over its costs ...
PAIR_BUDGET = 1 << 15  # ... or more, up to 32, while pairs x candidates^2 stays under this
PROBE_FROM = 8  # pairs from which a round first weighs this many of its heaviest ...
PROBE_ALONE_FROM = 32  # ... alone, before the round, from this many pairs (below: the round
# is cheap, and the probe's pairs are read from its scores: the same answer)


@dataclass(frozen=True)
class Pairs:
    """The pairs of a round, of one step or several side by side: pair i evens group
    ``heavy[i]`` against ``light[i]`` (both of step ``step[i]``); ``probe`` indexes the pairs
    that each step's probe weighs first (:func:`probe_of`); ``per_step`` is the most pairs a
    step has (what the number of candidates a round weighs follows)."""

    heavy: np.ndarray
    light: np.ndarray
    step: np.ndarray
    probe: np.ndarray
    per_step: int
    steps: int

    @classmethod
    def of_one_step(cls, load: np.ndarray, heavy: np.ndarray, light: np.ndarray) -> Pairs:
        """The pairs ``heavy``, ``light`` of one step of group loads ``load``."""
        probe = probe_of(load, heavy)
        zeros = np.zeros(len(heavy), np.int64)
        return cls(heavy, light, zeros, probe, len(heavy), 1)

    def candidates(self) -> int:
        """Pieces of each group weighed for moves and swaps in this round."""
        return int(min(max(math.sqrt(PAIR_BUDGET / self.per_step), CANDIDATES), 32))

    def probe_alone(self) -> bool:
        """Whether the round weighs its probe alone before it: one step of many pairs (the
        round is dear); else the probe's pairs are read from the round's own scores (the
        same scores: see :func:`probed`)."""
        return self.steps == 1 and len(self.probe) > 0 and len(self.heavy) >= PROBE_ALONE_FROM

    def probed(self, act: np.ndarray) -> np.ndarray:
        """``act`` (a change for pair i) without the pairs of steps whose probe found no
        change: such a step gets nothing from the round."""
        failed = self.step[self.probe[~act[self.probe]]]
        return act & ~np.isin(self.step, failed) if len(failed) else act


def pair_counts(rows: np.ndarray, tolerance: float) -> np.ndarray:
    """Per row of group loads (steps x groups), the pairs of the row (0: none). A row's max,
    mean and sums are what the row alone gives, to the bit."""
    peak, mean = rows.max(axis=1), rows.sum(axis=1) / rows.shape[1]  # (= rows.mean(axis=1))
    above = ((rows - mean[:, None]) > (tolerance * peak)[:, None]).sum(axis=1)
    count = np.minimum(above, rows.shape[1] // 2)
    count[(peak <= 0) | (peak - mean <= tolerance * peak)] = 0
    return count


def step_pairs(
    load: np.ndarray, steps: int, groups: int, tolerance: float, active: np.ndarray
) -> tuple[Pairs, np.ndarray]:
    """Each active step's pairs (module doc) and probe, in a few calls for all steps (a
    row's stable sort is the row alone's, as are its counts), and which steps have pairs."""
    rows = load.reshape(steps, groups)
    count = pair_counts(rows, tolerance)
    count[~active] = 0
    has = count > 0
    if not np.count_nonzero(has):
        none = np.zeros(0, np.int64)
        return Pairs(none, none, none, none, 1, steps), has
    if steps == 1:  # (the rows' case of one row, in slices: the masks below cost more)
        n = int(count[0])
        order = (-load).argsort(kind="stable")
        heavy, light = order[:n], order[::-1][:n]
        return Pairs(heavy, light, np.zeros(n, np.int64), probe_of(load, heavy), n, 1), has
    order = (-rows).argsort(axis=1, kind="stable") + (np.arange(steps) * groups)[:, None]
    take = np.arange(groups)[None, :] < count[:, None]  # each step's first ``count``
    heavy, light = order[take], order[:, ::-1][take]
    probes = []
    if int(count.max()) > PROBE_FROM:  # (a probe from that many pairs: large DP only)
        starts = count.cumsum() - count
        for s in (count > PROBE_FROM).nonzero()[0].tolist():
            at, n = int(starts[s]), int(count[s])
            probes.append(probe_of(load, heavy[at : at + n]) + at)
    probe = np.concatenate(probes) if probes else np.zeros(0, np.int64)
    of = np.arange(steps).repeat(count)
    return Pairs(heavy, light, of, probe, int(count.max()), steps), has


def probe_of(load: np.ndarray, heavy: np.ndarray) -> np.ndarray:
    """With many pairs: a few of those whose heavy group is at the peak, spread over them
    (pair indices, ascending); none up to ``PROBE_FROM`` pairs."""
    if len(heavy) <= PROBE_FROM:
        return np.zeros(0, np.int64)
    peak = float(load[heavy[0]])
    top = int((-load[heavy]).searchsorted(-peak * (1 - PROGRESS), side="right"))
    spread = np.linspace(0, max(top, 1) - 1, PROBE_FROM).round().astype(np.int64)
    return spread[np.append(True, spread[1:] != spread[:-1])]  # (ascending: np.unique's)


def probed(
    p: Pieces, bins: Bins, load: np.ndarray, pairs: Pairs
) -> tuple[Pieces, Bins, np.ndarray, Pairs]:
    """The probe's pairs of one step alone: their groups' pieces and bins (in their order, so
    every tie falls as it would among all groups), the groups numbered heavy first, then
    light. A round weighs only the pairs' own groups, so it scores them here as it would in
    the whole step, at the cost of these few groups instead of all of them."""
    heavy, light = pairs.heavy[pairs.probe], pairs.light[pairs.probe]
    members = np.concatenate([heavy, light])
    local = np.full(len(load), -1, np.int64)
    local[members] = np.arange(len(members))
    bin_group = local[bins.group]
    kept_bins = (bin_group >= 0).nonzero()[0]
    renumber = np.full(len(bins.room), -1, np.int64)
    renumber[kept_bins] = np.arange(len(kept_bins))
    piece_bin = renumber[p.bin]
    kept = (piece_bin >= 0).nonzero()[0]
    bucket = bins.bucket[kept_bins]  # (bins are by bucket: so are the kept ones)
    count = np.bincount(bucket, minlength=len(bins.offset) - 1)
    sub_bins = Bins(
        np.concatenate([[0], count.cumsum()]).astype(np.int64), bins.capacity[kept_bins],
        bins.room[kept_bins], bins.load[kept_bins], bucket, bin_group[kept_bins],
        bins.slot[kept_bins],
    )  # fmt: skip
    sub = Pieces(
        p.doc[kept], p.start[kept], p.length[kept], p.cost[kept], p.bucket[kept],
        p.extra[kept], piece_bin[kept],
    )  # fmt: skip
    n = len(heavy)
    sub_load = load[members]
    return sub, sub_bins, sub_load, Pairs.of_one_step(sub_load, np.arange(n), np.arange(n, 2 * n))

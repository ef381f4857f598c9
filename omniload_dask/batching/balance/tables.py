"""What a round of the refinement (:mod:`.refine`) weighs its changes on: each piece's group,
the (group, bucket) tables of bins, each group's pieces by decreasing cost and a few of them
spread over its costs (the candidates), and the light groups' runs of their shortest pieces.

A cut round weighs whole pieces and cuts on the same tables (:class:`RoundTables`, made once
per round: nothing changes between the two weighings).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from omniload_dask.batching.balance.pieces import Bins, Pieces, by_cost
from omniload_dask.batching.sorting import stable_order

__all__ = ["RoundTables", "Runs", "bin_tables", "by_group", "fractions", "rebin", "spread"]


class RoundTables:
    """What the whole-piece and the cut weighing of one round both read: each piece's
    group, the (group, bucket) tables of bins, the light groups' runs, and each group's
    pieces by decreasing cost."""

    def __init__(
        self, p: Pieces, bins: Bins, light: np.ndarray, groups: int, steps: int = 1
    ) -> None:
        """``steps``: the bins are those of that many steps, in equal blocks (see
        :class:`Runs`)."""
        self.of = bins.group[p.bin]
        self.roomiest, self.every = bin_tables(bins, groups)
        self.runs = Runs(p, bins, self.of, light, groups, steps)
        self._by_cost: tuple[np.ndarray, ...] | None = None
        self._p, self._groups = p, groups

    def candidates(self, groups: np.ndarray, k: int) -> np.ndarray:
        """Per group of ``groups``: at most ``k`` of its pieces spread over its range of
        costs, by decreasing cost, padded with -1 (:func:`spread`). The groups sorted for the
        first call serve later calls for a prefix of them (the heavy groups of a round):
        each group's order is its own, by decreasing cost, ties by index."""
        n = len(groups)
        known = self._by_cost
        if known is None or n > len(known[0]) or not np.array_equal(known[0][:n], groups):
            known = self._by_cost = (groups, *by_group(self._p, self.of, groups, self._groups))
        _, ids, start, count = known
        return spread(ids, start[:n], count[:n], k)


@lru_cache(maxsize=64)
def fractions(k: int) -> np.ndarray:
    """``np.linspace(0.0, 1.0, k)``, made once per ``k`` (read-only: it is shared)."""
    out = np.linspace(0.0, 1.0, k)
    out.flags.writeable = False
    return out


def rebin(p: Pieces, bins: Bins) -> None:
    """Recompute every bin's room and cost from its pieces."""
    n = len(bins.room)
    bins.room = bins.capacity - np.bincount(p.bin, p.length, n).astype(np.int64)
    bins.load = np.bincount(p.bin, p.cost, n)


def bin_tables(bins: Bins, groups: int) -> tuple[np.ndarray, np.ndarray]:
    """Per (group, bucket): its bin with the most room, and all its bins (-1 where none)."""
    nb = len(bins.offset) - 1
    ids = np.arange(len(bins.room))
    cell = bins.group * nb + bins.bucket
    width = int((bins.offset[1:] - bins.offset[:-1]).max()) // groups
    if width == 1:  # one micro-batch of each bucket per group: it is the roomiest
        table = np.full(groups * nb, -1, np.int64)
        table[cell] = ids
        return table.reshape(groups, nb), table.reshape(groups, nb, 1)
    # Bins by cell, each cell's by decreasing room (ties: the lower bin): a cell's first is
    # its roomiest, found for every cell by one sort and a mask of where cells change.
    order = np.lexsort((ids, -bins.room, cell))
    first = np.ones(len(order), dtype=bool)
    first[1:] = cell[order][1:] != cell[order][:-1]
    roomiest = np.full(groups * nb, -1, np.int64)
    roomiest[cell[order][first]] = order[first]
    every = np.full((groups * nb, width), -1, np.int64)
    every[cell, bins.slot] = ids  # (a cell's bins have distinct slots: one scatter)
    return roomiest.reshape(groups, nb), every.reshape(groups, nb, width)


def by_group(
    p: Pieces, of: np.ndarray, groups: np.ndarray, total: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The pieces of ``groups`` (of ``total``), group by group in that order, each group's
    by decreasing cost (ties by index); each group's start and count in them."""
    # A rank per group (len(groups): not asked) picks the pieces in one gather; sorting them
    # by cost, then stably by rank, orders them by (rank, decreasing cost) with two of the
    # cheap sorts of small integers instead of a lexsort of floats.
    rank = np.full(total, len(groups), np.int64)
    rank[groups] = np.arange(len(groups))
    ids = by_cost(p, (rank[of] < len(groups)).nonzero()[0])
    r = rank[of[ids]]
    ids, r = ids[stable_order(r)], np.sort(r)
    count = np.bincount(r, minlength=len(groups))
    return ids, count.cumsum() - count, count


def spread(ids: np.ndarray, start: np.ndarray, count: np.ndarray, k: int) -> np.ndarray:
    """At most ``k`` of each group's pieces (``ids[start:start + count]``), spread over its
    costs, padded with -1; without the columns that would be padding
    in every row (groups of fewer pieces than ``k``: smaller tables, the same choices)."""
    if not len(ids):
        return np.full((len(count), 1), -1, dtype=np.int64)
    width = max(1, min(k, int(count.max())))
    spread = np.rint(fractions(k)[None, :] * (count[:, None] - 1)).astype(np.int64)
    pos = np.where(count[:, None] >= k, spread, np.arange(k))[:, :width]
    # (a group without pieces has count 0 < k: its positions are 0..k-1, none below 0: all -1)
    return np.where(pos < count[:, None], ids[np.minimum(start[:, None] + pos, len(ids) - 1)], -1)


class Runs:
    """The pieces of the light groups' micro-batches, each micro-batch's by increasing
    length, with running totals: what a micro-batch gives back when it must free tokens.

    With ``steps`` > 1 the bins are those of several steps, in equal blocks, and the totals
    start again at each step's first bin: every sum is the one its step alone would make, to
    the last bit."""

    def __init__(
        self, p: Pieces, bins: Bins, of: np.ndarray, light: np.ndarray, groups: int,
        steps: int = 1,
    ) -> None:  # fmt: skip
        is_light = np.zeros(groups, dtype=bool)
        is_light[light] = True
        mine = is_light[of].nonzero()[0]
        # By (bin, length, index): two stable radix sorts of 16-bit keys, cheaper than a
        # lexsort.
        mine = mine[stable_order(p.length[mine])]
        self.order = mine[stable_order(p.bin[mine])]
        self.empty = not len(self.order)
        if self.empty:
            self.order = np.zeros(1, np.int64)  # (nothing is found below)
        ob = p.bin[self.order]
        ids = np.arange(len(bins.room))
        self.first = ob.searchsorted(ids, side="left")
        self.end = ob.searchsorted(ids, side="right")
        if steps == 1 or self.empty:
            # Running sums after a leading 0: what comes before each bin's run, at first[b].
            tokens = np.zeros(len(self.order) + 1, np.int64)
            costs = np.zeros(len(self.order) + 1)
            np.cumsum(p.length[self.order], out=tokens[1:])
            np.cumsum(p.cost[self.order], out=costs[1:])
            self.tokens, self.costs = tokens[1:], costs[1:]
            self.base_t, self.base_c = tokens[self.first], costs[self.first]
        else:
            per = len(bins.room) // steps
            cut = self.first[np.arange(1, steps) * per]
            # Each step's cost sums in a row of its own (a cumsum along a row adds in the
            # order the step's own cumsum does: the same values, to the last bit); token
            # counts are integers, so one cumsum less each step's start is exact.
            step = ob // per
            begin = np.concatenate([[0], cut]).astype(np.int64)
            within = np.arange(len(ob)) - begin[step]
            table = np.zeros((steps, int(within.max()) + 1))
            table[step, within] = p.cost[self.order]
            self.costs = table.cumsum(axis=1)[step, within]
            tokens = p.length[self.order].cumsum()
            self.tokens = tokens - np.concatenate([[0], tokens])[begin][step]
            restart = np.zeros(len(self.order) + 1, dtype=bool)
            restart[np.concatenate([[0], cut]).astype(np.int64)] = True
            before = restart[self.first]  # a bin whose run opens its step's totals
            self.base_t = np.where(before, 0, np.concatenate([[0], self.tokens])[self.first])
            self.base_c = np.where(before, 0.0, np.concatenate([[0.0], self.costs])[self.first])
        # One ascending key per piece, (bin, tokens of its bin's run up to it): a single
        # searchsorted then finds every bin's shortest run of at least a number of tokens.
        self.big = int(self.tokens.max()) + 1
        self.key = ob * self.big + (self.tokens - self.base_t[ob])

    def take(
        self, y: np.ndarray, need: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """For bins ``y``: the shortest run of their pieces of at least ``need`` tokens.

        Returns ``(found, tokens, cost, last)``: ``last`` indexes ``order`` (the run is
        ``order[first[y]:last + 1]``).
        """
        at = self.key.searchsorted(y * self.big + need, side="left")
        found = (at < self.end[y]) & (not self.empty)  # (past the bin's pieces: none)
        at = np.minimum(at, len(self.order) - 1)
        return found, self.tokens[at] - self.base_t[y], self.costs[at] - self.base_c[y], at

"""Where the trainer ranks are, kept incrementally: per rank, per DP group, over all groups.

A request moves the few ranks one fetching agent serves. The data plane then needs the slowest
rank of their DP group (to release the group's batches) and, over the whole job, the slowest
position and the furthest request (how far ahead to draw). A scan over every rank would cost
O(ranks) per request, O(ranks²) per step; here one costs O(ranks of the group + log groups)::

    ranks        0  1 | 2  3          dp=2, tp=2
    positions    5  7 | 6  6
    group min    5    | 6             per group, from its own ranks
    slowest      5                    a tournament tree over the group minima
    furthest     requests' ends, the same way (the largest)

Pure: no I/O and no Dask.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from omniload_dask.plan import LayoutSpec

__all__ = ["RankPositions", "Tournament"]

_FAR = 1 << 62


class Tournament:
    """The smallest (or, with ``largest``, the largest) of n values: O(log n) to change one,
    O(1) to read the winner."""

    def __init__(self, values: Sequence[int], largest: bool = False) -> None:
        """A tree over ``values`` (their number is fixed from now on)."""
        self._largest = largest
        self._size = size = 1 << max(0, len(values) - 1).bit_length()
        fill = -_FAR if largest else _FAR
        tree = [fill] * (2 * size)
        tree[size : size + len(values)] = [int(v) for v in values]
        pick = max if largest else min
        for i in range(size - 1, 0, -1):
            tree[i] = pick(tree[2 * i], tree[2 * i + 1])
        self._tree = tree

    @property
    def top(self) -> int:
        """The winner: the smallest value (the largest with ``largest``)."""
        return self._tree[1]

    def update(self, index: int, value: int) -> None:
        """Value ``index`` is now ``value``."""
        tree, largest = self._tree, self._largest
        i = index + self._size
        tree[i] = value
        i >>= 1
        while i:
            a, b = tree[2 * i], tree[2 * i + 1]
            winner = (a if a >= b else b) if largest else (a if a <= b else b)
            if tree[i] == winner:
                break  # the ancestors keep their winners too
            tree[i] = winner
            i >>= 1


class RankPositions:
    """Every rank's position (all steps below it fetched), request end and last request time.

    ``group_min[g]`` is the slowest position in DP group g; :attr:`slowest` and
    :attr:`furthest` are over the whole job.
    """

    def __init__(self, layout: LayoutSpec, start: int) -> None:
        """Every rank of ``layout`` at ``start``, none seen yet."""
        world, dp = layout.world_size, layout.dp
        self.position = np.full(world, start, dtype=np.int64)
        self.requested = np.full(world, start, dtype=np.int64)
        self.last_seen = np.zeros(world, dtype=np.float64)
        self.group_of = np.asarray([layout.coords(r)["dp"] for r in range(world)], np.int64)
        self.cp_of = np.asarray([layout.coords(r)["cp"] for r in range(world)], np.int64)
        # Each group's ranks in rank order, from one stable sort and a search of its bounds:
        # O(world log world) once, where a scan per group would be O(dp x world).
        by_group = np.argsort(self.group_of, kind="stable")
        bounds = np.searchsorted(self.group_of[by_group], np.arange(dp + 1))
        self.group_ranks = [by_group[bounds[g] : bounds[g + 1]] for g in range(dp)]
        self.group_min = [start] * dp
        self._slowest = Tournament(self.group_min)
        self._furthest = Tournament([start] * dp, largest=True)

    @property
    def slowest(self) -> int:
        """The smallest position of any rank."""
        return self._slowest.top

    @property
    def furthest(self) -> int:
        """The largest request end of any rank."""
        return self._furthest.top

    def move(self, ranks: np.ndarray, start: int, end: int, now: float) -> list[int]:
        """``ranks`` have fetched every step below ``start`` and ask up to ``end``; returns
        the DP groups they belong to."""
        self.position[ranks] = start
        self.requested[ranks] = end
        self.last_seen[ranks] = now
        groups = self.group_of[ranks]
        # An agent mostly serves one group (its tp x pp ranks): skip the sort of np.unique then.
        touched = [int(groups[0])] if (groups == groups[0]).all() else np.unique(groups).tolist()
        for g in touched:
            mine = self.group_ranks[g]
            low = int(self.position[mine].min())
            self.group_min[g] = low
            self._slowest.update(g, low)
            self._furthest.update(g, int(self.requested[mine].max()))
        return touched

    def reset(self, step: int) -> None:
        """Every rank at ``step`` (a resume: the steps before it are fetched)."""
        self.position[:] = step
        self.requested[:] = step
        self.group_min = [step] * len(self.group_min)
        self._slowest = Tournament(self.group_min)
        self._furthest = Tournament(self.group_min, largest=True)

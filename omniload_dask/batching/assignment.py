"""The split of one global batch among the DP groups, and the figures read from it.

:func:`~omniload_dask.batching.balance.balance` returns an :class:`Assignment`: a table of
pieces (document, token range, cost, DP group, micro-step). Everything downstream reads it:
the recipes (:meth:`Assignment.output_order`), the balance efficiency and the per-group and
per-micro-batch tokens and costs::

    pieces   doc  start  length  cost  group  micro
             0    0      6       6     0      0
             1    0      5       5     1      0
             2    0      3       3     1      0
             3    0      2       2     0      0
    group_costs [8, 8]   efficiency mean/max = 1.0   micro_tokens [[8], [8]]
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from omniload_dask.batching.sorting import stable_order

__all__ = ["Assignment"]


@dataclass
class Assignment:
    """The split of one step: piece i is tokens ``[start, start + length)`` of document ``doc``.

    It goes to DP group ``group[i]``, micro-step ``micro[i]``; micro-step m has room for
    ``micro_capacity[m]`` tokens and belongs to bucket ``micro_bucket[m]``.
    """

    doc: np.ndarray
    start: np.ndarray
    length: np.ndarray
    cost: np.ndarray
    group: np.ndarray
    micro: np.ndarray
    micro_capacity: np.ndarray
    micro_bucket: np.ndarray
    groups: int
    cuts: int = 0  # pieces cut to fill micro-batches or even groups (continued elsewhere)
    spilled: int = 0  # documents handed down to a shorter bucket
    bound: float = 1.0  # the best efficiency without cutting pieces shorter than seq_len
    _order: np.ndarray | None = field(default=None, repr=False)

    @property
    def num_micro_steps(self) -> int:
        """Micro-steps of the step (the same for every group)."""
        return len(self.micro_capacity)

    @property
    def group_costs(self) -> np.ndarray:
        """Cost per DP group (what the step time of its ranks follows)."""
        return np.bincount(self.group, self.cost, self.groups)

    @property
    def group_tokens(self) -> np.ndarray:
        """Tokens per DP group."""
        return np.bincount(self.group, self.length, self.groups).astype(np.int64)

    @property
    def micro_tokens(self) -> np.ndarray:
        """Tokens per (group, micro-step)."""
        flat = self.group * self.num_micro_steps + self.micro
        size = self.groups * self.num_micro_steps
        return np.bincount(flat, self.length, size).astype(np.int64).reshape(self.groups, -1)

    @property
    def micro_costs(self) -> np.ndarray:
        """Cost per (group, micro-step)."""
        flat = self.group * self.num_micro_steps + self.micro
        size = self.groups * self.num_micro_steps
        return np.bincount(flat, self.cost, size).reshape(self.groups, -1)

    @property
    def empty_micro_batches(self) -> int:
        """Micro-batches (of all groups) that hold no token."""
        return int((self.micro_tokens == 0).sum())

    @property
    def efficiency(self) -> float:
        """mean/max of the group costs (1.0 = perfect balance)."""
        costs = self.group_costs
        peak = float(costs.max()) if len(costs) else 0.0
        return float(costs.mean() / peak) if peak > 0 else 1.0

    def output_order(self) -> np.ndarray:
        """Piece indices by (group, micro-step, document, start): the order batches hold them."""
        if self._order is None:
            # Pieces come from the balancer nearly in (doc, start) order (cut parts appended),
            # which a stable sort passes in about linear time; then a stable sort by cell
            # (a radix sort where cells fit 16 bits). Unique keys: the lexsort's order.
            by_doc = np.argsort(
                self.doc * (int(self.start.max(initial=0)) + 1) + self.start, kind="stable"
            )
            cell = (self.group * self.num_micro_steps + self.micro)[by_doc]
            self._order = by_doc[stable_order(cell)]
        return self._order

    @property
    def bins(self) -> list[list[np.ndarray]]:
        """``bins[g][m]``: the piece indices of group g's micro-step m, in output order."""
        order = self.output_order()
        cells = self.group[order] * self.num_micro_steps + self.micro[order]
        bounds = np.searchsorted(cells, np.arange(self.groups * self.num_micro_steps + 1))
        m = self.num_micro_steps
        return [
            [order[bounds[g * m + k] : bounds[g * m + k + 1]] for k in range(m)]
            for g in range(self.groups)
        ]

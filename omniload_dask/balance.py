"""Cost model and the split of one global batch into per-rank micro-batches.

Cost of a document of L tokens: ``c(L) = linear * L + quadratic * L**2`` (dense layers plus
attention). The split is longest-processing-time first under capacity limits: pieces are taken
in decreasing cost and each goes to the DP group with the lowest cost so far that still has a
micro-batch with room for it (the micro-batch with the least tokens). Example, 2 groups x 1
micro-batch of 8 tokens, piece lengths 6, 5, 3, 2 and cost = L::

    6 -> g0 (0)      5 -> g1 (0)      3 -> g1 (5)      2 -> g0 (6)
    g0 = [6, 2] cost 8, g1 = [5, 3] cost 8: efficiency mean/max = 1.0

If a piece fits nowhere, every group gets one more micro-batch for this step (the step's
``num_micro_steps`` says so), which keeps every per-micro-batch token limit.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from .plan import CostSpec

__all__ = ["Assignment", "CostModel", "assign", "split_documents"]


@dataclass(frozen=True)
class CostModel:
    """``linear * L + quadratic * L**2`` per document; vectorised over numpy arrays."""

    linear: float = 1.0
    quadratic: float = 0.0

    @classmethod
    def from_spec(cls, spec: CostSpec) -> CostModel:
        return cls(linear=spec.linear, quadratic=spec.quadratic)

    def __call__(self, lengths: np.ndarray) -> np.ndarray:
        lengths = np.asarray(lengths, dtype=np.float64)
        return self.linear * lengths + self.quadratic * lengths * lengths


@dataclass(frozen=True)
class Assignment:
    """Pieces per group and micro-batch: ``bins[g][m]`` is a sorted array of piece indices."""

    bins: list[list[np.ndarray]]
    group_costs: np.ndarray
    group_tokens: np.ndarray

    @property
    def num_micro_steps(self) -> int:
        return len(self.bins[0]) if self.bins else 0

    @property
    def efficiency(self) -> float:
        """mean/max of the group costs (1.0 = perfect balance)."""
        peak = float(self.group_costs.max()) if len(self.group_costs) else 0.0
        return float(self.group_costs.mean() / peak) if peak > 0 else 1.0


def split_documents(lengths: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Cut documents into pieces of at most ``seq_len`` tokens.

    Returns ``(doc index, start offset)`` per piece; piece lengths follow from them.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    npieces = np.maximum(1, -(-lengths // seq_len))
    doc = np.repeat(np.arange(len(lengths), dtype=np.int64), npieces)
    first = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(npieces, out=first[1:])
    within = np.arange(len(doc), dtype=np.int64) - np.repeat(first[:-1], npieces)
    return doc, within * seq_len


def assign(
    lengths: np.ndarray, costs: np.ndarray, groups: int, micro_batches: int, capacity: int
) -> Assignment:
    """Split pieces (each at most ``capacity`` tokens) into ``groups`` x micro-batches."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) and int(lengths.max()) > capacity:
        raise ValueError(f"a piece of {int(lengths.max())} tokens exceeds capacity {capacity}")
    micro = micro_batches
    while True:
        result = _try_assign(lengths, costs, groups, micro, capacity)
        if result is not None:
            return result
        micro += 1


def _try_assign(
    lengths: np.ndarray, costs: np.ndarray, groups: int, micro: int, capacity: int
) -> Assignment | None:
    order = np.lexsort((np.arange(len(lengths)), -costs))
    load = np.zeros((groups, micro), dtype=np.int64)
    group_cost = np.zeros(groups, dtype=np.float64)
    members: list[list[list[int]]] = [[[] for _ in range(micro)] for _ in range(groups)]
    heap = [(0.0, g) for g in range(groups)]
    for piece in order.tolist():
        size = int(lengths[piece])
        skipped = []
        placed = False
        while heap:
            cost, g = heapq.heappop(heap)
            row = load[g]
            m = int(row.argmin())
            if row[m] + size <= capacity:
                row[m] += size
                members[g][m].append(piece)
                group_cost[g] = cost + float(costs[piece])
                heapq.heappush(heap, (group_cost[g], g))
                placed = True
                break
            skipped.append((cost, g))
        for item in skipped:
            heapq.heappush(heap, item)
        if not placed:
            return None
    bins = [[np.sort(np.asarray(mb, dtype=np.int64)) for mb in group] for group in members]
    return Assignment(bins=bins, group_costs=group_cost, group_tokens=load.sum(axis=1))

"""Stable orders of small integer keys, the sort the balancer and the recipes need most.

``np.argsort(kind="stable")`` of integers that fit in 16 bits is a radix sort, several times
faster than the merge sort it otherwise is; token counts of pieces, DP groups and micro-batch
cells usually fit::

    stable_order(np.array([3, 1, 3, 0]))  ->  [3, 1, 0, 2]   (ties keep their order)

Every order here is a pure function of the keys (ties by position), as the balancer's
determinism needs: no unstable sort whose ties could depend on the machine's vector units.

Floats >= 0 (group loads) sort as integers: their bits with the lowest ones replaced by the
position are unique keys in the same order, up to loads that differ in those bits only; the
answer is checked there and, where it could differ, the stable sort gives it::

    stable_order_of_floats(np.array([2.5, 0.0, 2.5, 1.0]))  ->  [1, 3, 0, 2]

The recipes' tables also need each value's first use (:func:`first_use`: a block's reads, a
group's (group, read) pairs, numbered in order of first use) and the entries of a choice of
recipes in an array cut by their bounds (:func:`ranges`).
"""

from __future__ import annotations

import numpy as np

__all__ = ["first_use", "ranges", "stable_order", "stable_order_of_floats"]

# numpy 1.25 made ufunc.at fast; with older versions first_use sorts
_FAST_AT = np.lib.NumpyVersion(np.__version__) >= "1.25.0"


def stable_order(values: np.ndarray) -> np.ndarray:
    """``np.argsort(values, kind="stable")`` for integers >= 0; a radix sort where they fit
    in 16 bits."""
    if len(values) > 64 and int(values.max()) < 1 << 16:
        return values.astype(np.uint16).argsort(kind="stable")
    return values.argsort(kind="stable")


def stable_order_of_floats(values: np.ndarray) -> np.ndarray:
    """``np.argsort(values, kind="stable")`` for float64 values >= 0 (module doc): one
    vectorised sort of unique integer keys instead of a merge sort of the floats (about half
    the time on a step's group loads at DP 1,024)."""
    n = len(values)
    if n <= 64 or values.dtype != np.float64:
        return values.argsort(kind="stable")
    bits = values.view(np.int64)  # (ordered as the floats where the sign bit is clear)
    if int(bits.min()) < 0:
        return values.argsort(kind="stable")
    shift = (n - 1).bit_length()
    keys = (bits >> shift << shift) | np.arange(n, dtype=np.int64)
    keys.sort()
    order = keys & ((1 << shift) - 1)
    high = keys >> shift
    near = high[1:] == high[:-1]  # equal up to the position bits: in position order here
    if near.any():
        v = values[order]
        if (near & (v[1:] < v[:-1])).any():  # a smaller value after a larger one
            return values.argsort(kind="stable")
    return order


def first_use(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct ``values`` (integers >= 0) in order of first use, and each value's
    number in that order::

        [7 3 7 5]  ->  used [7 3 5], numbers [0 1 0 2]

    Where the values span few more numbers than there are values (reads of a block, (group,
    read) pairs of a step), each one's first position comes from one ``np.minimum.at``, no
    sort; else from a stable sort.
    """
    values = values.astype(np.int64, copy=False)
    n = len(values)
    if not n:
        return values[:0], values[:0]
    width = int(values.max()) + 1
    if width <= 4 * n + 64 and _FAST_AT:  # few distinct values for their count: no sort
        position = np.arange(n)
        first_at = np.full(width, n, dtype=np.int64)
        np.minimum.at(first_at, values, position)  # each value's first position
        used = values[(first_at[values] == position).nonzero()[0]]  # (in order of use)
        number = np.empty(width, dtype=np.int64)
        number[used] = np.arange(len(used))
        return used, number[values]
    order = stable_order(values)
    ordered = values[order]
    new = np.ones(len(values), dtype=bool)
    new[1:] = ordered[1:] != ordered[:-1]
    first = order[new.nonzero()[0]]  # each distinct value's first position, by value
    by_use = first.argsort(kind="stable")  # (unique: the same order, merged from runs)
    number = np.empty(len(first), dtype=np.int64)
    number[by_use] = np.arange(len(first))
    out = np.empty(len(values), dtype=np.int64)
    out[order] = number[new.cumsum() - 1]
    return values[first[by_use]], out


def ranges(bounds: np.ndarray, rows: np.ndarray) -> tuple[slice | np.ndarray, np.ndarray]:
    """Where the entries of recipes ``rows`` lie in an array cut by ``bounds`` (a slice when
    the rows are consecutive), and their bounds from 0::

        bounds [0 2 3 7]  rows [0 2]  ->  entries [0 1 3 4 5 6]  bounds [0 2 6]
    """
    lo, hi = bounds[rows], bounds[rows + 1]
    if not len(rows):
        return slice(0, 0), np.zeros(1, dtype=np.int64)
    if int(rows[-1]) - int(rows[0]) + 1 == len(rows):  # consecutive: one slice
        first = int(lo[0])
        return slice(first, int(hi[-1])), np.append(lo, hi[-1]).astype(np.int64) - first
    sizes = hi - lo
    out = np.zeros(len(rows) + 1, dtype=np.int64)
    sizes.cumsum(out=out[1:])
    return (lo - out[:-1]).repeat(sizes) + np.arange(out[-1]), out

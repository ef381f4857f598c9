"""Pass 2's last part for several steps at once: what their rounds left, into the room left.

After the rounds over groups (:mod:`.rounds`) each step has pieces that fit no group of their
round; :func:`~.place.fill_room` gives them, step by step, to the room left: best fit by rounds
(by decreasing room, each micro-batch takes the longest piece left that fits), then what fits
no micro-batch whole poured into those with the most room, cut where one is full. Every step
has some (the rounds end when a group has no room for the next piece), and at a few dozen
pieces a step the numpy calls are the cost, so :func:`fill_room_steps` does the same for the
steps of one table side by side (:func:`~.pieces.side_by_side`'s layout: step s's bins in the
s-th block), each step's keys lifted by ``step * BIG`` so that one sort or search serves all
of them and no step's values reach another's::

    step 0 left [5, 2], bins room [4, 6]     step 1 left [3], bins room [3, 0]
    sizes   -5 -2 | BIG - 3         (by step, longest first)
    round 1 bin 1 (6) takes 5, bin 0 (4) takes 2 | bin 2 (3) takes 3

Each step's rounds are those it makes alone: a step that takes nothing in a round changes
nothing, so it would take nothing in a later one either, and the rounds go on while any step
takes a piece. Ties fall as alone (by bin, by piece), and the pour cuts every step's pieces in
one :meth:`~.pieces.Pieces.cut` (its pieces ascending, step by step), so each step gets the
pieces, bins and cuts it gets alone; the parts cut off are appended to the table, step by
step in the order they are cut (the caller gives each step its own).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from omniload_dask.batching.balance.pieces import Bins, Pieces
from omniload_dask.plan.cost import CostFunction

__all__ = ["fill_room_steps", "fill_rooms"]

BIG = (
    1 << 32
)  # above any step's tokens: keys of step s lie in [s * BIG - BIG / 2, s * BIG + BIG / 2)


def fill_rooms(
    pieces: Sequence[Pieces], bins: Sequence[Bins], lefts: Sequence[np.ndarray], groups: int,
    cost: CostFunction,
) -> None:  # fmt: skip
    """:func:`~.place.fill_room` (cuts allowed) of each step (its ``pieces``, ``bins`` of one
    bucket, as many each, and the pieces ``left`` by its rounds), made side by side
    (:func:`fill_room_steps`); each step's tables changed in place as its own call would."""
    n, shape, cat = len(pieces), len(bins[0].room), np.concatenate
    sizes = np.asarray([len(q) for q in pieces], np.int64)
    first = np.concatenate([[0], sizes.cumsum()])
    p = Pieces(
        cat([q.doc for q in pieces]), cat([q.start for q in pieces]),
        cat([q.length for q in pieces]), cat([q.cost for q in pieces]),
        cat([q.bucket for q in pieces]), cat([q.extra for q in pieces]),
        cat([np.where(q.bin >= 0, q.bin + s * shape, -1) for s, q in enumerate(pieces)]),
    )  # fmt: skip
    together = Bins(
        np.asarray([0, n * shape], np.int64), cat([b.capacity for b in bins]),
        cat([b.room for b in bins]), cat([b.load for b in bins]), cat([b.bucket for b in bins]),
        cat([b.group + s * groups for s, b in enumerate(bins)]), cat([b.slot for b in bins]),
    )  # fmt: skip
    left = cat([q + first[s] for s, q in enumerate(lefts)])
    cuts = fill_room_steps(p, together, left, np.arange(n).repeat(sizes), n, cost)
    step = p.bin // shape  # (every piece is placed now)
    order = step.argsort(kind="stable")  # each step's: its own, then its parts cut off
    ends = np.bincount(step, minlength=n).cumsum()
    for s, (q, b) in enumerate(zip(pieces, bins, strict=True)):
        mine = order[(int(ends[s - 1]) if s else 0) : int(ends[s])]
        q.doc, q.start, q.length = p.doc[mine], p.start[mine], p.length[mine]
        q.cost, q.bucket, q.extra = p.cost[mine], p.bucket[mine], p.extra[mine]
        q.bin = p.bin[mine] - s * shape
        q.cuts += int(cuts[s])
        b.room[:] = together.room[s * shape : (s + 1) * shape]
        b.load[:] = together.load[s * shape : (s + 1) * shape]


def fill_room_steps(
    p: Pieces, bins: Bins, left: np.ndarray, piece_step: np.ndarray, steps: int, cost: CostFunction
) -> np.ndarray:
    """:func:`~.place.fill_room` (cuts allowed) of ``steps`` steps side by side (module doc):
    ``left`` the pieces the rounds left, ``piece_step`` each piece's step. Returns each step's
    pieces cut (the step of the parts appended: the step of the piece they were cut from)."""
    shape = len(bins.room) // steps
    bin_step = np.arange(len(bins.room)) // shape
    left = _best_fit(p, bins, left, piece_step, bin_step, steps)
    if not len(left):
        return np.zeros(steps, np.int64)
    return _pour(p, bins, left, piece_step, bin_step, steps, cost)


def _best_fit(
    p: Pieces, bins: Bins, waiting: np.ndarray, piece_step: np.ndarray, bin_step: np.ndarray,
    steps: int,
) -> np.ndarray:  # fmt: skip
    """Place's best fit of every step at once; the pieces that fit no bin of their step."""
    length, room = p.length, bins.room
    waiting = waiting[np.lexsort((waiting, -length[waiting], piece_step[waiting]))]
    sizes = piece_step[waiting] * BIG - length[waiting]  # ascending (each step's longest first)
    every = np.arange(steps)
    while len(waiting):
        w_step = piece_step[waiting]
        w_first = w_step.searchsorted(every, side="left")
        w_end = w_step.searchsorted(every, side="right")
        shortest = np.full(steps, BIG)  # (a step without pieces left: no bin is open)
        has = w_end > w_first
        shortest[has] = length[waiting[w_end[has] - 1]]
        open_ = (room >= shortest[bin_step]).nonzero()[0]
        if not len(open_):
            break
        o_step = bin_step[open_]
        open_ = open_[np.lexsort((-room[open_], o_step))]  # by step, then by decreasing room
        o_step = bin_step[open_]
        # As alone, per step: bin i takes a(i) = i + running max of (fits(i') - i'), the
        # running max kept within the step by lifting each step's values above the last's.
        fits = sizes.searchsorted(o_step * BIG - room[open_], side="left") - w_first[o_step]
        rank = np.arange(len(open_)) - o_step.searchsorted(o_step, side="left")
        lift = o_step * (4 * BIG)
        take = rank + np.maximum.accumulate(fits - rank + lift) - lift
        ok = take < (w_end - w_first)[o_step]
        if not np.count_nonzero(ok):
            break
        taken = w_first[o_step[ok]] + take[ok]
        bins.put(p, waiting[taken], open_[ok])
        keep = np.ones(len(waiting), dtype=bool)
        keep[taken] = False
        waiting, sizes = waiting[keep], sizes[keep]
    return waiting


def _pour(
    p: Pieces, bins: Bins, left: np.ndarray, piece_step: np.ndarray, bin_step: np.ndarray,
    steps: int, cost: CostFunction,
) -> np.ndarray:  # fmt: skip
    """Place's pour of every step with pieces left at once; each step's pieces cut."""
    left = np.sort(left)  # (pieces are step by step: by step, then by index)
    l_step = piece_step[left]
    pouring = np.zeros(steps, dtype=bool)
    pouring[l_step] = True
    open_ = ((bins.room > 0) & pouring[bin_step]).nonzero()[0]
    o_step = bin_step[open_]
    open_ = open_[np.lexsort((-bins.room[open_], o_step))]
    o_step = bin_step[open_]
    # Running token totals within each step (integers: one cumsum less each step's start),
    # lifted by step * BIG.
    bin_end = _within(bins.room[open_], o_step, steps)
    piece_end = _within(p.length[left], l_step, steps)
    total = np.zeros(steps, np.int64)
    ends = l_step.searchsorted(np.arange(steps), side="right")
    total[pouring] = piece_end[ends[pouring] - 1]  # (each step's last: its total)
    bounds = np.sort(np.concatenate([bin_end[bin_end < total[o_step]], piece_end]))
    bounds = bounds[np.append(True, bounds[1:] != bounds[:-1])]
    b_step = bounds // BIG
    starts = np.concatenate([[0], bounds[:-1]])
    opens = np.append(True, b_step[1:] != b_step[:-1])  # a step's first part starts at 0
    starts[opens] = b_step[opens] * BIG
    owner = left[piece_end.searchsorted(starts, side="right")]
    where = open_[bin_end.searchsorted(starts, side="right")]
    first = np.append(True, owner[1:] != owner[:-1])
    parts = np.diff(np.append(first.nonzero()[0], len(owner)))
    cuts = np.bincount(piece_step[owner[first][parts > 1]], minlength=steps)
    bins.add(p, p.cut(owner, bounds - starts, cost), where)
    return cuts


def _within(values: np.ndarray, step: np.ndarray, steps: int) -> np.ndarray:
    """Running sums of integer ``values`` within each step (``step`` ascending), plus
    ``step * BIG``."""
    total = values.cumsum()
    count = np.bincount(step, minlength=steps)
    before = np.concatenate([[0], total])[count.cumsum() - count]
    return total - before[step] + step * BIG

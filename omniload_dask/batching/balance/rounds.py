"""Pass 2's rounds over groups for several steps side by side: the same placements, bit for bit.

:func:`~.placement.pack` runs the rounds of LPT over groups (``_group_rounds``) step by step:
about as many rounds a step as a group gets pieces, each a few dozen numpy calls on arrays of a
few dozen entries, so that at DP 8 and 16 a round costs its calls, not its work. Here the
steps that the planning thread plans together (one bucket, as many micro-batches each, cuts
allowed) run their rounds at once: step s's groups are numbered from ``s * groups`` and its
bins from ``s * groups * micro``, and every step keeps its own queue, rounds and reasons to
stop::

    step 0 queue [6 5 3 2]   step 1 queue [7 4 4]      2 groups each
    round 1: 6 -> g0, 5 -> g1 | 7 -> g2, 4 -> g3       (one set of calls for both)
    round 2: 3 -> g1, 2 -> g0 | 4 -> g3                (each step: its own lightest first)

A step's queue is what it has not placed yet, in order: a round takes its first ``k`` pieces
(as many as it has open groups), and what a round could not place stays at the front, as the
step-by-step rounds keep their misses first (``waiting``). Ties go as they do there: the
groups of a round by load, then by number (a stable sort within each step), a miss's retry by
decreasing room, then by number; every group's load and every bin's room and cost get the
same additions in the same order, so the floats match too (the tests compare every step's
split with its own pass, field by field).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from omniload_dask.batching.balance.pieces import Bins, Pieces, by_cost
from omniload_dask.batching.balance.place import MIN_ROUND

__all__ = ["group_rounds_steps"]


def group_rounds_steps(
    steps: Sequence[tuple[Pieces, Bins]], groups: int, micro: int
) -> list[np.ndarray]:
    """The rounds of LPT over groups (``placement._group_rounds``) of every step, its pieces
    by decreasing cost into its bins (one bucket of ``micro`` micro-batches per group, none
    placed yet), side by side (module doc). Changes each step's pieces' bins and its bins'
    room and cost in place; returns each step's pieces that fit no group of their round, in
    the order its own pass returns them."""
    n = len(steps)
    shape = groups * micro
    sizes = np.asarray([len(p) for p, _ in steps], dtype=np.int64)
    offset = np.zeros(n + 1, dtype=np.int64)
    sizes.cumsum(out=offset[1:])
    length = np.concatenate([p.length for p, _ in steps])
    cost = np.concatenate([p.cost for p, _ in steps])
    room = np.concatenate([b.room for _, b in steps])
    load_of_bin = np.concatenate([b.load for _, b in steps])
    where_of = np.full(len(length), -1, dtype=np.int64)
    load = np.zeros(n * groups)
    group_step = np.arange(n).repeat(groups)
    queue = np.concatenate(
        [by_cost(p, np.arange(len(p))) + offset[s] for s, (p, _) in enumerate(steps)]
    )
    queue_step = np.arange(n).repeat(sizes)
    left: list[np.ndarray] = []  # (step, its pieces left) of the steps done before the end
    done_steps: list[int] = []
    slots = np.arange(micro) * groups

    def bins_of(target: np.ndarray) -> np.ndarray:
        """Each target group's bins, one row per slot (slot-major, as ``Bins`` numbers them)."""
        base = (target // groups) * shape + target % groups
        return base[None, :] + slots[:, None]

    def place(piece: np.ndarray, target: np.ndarray, c: np.ndarray) -> np.ndarray:
        """As ``_group_rounds``' ``place``: each piece into its target group's cheapest bin
        with room (the lowest slot on a tie); which had one."""
        need = length[piece]
        cells = bins_of(target)
        if micro == 1:
            where = cells[0]
            ok = room[where] >= need
        else:
            fit = room[cells] >= need
            if micro == 2:
                load_of = load_of_bin[cells]
                second = fit[1] & (~fit[0] | (load_of[1] < load_of[0]))
                ok = fit[0] | fit[1]
                where = np.where(second, cells[1], cells[0])
            else:
                masked = np.where(fit, load_of_bin[cells], np.inf)
                m = np.zeros(len(piece), dtype=np.int64)
                best = masked[0]
                for j in range(1, micro):
                    better = masked[j] < best
                    m[better] = j
                    best = np.minimum(best, masked[j])
                ok = np.isfinite(best)
                where = cells[m, np.arange(len(piece))]
        if not ok.all():
            at = ok.nonzero()[0]
            piece, target, where, c, need = piece[at], target[at], where[at], c[at], need[at]
        where_of[piece] = where
        room[where] -= need
        load_of_bin[where] += c
        load[target] += c
        return ok

    def stop(quit_: np.ndarray) -> None:
        """Steps ``quit_`` (a mask over steps) are done: their queues are what they left."""
        nonlocal queue, queue_step
        out = quit_[queue_step]
        for s in quit_.nonzero()[0]:
            done_steps.append(int(s))
        left.append(queue[out])
        queue, queue_step = queue[~out], queue_step[~out]

    while len(queue):
        count = np.bincount(queue_step, minlength=n)
        has = count > 0
        first = np.zeros(n, dtype=np.int64)
        count[:-1].cumsum(out=first[1:])
        shortest = np.full(n, np.iinfo(np.int64).max)
        shortest[has] = np.minimum.reduceat(length[queue], first[has])
        by_slot = room.reshape(n, micro, groups)  # (the largest room of each group)
        most = by_slot.max(axis=1).reshape(-1) if micro > 1 else room.copy()
        open_ = ((most >= shortest[group_step]) & has[group_step]).nonzero()[0]
        opened = np.bincount(group_step[open_], minlength=n)
        closed = has & (opened == 0)
        if closed.any():  # no group has room for the step's shortest piece
            stop(closed)
            continue
        # The open groups of each step by load (ties: the lower group), then the first k.
        open_ = open_[np.lexsort((load[open_], group_step[open_]))]
        k = np.minimum(opened, count)
        open_first = np.zeros(n, dtype=np.int64)
        opened[:-1].cumsum(out=open_first[1:])
        o_step = group_step[open_]
        target = open_[np.arange(len(open_)) - open_first[o_step] < k[o_step]]
        at = np.arange(len(queue)) - first[queue_step]  # position in its step's queue
        head_at = (at < k[queue_step]).nonzero()[0]
        head, step_of = queue[head_at], queue_step[head_at]
        rank = at[head_at]
        # As exact LPT: the j-th lightest group only while no heavier than the lighter
        # ones will be with their pieces (rounds of at least MIN_ROUND of the groups).
        before = load[target]
        head_cost = cost[head]
        after = before + head_cost
        shift = 1
        while shift < int(k.max()):  # each step's running minimum (a segmented scan)
            prev = np.full(len(after), np.inf)
            prev[shift:] = after[:-shift]
            after = np.where(rank >= shift, np.minimum(after, prev), after)
            shift *= 2
        late = np.zeros(len(head), dtype=bool)
        late[1:] = (rank[1:] >= 1) & (before[1:] > after[:-1])
        late_at = late.nonzero()[0]
        if len(late_at):
            late_step = step_of[late_at]
            lead = np.ones(len(late_at), dtype=bool)
            lead[1:] = late_step[1:] != late_step[:-1]  # each step's first late group
            late_at, late_step = late_at[lead], late_step[lead]
            cut_to = rank[late_at]
            short = cut_to >= MIN_ROUND * groups
            if short.any():
                k[late_step[short]] = cut_to[short]
                keep = rank < k[step_of]
                head, step_of, rank, target = head[keep], step_of[keep], rank[keep], target[keep]
                head_cost, head_at = head_cost[keep], head_at[keep]
        ok = place(head, target, head_cost)
        if not ok.all():
            # Misses try the round's groups that got nothing, by decreasing room (as the
            # round found them), unless even a step's shortest miss fits none of them.
            bad = (~ok).nonzero()[0]
            bad_step = step_of[bad]
            free = target[bad]
            roomiest = np.full(n, -1, dtype=np.int64)
            np.maximum.at(roomiest, bad_step, most[free])
            shortest_miss = np.full(n, np.iinfo(np.int64).max)
            np.minimum.at(shortest_miss, bad_step, length[head[bad]])
            retry = (shortest_miss <= roomiest)[bad_step]
            if retry.any():
                again_at = bad[retry]
                f = free[retry]
                f = f[np.lexsort((-most[f], bad_step[retry]))]
                again = place(head[again_at], f, head_cost[again_at])
                ok[again_at] = again
            stuck = has & (np.bincount(step_of[ok], minlength=n) == 0)
        else:
            stuck = None
        keep = np.ones(len(queue), dtype=bool)
        keep[head_at[ok]] = False
        queue, queue_step = queue[keep], queue_step[keep]
        if stuck is not None and stuck.any():  # a round that placed nothing ends its step
            stop(stuck)
    out: list[np.ndarray] = [np.zeros(0, np.int64)] * n
    if done_steps:
        rest = np.concatenate(left)
        rest_step = np.searchsorted(offset, rest, side="right") - 1
        for s in done_steps:
            out[s] = rest[rest_step == s] - offset[s]
    for s, (p, bins) in enumerate(steps):
        lo, hi = int(offset[s]), int(offset[s + 1])
        placed = where_of[lo:hi]
        p.bin = np.where(placed >= 0, placed - s * shape, p.bin)
        bins.room[:] = room[s * shape : (s + 1) * shape]
        bins.load[:] = load_of_bin[s * shape : (s + 1) * shape]
    return out

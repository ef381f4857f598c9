"""Pass 2's rounds over groups: pieces by decreasing cost (LPT), one per group a round.

A round gives the next pieces of the queue (:mod:`.queues`), one each, to the groups in
increasing order of load, each into the group's cheapest micro-batch with room (:mod:`.slots`).
As exact LPT would, a round stops before a group that is heavier than a lighter one will be
with its piece (:mod:`.lpt`). A piece that does not fit its group tries the groups of the
round that got nothing, by decreasing room; what still misses waits at the front of the
queue. A step's rounds end when no group has room for its shortest piece left, or when a
round places nothing; what is left goes to best fit (:mod:`.place`)::

    2 groups x 1 micro-batch of 8 tokens, cost = L, queue 6 5 3 2
    round 1: 6 -> g0, 5 -> g1           round 2: 3 -> g1 (5), then 2 -> g0 (6 < 5 + 3)

Several steps run side by side (the dealing thread's steps of one bucket and as many
micro-batches): step s's groups are numbered from ``s * groups`` and its bins from
``s * groups * micro``, and every step keeps its own queue, rounds and reasons to stop::

    step 0 queue [6 5 3 2]   step 1 queue [7 4 4]      2 groups each
    round 1: 6 -> g0, 5 -> g1 | 7 -> g2, 4 -> g3       (one set of numpy calls for both)
    round 2: 3 -> g1, 2 -> g0 | 4 -> g3                (each step: its own lightest first)

Ties go the same way alone and side by side: the groups of a round by load, then by number, a
miss's retry by decreasing room, then by number; every group's load and every bin's room and
cost get the same additions in the same order, so a step's placements are those it gets alone,
to the last bit. One step is the case of one; its calls take the shortcuts a single segment
allows (one sort instead of a sort by step and load, a running minimum instead of a
segmented one), which give the same answers.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from omniload_dask.batching.balance.lpt import lpt_cut, lpt_end
from omniload_dask.batching.balance.pieces import Bins, Pieces
from omniload_dask.batching.balance.queues import NO_PIECE, NOT_READ, Queues
from omniload_dask.batching.balance.slots import Slots
from omniload_dask.batching.sorting import stable_order, stable_order_of_floats

__all__ = ["group_rounds"]


def group_rounds(
    pieces: Sequence[Pieces], bins: Sequence[Bins], queues: Sequence[np.ndarray], groups: int,
    micro: int, lo: int = 0, load: np.ndarray | None = None,
) -> list[np.ndarray]:  # fmt: skip
    """The rounds (module doc) of each step's ``queues`` (piece ids by decreasing cost) into
    its bins ``lo:lo + groups * micro`` (one bucket of ``micro`` micro-batches per group),
    steps side by side. ``load``: the groups' loads so far (one step; zero if not given),
    updated in place. Changes the pieces' bins and the bins' room and cost in place;
    returns each step's pieces that fit no group of their round, in queue order."""
    rounds = _Rounds(pieces, bins, queues, groups, micro, lo, load)
    while rounds.queues.going():
        rounds.round()
    return rounds.finish(pieces, bins)


class _Rounds:
    """The rounds of ``n`` steps side by side (module doc): the pieces' lengths, costs and
    bins, the bins' room and cost (and their :class:`~.slots.Slots`), the groups' loads and
    the steps' :class:`~.queues.Queues`. One step works on its own arrays (views, written in
    place); steps side by side on their concatenation, written back by :meth:`finish`."""

    def __init__(
        self, pieces: Sequence[Pieces], bins: Sequence[Bins], queues: Sequence[np.ndarray],
        groups: int, micro: int, lo: int, load: np.ndarray | None,
    ) -> None:  # fmt: skip
        n = self.n = len(pieces)
        self.groups, self.micro = groups, micro
        shape = groups * micro
        if n == 1:  # (views and the step's own arrays: no copies, written in place)
            p, b = pieces[0], bins[0]
            self.length, self.cost, self.bin_of, self.base = p.length, p.cost, p.bin, lo
            self.room, self.bin_load = b.room[lo : lo + shape], b.load[lo : lo + shape]
            queue = queues[0]
            self.offset = np.zeros(2, np.int64)
        else:
            self.offset = np.concatenate([[0], np.cumsum([len(p) for p in pieces])])
            self.length = np.concatenate([p.length for p in pieces])
            self.cost = np.concatenate([p.cost for p in pieces])
            self.bin_of, self.base = np.full(len(self.length), -1, np.int64), 0
            self.room = np.concatenate([b.room for b in bins])
            self.bin_load = np.concatenate([b.load for b in bins])
            queue = np.concatenate([q + self.offset[s] for s, q in enumerate(queues)])
        self.slots = Slots(self.room, self.bin_load, n, groups, micro)
        self.load = np.zeros(n * groups) if load is None else load
        self.group_step = np.arange(n).repeat(groups)
        sizes = np.asarray([len(q) for q in queues], np.int64)
        self.queues = Queues(queue, sizes, self.length)

    def round(self) -> None:
        """One round of every live step (module doc)."""
        most = self.slots.most_room()
        target, k = self._targets(most)
        if not len(target):
            return
        head, head_step, rank = self.queues.heads(target, k)
        head_cost = self.cost[head]
        if self.n == 1:
            kk = lpt_end(self.load[target], head_cost, self.groups)
            if kk < len(head):
                head, target, head_cost = head[:kk], target[:kk], head_cost[:kk]
        else:
            k = lpt_cut(self.load[target], head_cost, head_step, rank, k, self.groups)
            keep = rank < k[head_step]
            if not keep.all():
                head, head_step, target = head[keep], head_step[keep], target[keep]
                head_cost = head_cost[keep]
        ok = self.place(head, target, head_cost)
        missed = not ok.all()
        if missed:
            self._retry(head, head_step, target, head_cost, ok, most)
        self.queues.requeue(head, head_step, ok, k, missed)

    def place(self, piece: np.ndarray, target: np.ndarray, c: np.ndarray) -> np.ndarray:
        """Each piece (of costs ``c``) into its target group's cheapest micro-batch with room
        (:meth:`~.slots.Slots.cheapest`); which had one."""
        need = self.length[piece]
        ok, where = self.slots.cheapest(target, need)
        if not ok.all():
            at = ok.nonzero()[0]  # (one pass over the mask, then takes)
            piece, target, where, c, need = piece[at], target[at], where[at], c[at], need[at]
        self.bin_of[piece] = where + self.base if self.base else where
        self.room[where] -= need
        self.bin_load[where] += c
        self.load[target] += c
        return ok

    def _targets(self, most: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The open groups of each live step (room for its shortest piece left), least loaded
        first, and each step's round size ``k`` (its open groups, at most its pieces left);
        a live step without an open group is done. One step: its targets are its round
        (``k`` is not read)."""
        q = self.queues
        if self.n == 1:
            least = q.shortest_of_one()
            if most.min() >= least:  # every group open
                target = stable_order_of_floats(self.load)
            else:
                open_ = (most >= least).nonzero()[0]
                target = open_[stable_order_of_floats(self.load[open_])]
            if not len(target):
                q.live0 = False
            return target[: q.end0 - q.pos0 + len(q.waiting)], NOT_READ
        left, shortest, step = q.left(), q.shortest(), self.group_step
        open_ = ((most >= shortest[step]) & q.live[step]).nonzero()[0]
        opened = np.bincount(step[open_], minlength=self.n)
        q.live &= opened > 0  # (no group has room for the step's shortest piece)
        # The open groups of each step by load (ties: the lower group), then the first k.
        open_ = open_[np.lexsort((self.load[open_], step[open_]))]
        k = np.minimum(opened, left) * q.live
        first = opened.cumsum() - opened
        return open_[np.arange(len(open_)) - first[step[open_]] < k[step[open_]]], k

    def _retry(
        self, head: np.ndarray, head_step: np.ndarray, target: np.ndarray, c: np.ndarray,
        ok: np.ndarray, most: np.ndarray,
    ) -> None:  # fmt: skip
        """Misses try the round's groups that got nothing, by decreasing room (as the round
        found them: none of them got a piece), unless even a step's shortest miss fits none
        of them, as is usual once the groups fill up. Updates ``ok``."""
        bad = (~ok).nonzero()[0]
        free = target[bad]
        if self.n == 1:
            if int(self.length[head[bad]].min()) > int(most[free].max()):
                return
            room_free = most[free]  # (by decreasing room: a radix sort of 16-bit rooms)
            free = free[stable_order(int(room_free.max()) - room_free)]
            ok[bad] = self.place(head[bad], free, c[bad])
            return
        bad_step = head_step[bad]
        roomiest = np.full(self.n, -1, dtype=np.int64)
        np.maximum.at(roomiest, bad_step, most[free])
        shortest_miss = np.full(self.n, NO_PIECE)
        np.minimum.at(shortest_miss, bad_step, self.length[head[bad]])
        retry = (shortest_miss <= roomiest)[bad_step]
        if retry.any():
            again = bad[retry]
            f = free[retry]
            f = f[np.lexsort((-most[f], bad_step[retry]))]
            ok[again] = self.place(head[again], f, c[again])

    def finish(self, pieces: Sequence[Pieces], bins: Sequence[Bins]) -> list[np.ndarray]:
        """Each step's pieces left (its misses, then its queue); side by side, the bins and
        pieces written back to each step's own tables."""
        rest = self.queues.rest()
        if self.n == 1:
            return rest
        shape = self.groups * self.micro
        for s, (p, b) in enumerate(zip(pieces, bins, strict=True)):
            placed = self.bin_of[int(self.offset[s]) : int(self.offset[s + 1])]
            p.bin = np.where(placed >= 0, placed - s * shape, p.bin)
            b.room[:] = self.room[s * shape : (s + 1) * shape]
            b.load[:] = self.bin_load[s * shape : (s + 1) * shape]
        return [left - self.offset[s] for s, left in enumerate(rest)]

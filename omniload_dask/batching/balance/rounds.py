"""Pass 2's rounds over groups: pieces by decreasing cost (LPT), one per group a round.

A round gives the next pieces of the queue, one each, to the groups in increasing order of
load, each into the group's cheapest micro-batch with room (which also evens the micro-batches
of a rank, what pipeline parallelism waits on). As exact LPT would, a round stops before a
group that is heavier than a lighter one will be with its piece (but never before
``MIN_ROUND`` of the groups have one). A piece that does not fit its group tries the groups of
the round that got nothing, by decreasing room; what still misses waits at the front of the
queue. A step's rounds end when no group has room for its shortest piece left, or when a
round places nothing; what is left goes to best fit (:mod:`.place`)::

    2 groups x 1 micro-batch of 8 tokens, cost = L, queue 6 5 3 2
    round 1: 6 -> g0, 5 -> g1           round 2: 3 -> g1 (5), then 2 -> g0 (6 < 5 + 3)

Several steps run side by side (the planning thread's steps of one bucket and as many
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

from omniload_dask.batching.balance.pieces import Bins, Pieces
from omniload_dask.batching.sorting import stable_order, stable_order_of_floats

__all__ = ["MIN_ROUND", "group_rounds"]

MIN_ROUND = 0.25  # the shortest round of LPT over groups, as a share of the groups
_NONE = np.iinfo(np.int64).max  # the shortest piece of an empty queue
_NOT_READ = np.zeros(0, np.int64)  # one step's round sizes, steps and ranks: not read


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
    while rounds.going():
        rounds.round()
    return rounds.finish(pieces, bins)


class _Rounds:
    """The state of the rounds of ``n`` steps side by side (module doc): the pieces' lengths
    and costs, the bins' room and cost, the groups' loads, and per step the position of its
    queue (``pos`` to ``end``), whether it goes on (``live``) and its misses waiting in front
    of it (``waiting``, of steps ``wait_step``).

    One step keeps its position, end and liveness as Python numbers (``pos0``, ``end0``,
    ``live0``) and its round's size as the length of its targets: a round's bookkeeping is a
    few numbers, and numpy scalars and one-entry arrays would cost more than the numbers'
    arithmetic (a step takes about as many rounds as a group gets pieces).
    """

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
            self.queue = queues[0]
            self.offset = np.zeros(2, np.int64)
        else:
            self.offset = np.concatenate([[0], np.cumsum([len(p) for p in pieces])])
            self.length = np.concatenate([p.length for p in pieces])
            self.cost = np.concatenate([p.cost for p in pieces])
            self.bin_of, self.base = np.full(len(self.length), -1, np.int64), 0
            self.room = np.concatenate([b.room for b in bins])
            self.bin_load = np.concatenate([b.load for b in bins])
            self.queue = np.concatenate([q + self.offset[s] for s, q in enumerate(queues)])
        # Slot-major views of the bins, (step,) slot, group: they follow the tables' changes.
        rows = (micro, groups) if n == 1 else (n, micro, groups)
        self.room_rows, self.load_rows = self.room.reshape(rows), self.bin_load.reshape(rows)
        self.load = np.zeros(n * groups) if load is None else load
        self.group_step = np.arange(n).repeat(groups)
        self.slots = (np.arange(micro) * groups)[:, None]
        sizes = np.asarray([len(q) for q in queues], np.int64)
        self.end = sizes.cumsum()
        self.pos = self.end - sizes
        self.least = self._least()
        self.waiting = self.queue[:0]
        self.wait_step = self.waiting
        self.live = sizes > 0
        self.pos0, self.end0, self.live0 = 0, len(self.queue), len(self.queue) > 0

    def going(self) -> bool:
        """Whether a step has rounds left."""
        return self.live0 if self.n == 1 else bool(self.live.any())

    def _least(self) -> np.ndarray:
        """The shortest piece of each step's queue from each position on (one more entry:
        the shortest of an empty queue)."""
        ordered = self.length[self.queue]
        least = np.empty(len(ordered) + 1, np.int64)
        least[-1] = _NONE
        for lo, hi in zip(self.pos.tolist(), self.end.tolist(), strict=True):
            seg = ordered[lo:hi]
            if (seg[1:] <= seg[:-1]).all():  # by decreasing length: the last is the shortest
                least[lo:hi] = seg[-1:]
            else:
                least[lo:hi] = np.minimum.accumulate(seg[::-1])[::-1]
        return least

    def place(self, piece: np.ndarray, target: np.ndarray, c: np.ndarray) -> np.ndarray:
        """Each piece (of costs ``c``) into its target group's cheapest micro-batch with room
        (the lowest slot on a tie); which had one."""
        need, room, bin_load = self.length[piece], self.room, self.bin_load
        if self.n == 1:  # (slot 0's bin is the group's; a take along the slot axis)
            first = target
        else:  # step s's bins from s * groups * micro (slot j's: groups * j on)
            first = (target // self.groups) * (self.groups * self.micro) + target % self.groups
        if self.micro == 1:
            where = first
            ok = room[where] >= need
        else:
            room_at, load_at = self._slots(target, first)
            if self.micro == 2:  # (as below, in fewer passes)
                fit = room_at >= need
                second = fit[1] & (~fit[0] | (load_at[1] < load_at[0]))
                ok = fit[0] | fit[1]
                where = first + np.where(second, self.groups, 0)
            else:
                masked = np.where(room_at >= need, load_at, np.inf)
                m = np.zeros(len(piece), dtype=np.int64)
                best = masked[0]
                for j in range(1, self.micro):  # the cheapest with room (lowest slot first)
                    better = masked[j] < best
                    m[better] = j
                    best = np.minimum(best, masked[j])
                ok = np.isfinite(best)
                where = first + m * self.groups
        if not ok.all():
            at = ok.nonzero()[0]  # (one pass over the mask, then takes)
            piece, target, where, c, need = piece[at], target[at], where[at], c[at], need[at]
        self.bin_of[piece] = where + self.base if self.base else where
        room[where] -= need
        bin_load[where] += c
        self.load[target] += c
        return ok

    def _slots(self, target: np.ndarray, first: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The room and cost of each target group's bins, one row per slot (one step: a take
        along the slot axis, cheaper than the gather)."""
        if self.n == 1:
            return self.room_rows.take(target, axis=1), self.load_rows.take(target, axis=1)
        at = first[None, :] + self.slots
        return self.room[at], self.bin_load[at]

    def round(self) -> None:
        """One round of every live step (module doc)."""
        most = self._most_room()
        target, k = self._targets(most)
        if not len(target):
            return
        head, head_step, rank = self._heads(target, k)
        head_cost = self.cost[head]
        if self.n == 1:
            kk = _lpt_end(self.load[target], head_cost, self.groups)
            if kk < len(head):
                head, target, head_cost = head[:kk], target[:kk], head_cost[:kk]
        else:
            k = _lpt_cut(self.load[target], head_cost, head_step, rank, k, self.groups)
            keep = rank < k[head_step]
            if not keep.all():
                head, head_step, target = head[keep], head_step[keep], target[keep]
                head_cost = head_cost[keep]
        ok = self.place(head, target, head_cost)
        missed = not ok.all()
        if missed:
            self._retry(head, head_step, target, head_cost, ok, most)
        self._requeue(head, head_step, ok, k, missed)

    def _held(self) -> np.ndarray:
        """Each step's misses waiting (steps side by side)."""
        return np.bincount(self.wait_step, minlength=self.n)

    def _most_room(self) -> np.ndarray:
        """The largest room of each group's micro-batches."""
        if self.micro == 1:
            return self.room.copy()
        rows = self.room_rows
        if self.micro == 2:  # (one pass: cheaper than a reduction over the axis)
            most = np.maximum(rows[..., 0, :], rows[..., 1, :])
        else:
            most = rows.max(axis=-2)
        return most if self.n == 1 else most.reshape(-1)

    def _targets(self, most: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The open groups of each live step (room for its shortest piece left), least loaded
        first, and each step's round size ``k`` (its open groups, at most its pieces left);
        a live step without an open group is done. One step: its targets are its round
        (``k`` is not read)."""
        if self.n == 1:
            pos, waiting = self.pos0, self.waiting
            least = int(self.least[pos])
            if len(waiting):
                least = min(least, int(self.length[waiting].min()))
            if most.min() >= least:  # every group open
                target = stable_order_of_floats(self.load)
            else:
                open_ = (most >= least).nonzero()[0]
                target = open_[stable_order_of_floats(self.load[open_])]
            if not len(target):
                self.live0 = False
            return target[: self.end0 - pos + len(waiting)], _NOT_READ
        left = self.end - self.pos + self._held()
        shortest = np.where(self.pos < self.end, self.least[self.pos], _NONE)
        if len(self.waiting):
            np.minimum.at(shortest, self.wait_step, self.length[self.waiting])
        step = self.group_step
        open_ = ((most >= shortest[step]) & self.live[step]).nonzero()[0]
        opened = np.bincount(step[open_], minlength=self.n)
        self.live &= opened > 0  # (no group has room for the step's shortest piece)
        # The open groups of each step by load (ties: the lower group), then the first k.
        open_ = open_[np.lexsort((self.load[open_], step[open_]))]
        k = np.minimum(opened, left) * self.live
        first = opened.cumsum() - opened
        return open_[np.arange(len(open_)) - first[step[open_]] < k[step[open_]]], k

    def _heads(
        self, target: np.ndarray, k: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each step's next ``k`` pieces (its misses first, then its queue), their steps and
        their ranks in the step's round (one step: as many as its targets; steps and ranks
        not read)."""
        n = self.n
        waiting, wait_step = self.waiting, self.wait_step
        if n == 1:
            kk, pos = len(target), self.pos0
            head = self.queue[pos : pos + max(0, kk - len(waiting))]
            if len(waiting):
                head = np.concatenate([waiting, head])[:kk]
            return head, _NOT_READ, _NOT_READ
        held = np.bincount(wait_step, minlength=n)
        from_queue = np.maximum(k - held, 0)
        total = int(from_queue.sum())
        first = from_queue.cumsum() - from_queue
        at = self.pos.repeat(from_queue) + np.arange(total) - first.repeat(from_queue)
        head, head_step = self.queue[at], np.arange(n).repeat(from_queue)
        if len(waiting):
            w_rank = np.arange(len(waiting)) - (held.cumsum() - held)[wait_step]
            w = w_rank < k[wait_step]
            head = np.concatenate([waiting[w], head])
            head_step = np.concatenate([wait_step[w], head_step])
            by_step = head_step.argsort(kind="stable")  # (each step's misses first)
            head, head_step = head[by_step], head_step[by_step]
        size = np.bincount(head_step, minlength=n)
        rank = np.arange(len(head)) - (size.cumsum() - size)[head_step]
        return head, head_step, rank

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
        shortest_miss = np.full(self.n, _NONE)
        np.minimum.at(shortest_miss, bad_step, self.length[head[bad]])
        retry = (shortest_miss <= roomiest)[bad_step]
        if retry.any():
            again = bad[retry]
            f = free[retry]
            f = f[np.lexsort((-most[f], bad_step[retry]))]
            ok[again] = self.place(head[again], f, c[again])

    def _requeue(
        self, head: np.ndarray, head_step: np.ndarray, ok: np.ndarray, k: np.ndarray,
        missed: bool,
    ) -> None:  # fmt: skip
        """Move each step past the ``k`` pieces of its round (one step: its ``head``), its
        misses waiting in front (``missed``: the round's first try missed some); a step is
        done when nothing is left or when its round placed nothing."""
        if self.n == 1:
            kk, waiting = len(head), self.waiting
            self.pos0 += max(kk - len(waiting), 0)
            if missed:
                self.waiting = np.concatenate([head[~ok], waiting[kk:]])
                if not ok.any():
                    self.live0 = False
            else:
                self.waiting = waiting[kk:]
            if self.pos0 >= self.end0 and not len(self.waiting):
                self.live0 = False
            return
        held = self._held()
        self.pos += np.maximum(k - held, 0)
        w_rank = np.arange(len(self.waiting)) - (held.cumsum() - held)[self.wait_step]
        stay = w_rank >= k[self.wait_step]
        miss = ~ok
        waiting = np.concatenate([head[miss], self.waiting[stay]])
        wait_step = np.concatenate([head_step[miss], self.wait_step[stay]])
        by_step = wait_step.argsort(kind="stable")  # (each step's misses, then the rest)
        self.waiting, self.wait_step = waiting[by_step], wait_step[by_step]
        if missed:  # a round that placed nothing ends its step
            self.live &= np.bincount(head_step[ok], minlength=self.n) > 0
        self.live &= (self.end > self.pos) | (self._held() > 0)

    def finish(self, pieces: Sequence[Pieces], bins: Sequence[Bins]) -> list[np.ndarray]:
        """Each step's pieces left (its misses, then its queue); side by side, the bins and
        pieces written back to each step's own tables."""
        if self.n == 1:
            return [np.concatenate([self.waiting, self.queue[self.pos0 : self.end0]])]
        out = []
        for s in range(self.n):
            mine = self.waiting[self.wait_step == s]
            left = np.concatenate([mine, self.queue[int(self.pos[s]) : int(self.end[s])]])
            out.append(left - self.offset[s])
        shape = self.groups * self.micro
        for s, (p, b) in enumerate(zip(pieces, bins, strict=True)):
            placed = self.bin_of[int(self.offset[s]) : int(self.offset[s + 1])]
            p.bin = np.where(placed >= 0, placed - s * shape, p.bin)
            b.room[:] = self.room[s * shape : (s + 1) * shape]
            b.load[:] = self.bin_load[s * shape : (s + 1) * shape]
        return out


def _lpt_end(before: np.ndarray, head_cost: np.ndarray, groups: int) -> int:
    """Where exact LPT ends one step's round (:func:`_lpt_cut`): the length of the round."""
    after = np.minimum.accumulate(before + head_cost)
    late_at = (before[1:] > after[:-1]).nonzero()[0]
    if len(late_at) and late_at[0] + 1 >= MIN_ROUND * groups:
        return int(late_at[0]) + 1
    return len(before)


def _lpt_cut(
    before: np.ndarray, head_cost: np.ndarray, head_step: np.ndarray, rank: np.ndarray,
    k: np.ndarray, groups: int,
) -> np.ndarray:  # fmt: skip
    """``k`` where exact LPT ends each step's round: piece j goes to the j-th lightest
    group only while that group is no heavier than the lighter ones will be with their
    pieces (rounds of at least ``MIN_ROUND`` of the groups, which stays within a small
    piece of exact LPT). The lighter groups' lowest cost with their pieces is a running
    minimum per step: a segmented scan, doubling its reach each pass (one pass per doubling
    of the longest round, where one step needs a single ``minimum.accumulate``)."""
    after = before + head_cost
    shift = 1
    while shift < int(k.max()):
        prev = np.full(len(after), np.inf)
        prev[shift:] = after[:-shift]
        after = np.where(rank >= shift, np.minimum(after, prev), after)
        shift *= 2
    late = np.zeros(len(head_cost), dtype=bool)
    late[1:] = (rank[1:] >= 1) & (before[1:] > after[:-1])
    late_at = late.nonzero()[0]
    if not len(late_at):
        return k
    late_step = head_step[late_at]
    lead = np.ones(len(late_at), dtype=bool)
    lead[1:] = late_step[1:] != late_step[:-1]  # each step's first late group
    late_at, late_step = late_at[lead], late_step[lead]
    cut_to = rank[late_at]
    short = cut_to >= MIN_ROUND * groups
    if short.any():
        k = k.copy()
        k[late_step[short]] = cut_to[short]
    return k

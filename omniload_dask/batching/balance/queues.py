"""Pass 2's queues: each step's pieces by decreasing cost, its misses waiting in front.

A round (:mod:`.rounds`) takes the next pieces of each step, its misses of earlier rounds
first: as many as the step's round has groups. A piece that fits no group of its round waits
in front of the queue for the next round; a step is done when nothing is left, or when a round
placed nothing of it::

    queue 6 5 3 2, a round of 2 groups: heads 6 5      6 placed, 5 missed
    next round: heads 5 3 (the miss first), then 2

Steps side by side keep their queues in one array (step s's from ``pos[s]`` to ``end[s]``) and
their misses in another, by step (``waiting``, of steps ``wait_step``); a piece's rank in its
step's round comes from the offsets of running sums, not from a loop over steps.

One step keeps its position, end and liveness as Python numbers (``pos0``, ``end0``,
``live0``) and its round's size as the length of its targets: a round's bookkeeping is a few
numbers, and numpy scalars and one-entry arrays would cost more than their arithmetic (a step
takes about as many rounds as a group gets pieces).
"""

from __future__ import annotations

import numpy as np

__all__ = ["NOT_READ", "NO_PIECE", "Queues"]

NO_PIECE = np.iinfo(np.int64).max  # the shortest piece of an empty queue
NOT_READ = np.zeros(0, np.int64)  # one step's round sizes, steps and ranks: not read


class Queues:
    """The queues of ``len(sizes)`` steps side by side (module doc): ``queue`` holds step s's
    ``sizes[s]`` piece ids after those of the steps before it; ``length`` is every piece's
    tokens (by id)."""

    def __init__(self, queue: np.ndarray, sizes: np.ndarray, length: np.ndarray) -> None:
        self.n, self.queue, self.length = len(sizes), queue, length
        self.end = sizes.cumsum()
        self.pos = self.end - sizes
        self.least = self._least()
        self.waiting = queue[:0]
        self.wait_step = self.waiting
        self.live = sizes > 0
        self.pos0, self.end0, self.live0 = 0, len(queue), len(queue) > 0

    def going(self) -> bool:
        """Whether a step has rounds left."""
        return self.live0 if self.n == 1 else bool(self.live.any())

    def _least(self) -> np.ndarray:
        """The shortest piece of each step's queue from each position on (one more entry:
        the shortest of an empty queue)."""
        ordered = self.length[self.queue]
        least = np.empty(len(ordered) + 1, np.int64)
        least[-1] = NO_PIECE
        for lo, hi in zip(self.pos.tolist(), self.end.tolist(), strict=True):
            seg = ordered[lo:hi]
            if (seg[1:] <= seg[:-1]).all():  # by decreasing length: the last is the shortest
                least[lo:hi] = seg[-1:]
            else:
                least[lo:hi] = np.minimum.accumulate(seg[::-1])[::-1]
        return least

    def held(self) -> np.ndarray:
        """Each step's misses waiting (steps side by side)."""
        return np.bincount(self.wait_step, minlength=self.n)

    def shortest_of_one(self) -> int:
        """One step: the shortest of its pieces left, its misses included."""
        least = int(self.least[self.pos0])
        if len(self.waiting):
            least = min(least, int(self.length[self.waiting].min()))
        return least

    def shortest(self) -> np.ndarray:
        """Each step's shortest piece left, its misses included (``NO_PIECE``: none)."""
        shortest = np.where(self.pos < self.end, self.least[self.pos], NO_PIECE)
        if len(self.waiting):
            np.minimum.at(shortest, self.wait_step, self.length[self.waiting])
        return shortest

    def left(self) -> np.ndarray:
        """Each step's pieces left, its misses included (steps side by side)."""
        return self.end - self.pos + self.held()

    def heads(self, target: np.ndarray, k: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each step's next ``k`` pieces (its misses first, then its queue), their steps and
        their ranks in the step's round (one step: as many as its round's ``target`` groups;
        steps and ranks not read)."""
        n = self.n
        waiting, wait_step = self.waiting, self.wait_step
        if n == 1:
            kk, pos = len(target), self.pos0
            head = self.queue[pos : pos + max(0, kk - len(waiting))]
            if len(waiting):
                head = np.concatenate([waiting, head])[:kk]
            return head, NOT_READ, NOT_READ
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

    def requeue(
        self, head: np.ndarray, head_step: np.ndarray, ok: np.ndarray, k: np.ndarray,
        missed: bool,
    ) -> None:  # fmt: skip
        """Move each step past the ``k`` pieces of its round (one step: its ``head``), the
        misses (``ok`` false) waiting in front (``missed``: the round's first try missed
        some); a step is done when nothing is left or when its round placed nothing."""
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
        held = self.held()
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
        self.live &= (self.end > self.pos) | (self.held() > 0)

    def rest(self) -> list[np.ndarray]:
        """Each step's pieces left: its misses, then its queue."""
        if self.n == 1:
            return [np.concatenate([self.waiting, self.queue[self.pos0 : self.end0]])]
        return [
            np.concatenate([
                self.waiting[self.wait_step == s], self.queue[int(self.pos[s]) : int(self.end[s])]
            ])
            for s in range(self.n)
        ]  # fmt: skip

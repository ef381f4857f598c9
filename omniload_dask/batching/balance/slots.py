"""Pass 2's micro-batches of a group, slot by slot: where a round puts a piece.

A group has ``micro`` micro-batches of the bucket (its slots). A round (:mod:`.rounds`) puts
each piece into its group's cheapest micro-batch with room for it, the lower slot on a tie,
which also evens the micro-batches of a rank (what pipeline parallelism waits on)::

    one group, 3 slots: room 2 5 5, cost 9 4 6; a piece of 3 tokens
    room for it: slots 1 and 2; the cheaper: slot 1 (cost 4 < 6)

The bins of steps side by side are numbered step by step, then slot by slot: step s's bin of
slot j for its group g is ``s * groups * micro + j * groups + g`` (g counted within the step),
so each step's bins form a (slot, group) table, and one table of (step, slot, group) holds
them all. The views here follow the room and cost arrays, which the round changes in place.
"""

from __future__ import annotations

import numpy as np

__all__ = ["Slots"]


class Slots:
    """Slot-major views of the room and cost of ``n`` steps' bins (module doc), ``groups``
    groups of ``micro`` micro-batches each."""

    def __init__(self, room: np.ndarray, load: np.ndarray, n: int, groups: int, micro: int) -> None:
        self.n, self.groups, self.micro = n, groups, micro
        rows = (micro, groups) if n == 1 else (n, micro, groups)
        self.room_rows, self.load_rows = room.reshape(rows), load.reshape(rows)
        self.room, self.load = room, load
        self.slots = (np.arange(micro) * groups)[:, None]

    def cheapest(self, target: np.ndarray, need: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For piece i of ``need[i]`` tokens, whether group ``target[i]`` has a micro-batch with
        room for it, and the cheapest such (the lowest slot on a tie; slot 0's where none)."""
        if self.n == 1:  # (slot 0's bin is the group's; a take along the slot axis)
            first = target
        else:  # step s's bins from s * groups * micro (slot j's: groups * j on)
            first = (target // self.groups) * (self.groups * self.micro) + target % self.groups
        if self.micro == 1:
            return self.room[first] >= need, first
        room_at, load_at = self._of(target, first)
        if self.micro == 2:  # (as below, in fewer passes)
            fit = room_at >= need
            second = fit[1] & (~fit[0] | (load_at[1] < load_at[0]))
            return fit[0] | fit[1], first + np.where(second, self.groups, 0)
        masked = np.where(room_at >= need, load_at, np.inf)
        m = np.zeros(len(target), dtype=np.int64)
        best = masked[0]
        for j in range(1, self.micro):  # the cheapest with room (lowest slot first)
            better = masked[j] < best
            m[better] = j
            best = np.minimum(best, masked[j])
        return np.isfinite(best), first + m * self.groups

    def _of(self, target: np.ndarray, first: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The room and cost of each target group's bins, one row per slot (one step: a take
        along the slot axis, cheaper than the gather)."""
        if self.n == 1:
            return self.room_rows.take(target, axis=1), self.load_rows.take(target, axis=1)
        at = first[None, :] + self.slots
        return self.room[at], self.load[at]

    def most_room(self) -> np.ndarray:
        """The largest room of each group's micro-batches (groups numbered across steps)."""
        if self.micro == 1:
            return self.room.copy()
        rows = self.room_rows
        if self.micro == 2:  # (one pass: cheaper than a reduction over the axis)
            most = np.maximum(rows[..., 0, :], rows[..., 1, :])
        else:
            most = rows.max(axis=-2)
        return most if self.n == 1 else most.reshape(-1)

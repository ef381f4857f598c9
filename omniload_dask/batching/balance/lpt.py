"""Where a round of pass 2 ends: exact LPT's rule, but never before ``MIN_ROUND`` of the groups.

A round (:mod:`.rounds`) gives its pieces, by decreasing cost, to its groups in increasing order
of load: piece j to the j-th lightest group. Exact LPT (longest processing time first) would give
each piece to the lightest group *after* the pieces before it, so piece j goes to the j-th
lightest group only while that group is no heavier than a lighter one will be with its piece.
The round ends before the first group that is (a *late* group); its piece waits for the next
round, where the lighter groups take it::

    groups by load before   0  2  3  9        pieces 6 5 3 2
    with their piece        6  7  6 11        lowest so far: 6 6 6 6
    group 3 (load 9) is heavier than group 0 will be (6): late; the round gives 3 pieces

Cutting rounds that short would make one round a piece at the end, where many groups are about
as heavy; a round of at least ``MIN_ROUND`` of the groups stays within a small piece of exact
LPT at a fraction of the rounds. Side by side, each step's round ends at its own late group.
"""

from __future__ import annotations

import numpy as np

__all__ = ["MIN_ROUND", "lpt_cut", "lpt_end"]

MIN_ROUND = 0.25  # the shortest round of LPT over groups, as a share of the groups


def lpt_end(before: np.ndarray, head_cost: np.ndarray, groups: int) -> int:
    """Where exact LPT ends one step's round (module doc): the length of the round, given the
    loads ``before`` of its groups (lightest first) and the costs of their pieces."""
    after = np.minimum.accumulate(before + head_cost)
    late_at = (before[1:] > after[:-1]).nonzero()[0]
    if len(late_at) and late_at[0] + 1 >= MIN_ROUND * groups:
        return int(late_at[0]) + 1
    return len(before)


def lpt_cut(
    before: np.ndarray, head_cost: np.ndarray, head_step: np.ndarray, rank: np.ndarray,
    k: np.ndarray, groups: int,
) -> np.ndarray:  # fmt: skip
    """:func:`lpt_end` of steps side by side: each step's round size ``k``, cut where its round
    ends (a copy where one is cut). Piece i is of step ``head_step[i]`` and rank ``rank[i]``
    in its round (pieces by step, then rank).

    The lighter groups' lowest cost with their pieces is a running minimum per step: a
    segmented scan, doubling its reach each pass (one pass per doubling of the longest round,
    where one step needs a single ``minimum.accumulate``)."""
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

"""Pass 4 of the balancer, for small DP sizes: exchange up to two pieces for up to two.

After the refinement (:mod:`.refine`) a step whose micro-batches are all full of tokens is often
still a few percent from even: a move needs room, a one-for-one swap needs two pieces of about
the same length, and an exchange of one piece for a run of the shortest pieces rarely has the
right cost. An exchange of a *pair* of pieces (or one) for a pair (or one) of another group's
micro-batch of the same bucket finds many more changes of equal tokens and different cost::

    both micro-batches full (8 tokens), cost = L^2
    heavy: 5 + 3          (34)        light: 4 + 2 + 1 + 1   (22)
    no move fits; no swap keeps the tokens (no equal lengths); the runs of the light
    micro-batch's shortest pieces hold 1, 2, 4, 8 tokens: none trades for the 5 or the 3
    exchange {5} for {4, 1}:  heavy 4 + 3 + 1 (26), light 5 + 2 + 1 (30): the step costs 30

Each round takes the halves an exchange can be made of (:mod:`.halves`: nothing, a piece or a
pair of a micro-batch), weighs every exchange between the heaviest groups and the lightest
that keeps the tokens, and makes the best one of each heavy group with a light group of its
own (:mod:`.exchanges`). Rounds repeat while the heaviest group gets lighter, at most
``ROUNDS`` of them; the peak never rises.

The work of a round is bounded: at most ``PAIRS`` heavy groups against as many light ones, and
at most ``PIECES`` pieces of a micro-batch weighed, since the halves of a micro-batch grow
with the square of its pieces. It runs only up to ``POLISH_UP_TO`` groups: there a step's few
groups each hold a large share of it, so evening the heaviest few lifts the whole step; at
thousands of groups a round of ``PAIRS`` pairs would even a few of them while the step waits
on the rest. Its gain is largest where every micro-batch is full and a rank has few of them
(one full micro-batch a rank, as in the head-to-head's steps): there the earlier passes have
the fewest changes to choose from. ``benchmarks/balance.py --compare`` measures what it adds.
"""

from __future__ import annotations

import numpy as np

from omniload_dask.batching.balance.exchanges import (
    PROGRESS,
    TOLERANCE,
    choose,
    exchanges,
    make,
    sides_of,
)
from omniload_dask.batching.balance.halves import halves_of
from omniload_dask.batching.balance.pieces import Bins, Pieces

__all__ = ["POLISH_UP_TO", "polish"]

POLISH_UP_TO = 64  # groups up to which a step is polished (read at each call)
ROUNDS = 4  # rounds at most per step


def polish(p: Pieces, bins: Bins, steps: int, groups: int) -> None:
    """Pass 4 (module doc) of ``steps`` steps side by side (one step: 1), each with its own
    rounds, pairs and reasons to stop: changes ``p.bin`` in place (and ``bins``' room and
    cost)."""
    if groups < 2 or groups > POLISH_UP_TO or not len(p):
        return
    active = np.ones(steps, dtype=bool)
    peak = np.full(steps, np.inf)
    for _ in range(ROUNDS):
        load = np.bincount(bins.group[p.bin], p.cost, steps * groups)
        rows = load.reshape(steps, groups)
        top = rows.max(axis=1)
        mean = rows.sum(axis=1) / groups  # (= rows.mean(axis=1), to the bit)
        even = top - mean <= TOLERANCE * top
        active &= ~((top > peak * (1 - PROGRESS)) | even)
        peak = np.where(active, top, peak)
        if not np.count_nonzero(active):
            return
        active &= _round(p, bins, load, groups, active, mean, top)


def _round(
    p: Pieces, bins: Bins, load: np.ndarray, groups: int, active: np.ndarray, mean: np.ndarray,
    top: np.ndarray,
) -> np.ndarray:  # fmt: skip
    """One round for every active step: each heavy group's best exchange with a light group
    of its step (``mean`` and ``top``: each step's mean and largest group load); which
    steps made one."""
    sides = sides_of(load, groups, active, mean, top)
    halves = halves_of(p, bins, sides.side)
    done = np.zeros(len(active), dtype=bool)
    found = exchanges(bins, load, groups, sides, halves)
    if found is not None:
        heavy, light = choose(*found, bins, groups, sides, halves, done)
        if len(heavy):
            make(p, bins, halves, heavy, light)
    return done

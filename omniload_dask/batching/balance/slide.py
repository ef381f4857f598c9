"""Pass 5 of the balancer, for small DP sizes: slide a cut by a short piece's length.

When every micro-batch is full, an exchange between two groups must keep each one's tokens
exactly, and the pieces at hand rarely allow that (:mod:`.polish` weighs the exchanges of up to
two pieces for two). A document cut between the heavy group and another one gives a finer
handle: moving the cut by ``d`` tokens moves ``d`` of that document across, and a whole short
piece of ``d`` tokens going the other way keeps both micro-batches full::

    cost = L^2, both micro-batches full (10 tokens)
    heavy: doc 7 [0, 7) + 3             (49 + 9 = 58)
    light: doc 7 [7, 9) + 2 + 4 + 2     (4 + 4 + 16 + 4 = 28)
    slide the cut by 2 (the light group's short piece of 2 comes over):
    heavy: doc 7 [0, 5) + 3 + 2         (25 + 9 + 4 = 38)
    light: doc 7 [5, 9) + 4 + 2         (16 + 16 + 4 = 36): the step costs 38, not 58

Each round takes the heaviest group and every document cut between one of its micro-batches and
a micro-batch of another group (the two pieces next to each other in the document). For each
such pair, and each other piece of the other micro-batch shorter than the heavy side's piece, it
weighs the slide by that piece's length. It makes the one that lowers the larger of the two
groups' costs most, if it lowers it below the heavy group's cost before. No piece gets empty,
no micro-batch changes its tokens, a document's pieces stay contiguous and in order, and the
peak never rises. Rounds repeat while that finds something, at most ``ROUNDS`` of them.

It runs only where cuts are allowed (a slide moves a cut), without per-document extra costs
(image encoder terms sit on a document's first piece, which a slide would have to follow), and
up to ``SLIDE_UP_TO`` groups: a round evens the heaviest group alone, which lifts a step of a
few groups but not one of thousands. It pays where long documents are cut across full
micro-batches, one or few a rank: there whole pieces leave the most unevened.
"""

from __future__ import annotations

import numpy as np

from omniload_dask.batching.balance.pieces import Bins, Pieces
from omniload_dask.batching.sorting import stable_order
from omniload_dask.plan.cost import CostFunction

__all__ = ["SLIDE_UP_TO", "slide"]

SLIDE_UP_TO = 64  # groups up to which a step's cuts are slid
ROUNDS = 32  # rounds at most per step
PROGRESS = 1e-5  # a slide must lower its heavy group by this share


def slide(p: Pieces, bins: Bins, steps: int, groups: int, cost: CostFunction) -> None:
    """Pass 5 (module doc) of ``steps`` steps side by side (one step: 1), each with its own
    heaviest group, rounds and reason to stop: changes ``p``'s starts, lengths, costs and
    bins in place (and ``bins``' cost; their room does not change). A step slides only with
    three pieces or more and no extra costs."""
    if groups < 2 or groups > SLIDE_UP_TO or not len(p):
        return
    shape = len(bins.room) // steps
    step_of = p.bin // shape
    eligible = np.bincount(step_of, minlength=steps) >= 3
    eligible &= np.bincount(step_of, p.extra > 0, steps) == 0
    # Neighbours in a document (a's last token right before b's first): a slide keeps them so.
    order = np.lexsort((p.start, p.doc, step_of))
    a, b = order[:-1], order[1:]
    near = (step_of[a] == step_of[b]) & (p.doc[a] == p.doc[b])
    near &= p.start[a] + p.length[a] == p.start[b]
    near &= bins.bucket[p.bin[a]] == bins.bucket[p.bin[b]]
    near &= eligible[step_of[a]]
    a, b = a[near], b[near]
    if not len(a):
        return
    pair_step = step_of[a]  # (a pair's pieces stay in their step's bins)
    active = np.bincount(pair_step, minlength=steps) > 0
    loads = np.bincount(bins.group[p.bin], p.cost, steps * groups)
    for _ in range(ROUNDS):
        if not _slide_once(p, bins, loads, a, b, pair_step, cost, active, groups):
            break
    bins.load = np.bincount(p.bin, p.cost, len(bins.load))


def _slide_once(
    p: Pieces, bins: Bins, loads: np.ndarray, a: np.ndarray, b: np.ndarray,
    pair_step: np.ndarray, cost: CostFunction, active: np.ndarray, groups: int,
) -> bool:  # fmt: skip
    """The best slide of each active step's heaviest group over the neighbours ``a``, ``b``
    (module doc); ``active`` is updated (a step whose heavy group finds none is done). Keeps
    ``loads`` (cost per group) up to date; whether any step slid."""
    steps = len(active)
    heavy = loads.reshape(steps, groups).argmax(axis=1) + np.arange(steps) * groups
    top = loads[heavy]
    in_a = bins.group[p.bin[a]] == heavy[pair_step]
    in_b = bins.group[p.bin[b]] == heavy[pair_step]
    across = (in_a != in_b) & active[pair_step]
    if not np.count_nonzero(across):
        active[:] = False
        return False
    give = np.where(in_a, a, b)[across]  # the heavy group's piece of each pair
    take = np.where(in_a, b, a)[across]  # the other group's piece
    # Every (pair, short piece of the other micro-batch) at once, pairs in order.
    by_bin = stable_order(p.bin)
    first = p.bin[by_bin].searchsorted(np.arange(len(bins.load) + 1))
    where = p.bin[take]
    lo = first[where]
    counts = first[where + 1] - lo
    pair = np.arange(len(take)).repeat(counts)
    shorts = by_bin[(lo - counts.cumsum() + counts)[pair] + np.arange(len(pair))]
    i, j = give[pair], take[pair]
    d = p.length[shorts]
    ok = ((shorts != j) & (d > 0) & (d < p.length[i])).nonzero()[0]
    shorts, d, i, j = shorts[ok], d[ok], i[ok], j[ok]
    step = pair_step[across][pair[ok]]
    other = loads[bins.group[p.bin[j]]]
    both = cost(np.concatenate([p.length[i] - d, p.length[j] + d]))  # (one call for both)
    short_cost = p.cost[shorts]
    new_heavy = top[step] - p.cost[i] + both[: len(i)] + short_cost
    new_other = other - p.cost[j] + both[len(i) :] - short_cost
    worst = np.maximum(new_heavy, new_other)
    # Per step, the first of its best (its entries are in its pairs' order, steps in order).
    bounds = step.searchsorted(np.arange(steps + 1))
    has, starts = bounds[1:] > bounds[:-1], bounds[:-1]
    best = np.full(steps, np.inf)
    if len(worst):
        best[has] = np.minimum.reduceat(worst, starts[has])
    slid = has & active & (best < top * (1 - PROGRESS))
    active &= slid
    if not np.count_nonzero(slid):
        return False
    at = (worst == best[step]).nonzero()[0]
    at = at[step[at].searchsorted(slid.nonzero()[0])]  # (the first of each step's)
    _move(p, bins, loads, i[at], j[at], shorts[at], cost)
    return True


def _move(
    p: Pieces, bins: Bins, loads: np.ndarray, i: np.ndarray, j: np.ndarray, q: np.ndarray,
    cost: CostFunction,
) -> None:  # fmt: skip
    """Slide the cut between each ``i`` and ``j`` by ``q``'s tokens and move ``q`` to ``i``'s
    bin: one slide per step at once (all pieces and groups distinct)."""
    moved = p.length[q]
    after = p.start[i] < p.start[j]  # j takes the last tokens of i (else the first)
    p.start[j[after]] -= moved[after]
    p.start[i[~after]] += moved[~after]
    p.length[i] -= moved
    p.length[j] += moved
    before_i, before_j = p.cost[i].copy(), p.cost[j].copy()
    both = np.asarray(cost(np.concatenate([p.length[i], p.length[j]])), dtype=np.float64)
    p.cost[i], p.cost[j] = both[: len(i)], both[len(i) :]
    hi, gj = bins.group[p.bin[i]], bins.group[p.bin[j]]
    loads[hi] += p.cost[i] - before_i + p.cost[q]
    loads[gj] += p.cost[j] - before_j - p.cost[q]
    p.bin[q] = p.bin[i]  # the short pieces go the other way: both bins keep their tokens

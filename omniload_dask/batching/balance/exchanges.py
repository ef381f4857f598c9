"""Pass 4's exchanges: the sides of a round, the exchanges that even them, one per heavy group.

A round of the polish (:mod:`.polish`) pairs each step's heaviest groups with its lightest
(its *sides*). For every heavy group's micro-batch and light group's micro-batch of the same
bucket it weighs every exchange of a heavy half for a light half (:mod:`.halves`) that keeps
both within their tokens, all pairs of the round at once in numpy: with the light halves
sorted by tokens, those that fit a heavy half are one range of them. Then, heaviest first,
each heavy group takes the exchange that best evens it with a light group that no heavier
group of the round has taken::

    heavy g0 (34), g1 (31); light g2 (22), g3 (25)
    the best exchange of each pair, its larger cost after: g0-g2 30, g0-g3 31, g1-g2 27,
    g1-g3 29; g0 first takes g2 (30), then g1 takes g3 (29): g2 is taken

A micro-batch that had pieces keeps some, and each exchange leaves both of its groups below
the heavy one's cost before: the peak never rises.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from omniload_dask.batching.balance.halves import Halves
from omniload_dask.batching.balance.pieces import Bins, Pieces
from omniload_dask.batching.balance.tables import rebin

__all__ = ["PAIRS", "PROGRESS", "TOLERANCE", "Sides", "choose", "exchanges", "make", "sides_of"]

PAIRS = 8  # heavy groups (and as many light ones) per round
TOLERANCE = 1e-3  # a group within 0.1% of the peak above the mean is even enough
PROGRESS = 1e-5  # an exchange must lower its heavy group by this share
# By the kinds of an exchange's halves (``Halves.kind``: bit 1 all of a micro-batch's pieces,
# bit 2 nothing), at heavy * 4 + light: whether it empties a micro-batch (one side gives all it has
# and gets nothing back).
EMPTIES = np.array(
    [bool((h & 1 and k & 2) or (k & 1 and h & 2)) for h in range(4) for k in range(4)]
)


@dataclass(frozen=True)
class Sides:
    """Who takes part in a round: each group's ``side`` (within its step: its heavy rank,
    heaviest first, then, after the step's ``heavy`` groups, its light rank, lightest first;
    -1: out), and each step's number of ``heavy`` and ``light`` groups."""

    side: np.ndarray
    heavy: np.ndarray
    light: np.ndarray


def sides_of(
    load: np.ndarray, groups: int, active: np.ndarray, mean: np.ndarray, top: np.ndarray
) -> Sides:
    """Each active step's heavy groups (more than the tolerance above its mean, at most
    ``PAIRS`` and half of its groups) and as many light ones (at most ``PAIRS``)."""
    steps = len(active)
    rows = load.reshape(steps, groups)
    above = rows - mean[:, None] > (TOLERANCE * top)[:, None]
    counts = np.where(active, np.minimum(min(PAIRS, groups // 2), above.sum(axis=1)), 0)
    lights = np.where(active, np.minimum(PAIRS, groups - counts), 0)
    order = (-rows).argsort(axis=1, kind="stable")  # per step, heaviest group first
    rank = np.arange(groups)
    at = order + (np.arange(steps) * groups)[:, None]
    side = np.full(steps * groups, -1, np.int64)
    heavy = rank < counts[:, None]
    side[at[heavy]] = np.broadcast_to(rank, at.shape)[heavy]
    light = rank[::-1] < lights[:, None]  # the lightest, lightest first
    side[at[light]] = (counts[:, None] + groups - 1 - rank)[light]
    return Sides(side, counts, lights)


def exchanges(
    bins: Bins, load: np.ndarray, groups: int, sides: Sides, halves: Halves
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Every exchange of a heavy half for a light half of a micro-batch of a light group of
    its step and bucket that keeps both within their tokens, empties no micro-batch and
    leaves both groups below the heavy one's cost: its heavy and light half and the larger
    of the two groups' costs after it (None: no such exchange)."""
    e_bin, e_len, e_cost = halves.bin, halves.tokens, halves.cost
    e_step = bins.group[e_bin] // groups
    is_heavy = sides.side[bins.group[e_bin]] < sides.heavy[e_step]
    hs, ls = is_heavy.nonzero()[0], (~is_heavy).nonzero()[0]
    if not len(hs) or not len(ls):
        return None
    if len(bins.offset) == 2:  # one bucket: the same exchanges, found the other way
        return _by_tokens(bins, load, groups, halves, e_step, hs, ls)
    # The light halves by micro-batch, each by tokens: for a heavy half and a light
    # micro-batch, the halves that keep both within their tokens are one range of them.
    big = int(e_len.max()) + 2
    key = e_bin[ls] * big + e_len[ls]
    by_key = key.argsort(kind="stable")
    ls, key = ls[by_key], key[by_key]
    starts = np.append(True, e_bin[ls][1:] != e_bin[ls][:-1]).nonzero()[0]
    light_bins = e_bin[ls][starts]
    # Every heavy half with every light micro-batch of its step (theirs are one range of
    # ``light_bins``: steps' bins are in step order), of its bucket.
    light_step = bins.group[light_bins] // groups
    lo = light_step.searchsorted(e_step[hs], side="left")
    many = light_step.searchsorted(e_step[hs], side="right") - lo
    hh = hs.repeat(many)
    yy = (lo - (many.cumsum() - many)).repeat(many) + np.arange(len(hh))
    x, y = e_bin[hh], light_bins[yy]
    if len(bins.offset) > 2:
        same = bins.bucket[x] == bins.bucket[y]
        hh, yy, x, y = hh[same], yy[same], x[same], y[same]
    base = y * big
    h_len = e_len[hh]
    lo = key.searchsorted(base + np.maximum(h_len - bins.room[y], 0), side="left")
    hi = key.searchsorted(base + np.minimum(h_len + bins.room[x], big - 1), side="right")
    many = hi - lo
    pair = np.arange(len(hh)).repeat(many)
    col = lo[pair] + np.arange(len(pair)) - (many.cumsum() - many).repeat(many)
    hs, x, y, ls = hh[pair], x[pair], y[pair], ls[col]  # every (heavy half, light half)
    d_cost = e_cost[hs] - e_cost[ls]
    ok = d_cost > 0
    ok &= ~EMPTIES[halves.kind[hs] * 4 + halves.kind[ls]]  # no micro-batch is emptied
    gh, gl = bins.group[x], bins.group[y]
    worst = np.maximum(load[gh] - d_cost, load[gl] + d_cost)
    ok &= worst < load[gh] * (1 - PROGRESS)
    if not np.count_nonzero(ok):
        return None
    return hs[ok], ls[ok], worst[ok]


def _by_tokens(
    bins: Bins, load: np.ndarray, groups: int, halves: Halves, e_step: np.ndarray,
    hs: np.ndarray, ls: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:  # fmt: skip
    """:func:`exchanges` of one bucket, in its order, by a search per heavy half instead of
    one per (heavy half, light micro-batch): the light halves of each step by tokens; a
    heavy half of ``t`` tokens in a micro-batch of room ``r`` weighs those of its step of
    ``t - R`` to ``t + r`` tokens (``R``: the most room of the step's light micro-batches),
    each then kept where it fits its own micro-batch's room. Most pairs of a heavy half and a
    light micro-batch have no exchange that fits (full micro-batches keep their tokens), so
    this weighs far fewer; the exchanges found are the same, put back in the order
    :func:`exchanges` lists them (heavy half, light micro-batch, tokens, light half), which
    decides ties."""
    e_bin, e_len, e_cost = halves.bin, halves.tokens, halves.cost
    room = bins.room
    big = int(e_len.max()) + 2
    key = e_step[ls] * big + e_len[ls]
    by_key = key.argsort(kind="stable")
    ls, key = ls[by_key], key[by_key]
    most = np.zeros(int(e_step.max()) + 1, np.int64)
    np.maximum.at(most, e_step[ls], room[e_bin[ls]])
    h_len, h_step, x = e_len[hs], e_step[hs], e_bin[hs]
    lo = key.searchsorted(h_step * big + np.maximum(h_len - most[h_step], 0), side="left")
    hi = key.searchsorted(h_step * big + np.minimum(h_len + room[x], big - 1), side="right")
    many = hi - lo
    pair = np.arange(len(hs)).repeat(many)
    col = lo[pair] + np.arange(len(pair)) - (many.cumsum() - many).repeat(many)
    h, light = hs[pair], ls[col]
    y = e_bin[light]
    ok = e_len[light] >= e_len[h] - room[y]  # (and at most t + r: the search's upper end)
    d_cost = e_cost[h] - e_cost[light]
    ok &= d_cost > 0
    ok &= ~EMPTIES[halves.kind[h] * 4 + halves.kind[light]]  # no micro-batch is emptied
    gh = bins.group[e_bin[h]]
    worst = np.maximum(load[gh] - d_cost, load[bins.group[y]] + d_cost)
    ok &= worst < load[gh] * (1 - PROGRESS)
    if not np.count_nonzero(ok):
        return None
    h, light, worst, y = h[ok], light[ok], worst[ok], y[ok]
    order = np.lexsort((light, e_len[light], y, h))
    return h[order], light[order], worst[order]


def choose(
    hs: np.ndarray, ls: np.ndarray, worst: np.ndarray, bins: Bins, groups: int, sides: Sides,
    halves: Halves, done: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """Of the exchanges (heavy half ``hs``, light half ``ls``, ``worst`` the larger cost
    after it): the best of each (heavy, light) pair of groups of a step, then per step,
    heaviest first, each heavy group's best with a light group that no heavier group of its
    step took. Marks in ``done`` the steps that got one; returns the exchanges' halves."""
    group_of = bins.group[halves.bin]
    step = group_of[hs] // groups
    nl = sides.light[step]
    pair_of = sides.side[group_of[hs]] * nl + sides.side[group_of[ls]] - sides.heavy[step]
    by_pair = np.lexsort((worst, pair_of, step))  # (ties: the first weighed)
    first = np.ones(len(by_pair), dtype=bool)
    first[1:] = (pair_of[by_pair][1:] != pair_of[by_pair][:-1]) | (
        step[by_pair][1:] != step[by_pair][:-1]
    )
    best = by_pair[first]  # (by step, then pair)
    # Every step at once: a (heavy rank, light rank) table of the best per step; heavy rank
    # k picks the lightest cost its step's untaken light groups give.
    steps = len(done)
    table = np.full((steps, PAIRS, PAIRS), np.inf)
    s_best, pr = step[best], pair_of[best]
    k_best, r_best = pr // nl[best], pr % nl[best]
    table[s_best, k_best, r_best] = worst[best]
    choice = np.full((steps, PAIRS, PAIRS), -1, np.int64)
    choice[s_best, k_best, r_best] = best
    taken = np.zeros((steps, PAIRS), dtype=bool)
    picks = []
    every = np.arange(steps)
    for k in range(int(sides.heavy.max())):  # a light group serves one heavy group a round
        row = np.where(taken, np.inf, table[:, k])
        r = row.argmin(axis=1)  # (ties: the lowest light rank)
        got = np.isfinite(row[every, r]).nonzero()[0]
        taken[got, r[got]] = True
        picks.append(choice[got, k, r[got]])
        done[got] = True
    chosen = np.concatenate(picks) if picks else np.zeros(0, np.int64)
    return hs[chosen], ls[chosen]


def make(p: Pieces, bins: Bins, halves: Halves, heavy: np.ndarray, light: np.ndarray) -> None:
    """Make the exchanges of halves ``heavy[i]`` and ``light[i]``: each half's pieces go to
    the other's micro-batch."""
    new_bin = p.bin.copy()
    for pieces, to in (
        (halves.first[heavy], halves.bin[light]), (halves.second[heavy], halves.bin[light]),
        (halves.first[light], halves.bin[heavy]), (halves.second[light], halves.bin[heavy]),
    ):  # fmt: skip
        new_bin[pieces[pieces >= 0]] = to[pieces >= 0]
    p.bin = new_bin
    rebin(p, bins)

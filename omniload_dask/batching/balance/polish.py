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

Each round pairs the heaviest groups with the lightest; for every heavy group's micro-batch
and light group's micro-batch, it weighs every exchange of at most two pieces for at most two
that keeps both within their tokens (all pairs of the round at once in numpy: the light
halves sorted by tokens, those that fit a heavy half are one range of them), and heaviest
first, each heavy group takes the exchange that best evens it with a light group no heavier
group of the round has taken. A micro-batch that had pieces keeps some, and each exchange
leaves both of its groups below the heavy one's cost before: the peak never rises. Rounds
repeat while the heaviest group gets lighter, at most ``ROUNDS`` of them.

The work of a round is bounded: at most ``PAIRS`` heavy groups against as many light ones, and
at most ``PIECES`` pieces of a micro-batch weighed (spread over its lengths), since the halves
of a micro-batch grow with the square of its pieces. It runs only up to ``POLISH_UP_TO``
groups: there a step's few groups each hold a large share of it, so evening the heaviest few
lifts the whole step; at thousands of groups a round of ``PAIRS`` pairs would even a few of
them while the step waits on the rest. Its gain is largest where every micro-batch is full
and a rank has few of them (one full micro-batch a rank, as in the head-to-head's steps):
there the earlier passes have the fewest changes to choose from. ``benchmarks/balance.py
--compare`` measures what it adds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from omniload_dask.batching.balance.pieces import Bins, Pieces
from omniload_dask.batching.balance.tables import rebin

__all__ = ["POLISH_UP_TO", "polish"]

POLISH_UP_TO = 64  # groups up to which a step is polished
ROUNDS = 4  # rounds at most per step
PAIRS = 8  # heavy groups (and as many light ones) per round
PIECES = 12  # pieces of a micro-batch weighed at most, spread over its lengths
TOLERANCE = 1e-3  # a group within 0.1% of the peak above the mean is even enough
PROGRESS = 1e-5  # an exchange must lower its heavy group by this share
# By the kinds of an exchange's halves (``Halves.kind``: bit 1 all of a micro-batch's pieces,
# bit 2 nothing), at heavy * 4 + light: whether it empties a micro-batch (one side gives all it has
# and gets nothing back).
EMPTIES = np.array(
    [bool((h & 1 and k & 2) or (k & 1 and h & 2)) for h in range(4) for k in range(4)]
)


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
        if not active.any():
            return
        active &= _round(p, bins, load, groups, active, mean, top)


@dataclass(frozen=True)
class Halves:
    """The halves an exchange is made of, of the micro-batches of a round's groups: half i
    takes pieces ``first[i]`` and ``second[i]`` (-1: none) out of micro-batch ``bin[i]``,
    ``tokens`` and ``cost`` theirs; ``kind`` is 1 for a half that is all its micro-batch's
    pieces, 2 for nothing (3: an empty micro-batch's)."""

    bin: np.ndarray
    tokens: np.ndarray
    cost: np.ndarray
    kind: np.ndarray
    first: np.ndarray
    second: np.ndarray


@dataclass(frozen=True)
class Sides:
    """Who takes part in a round: each group's ``side`` (within its step: its heavy rank,
    heaviest first, then, after the step's ``heavy`` groups, its light rank, lightest first;
    -1: out), and each step's number of ``heavy`` and ``light`` groups."""

    side: np.ndarray
    heavy: np.ndarray
    light: np.ndarray


def _halves(p: Pieces, bins: Bins, side: np.ndarray) -> Halves:
    """Per micro-batch of the round's groups (``side >= 0``): nothing, each weighed piece,
    and each pair of them."""
    in_round = side[bins.group] >= 0
    ids = in_round[p.bin].nonzero()[0]
    ids = ids[(p.bin[ids] * (int(p.length.max()) + 1) + p.length[ids]).argsort(kind="stable")]
    b = p.bin[ids]  # by micro-batch, each by increasing length
    first = b.searchsorted(b, side="left")
    held = np.bincount(b, minlength=len(bins.room))
    n = held[b]
    rank = np.arange(len(ids)) - first
    if len(ids) and int(n.max()) > PIECES:  # keep PIECES of a long one, spread over it
        step = (np.maximum(n, PIECES) - 1) / (PIECES - 1)
        keep = (n <= PIECES) | (np.rint(np.rint(rank / step) * step) == rank)
        ids, b = ids[keep], b[keep]
        first = b.searchsorted(b, side="left")
        n = np.bincount(b, minlength=len(bins.room))[b]
        rank = np.arange(len(ids)) - first
    # Each piece's pairs are with the pieces after it in its micro-batch: ``after`` of them,
    # numbered by a repeat and the offsets of a running sum (no loop over micro-batches).
    after = n - 1 - rank
    left = np.arange(len(ids)).repeat(after)
    right = left + 1 + np.arange(len(left)) - (after.cumsum() - after).repeat(after)
    empty = in_round.nonzero()[0]
    a = np.concatenate([np.full(len(empty), -1), ids, ids[left]])
    z = np.concatenate([np.full(len(empty) + len(ids), -1), ids[right]])
    e_bin = np.concatenate([empty, b, b[left]])
    length, cost = np.append(p.length, 0), np.append(p.cost, 0.0)  # (index -1: nothing)
    size = np.concatenate([np.zeros(len(empty), np.int64), np.ones(len(ids), np.int64),
                           np.full(len(left), 2)])  # fmt: skip
    kind = (size == held[e_bin]) + 2 * (size == 0)
    return Halves(e_bin, length[a] + length[z], cost[a] + cost[z], kind, a, z)


def _round(
    p: Pieces, bins: Bins, load: np.ndarray, groups: int, active: np.ndarray, mean: np.ndarray,
    top: np.ndarray,
) -> np.ndarray:  # fmt: skip
    """One round for every active step: each heavy group's best exchange with a light group
    of its step (``mean`` and ``top``: each step's mean and largest group load); which
    steps made one."""
    sides = _sides(load, groups, active, mean, top)
    halves = _halves(p, bins, sides.side)
    done = np.zeros(len(active), dtype=bool)
    found = _exchanges(bins, load, groups, sides, halves)
    if found is not None:
        heavy, light = _choose(*found, bins, groups, sides, halves, done)
        if len(heavy):
            _make(p, bins, halves, heavy, light)
    return done


def _sides(
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


def _exchanges(
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
    if not ok.any():
        return None
    return hs[ok], ls[ok], worst[ok]


def _choose(
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


def _make(p: Pieces, bins: Bins, halves: Halves, heavy: np.ndarray, light: np.ndarray) -> None:
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

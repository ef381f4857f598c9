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
at most ``PIECES`` pieces of a micro-batch weighed (spread over its lengths). It runs only up to
``POLISH_UP_TO`` groups (at thousands, a round would even only a few of them; DP 1,024 plans
as before). In the head-to-head's step shape (one full 8,192-token micro-batch a rank), over
1,000 steps, it lifts the mean efficiency from 0.959 to 0.988 at DP 8 and from 0.947 to 0.990
at DP 16, for about 0.7 and 1.2 ms a step (BENCHMARKS.md, session 24).
"""

from __future__ import annotations

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
# By the kinds of an exchange's halves (``_entries``: bit 1 all of a micro-batch's pieces, bit 2
# nothing), at heavy * 4 + light: whether it empties a micro-batch (one side gives all it has
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


def _entries(p: Pieces, bins: Bins, side: np.ndarray) -> tuple[np.ndarray, ...]:
    """The exchanges' halves of the micro-batches of the round's groups (``side >= 0``):
    per micro-batch, nothing, each weighed piece, and each pair of them. Returns
    ``(bin, tokens, cost, kind, first piece, second piece)`` (-1: none); ``kind`` is 1 for a
    half that is all its micro-batch's pieces, 2 for nothing (3: an empty micro-batch's)."""
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
    after = n - 1 - rank  # pieces after each in its micro-batch: its pairs
    left = np.arange(len(ids)).repeat(after)
    right = left + 1 + np.arange(len(left)) - (after.cumsum() - after).repeat(after)
    empty = in_round.nonzero()[0]
    a = np.concatenate([np.full(len(empty), -1), ids, ids[left]])
    z = np.concatenate([np.full(len(empty) + len(ids), -1), ids[right]])
    e_bin = np.concatenate([empty, b, b[left]])
    length, cost = np.append(p.length, 0), np.append(p.cost, 0.0)  # (index -1: nothing)
    e_len = length[a] + length[z]
    e_cost = cost[a] + cost[z]
    size = np.concatenate([np.zeros(len(empty), np.int64), np.ones(len(ids), np.int64),
                           np.full(len(left), 2)])  # fmt: skip
    kind = (size == held[e_bin]) + 2 * (size == 0)
    return e_bin, e_len, e_cost, kind, a, z


def _round(
    p: Pieces, bins: Bins, load: np.ndarray, groups: int, active: np.ndarray, mean: np.ndarray,
    top: np.ndarray,
) -> np.ndarray:  # fmt: skip
    """One round for every active step: each heavy group's best exchange with a light group
    of its step (``mean`` and ``top``: each step's mean and largest group load); which
    steps made one."""
    steps = len(active)
    rows = load.reshape(steps, groups)
    above = rows - mean[:, None] > (TOLERANCE * top)[:, None]
    counts = np.where(active, np.minimum(min(PAIRS, groups // 2), above.sum(axis=1)), 0)
    lights = np.where(active, np.minimum(PAIRS, groups - counts), 0)
    order = (-rows).argsort(axis=1, kind="stable")  # per step, heaviest group first
    rank = np.arange(groups)
    at = order + (np.arange(steps) * groups)[:, None]
    side = np.full(steps * groups, -1, np.int64)  # per step: heavy rank, then light; -1: out
    heavy = rank < counts[:, None]
    side[at[heavy]] = np.broadcast_to(rank, at.shape)[heavy]
    light = rank[::-1] < lights[:, None]  # the lightest, lightest first
    side[at[light]] = (counts[:, None] + groups - 1 - rank)[light]
    e_bin, e_len, e_cost, e_kind, e_a, e_b = _entries(p, bins, side)
    e_step = bins.group[e_bin] // groups
    e_side = side[bins.group[e_bin]]
    is_heavy = e_side < counts[e_step]
    hs, ls = is_heavy.nonzero()[0], (~is_heavy).nonzero()[0]
    done = np.zeros(steps, dtype=bool)
    if not len(hs) or not len(ls):
        return done
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
    ok &= ~EMPTIES[e_kind[hs] * 4 + e_kind[ls]]  # no micro-batch is emptied
    gh, gl = bins.group[x], bins.group[y]
    worst = np.maximum(load[gh] - d_cost, load[gl] + d_cost)
    ok &= worst < load[gh] * (1 - PROGRESS)
    if not ok.any():
        return done
    hs, ls, worst = hs[ok], ls[ok], worst[ok]
    # The best exchange of each (heavy, light) pair of groups of a step, then per step,
    # heaviest first, each heavy group takes its best with a light group not taken yet.
    step = e_step[hs]
    nl = lights[step]
    pair_of = e_side[hs] * nl + e_side[ls] - counts[step]
    by_pair = np.lexsort((worst, pair_of, step))  # (ties: the first weighed)
    first = np.ones(len(by_pair), dtype=bool)
    first[1:] = (pair_of[by_pair][1:] != pair_of[by_pair][:-1]) | (
        step[by_pair][1:] != step[by_pair][:-1]
    )
    best = by_pair[first]  # (by step, then pair)
    # Heaviest first, each heavy group of a step takes its best exchange with a light group
    # that no heavier group of its step took (every step at once: a table per step).
    table = np.full((steps, PAIRS, PAIRS), np.inf)
    s_best, pr = step[best], pair_of[best]
    k_best, r_best = pr // nl[best], pr % nl[best]
    table[s_best, k_best, r_best] = worst[best]
    choice = np.full((steps, PAIRS, PAIRS), -1, np.int64)
    choice[s_best, k_best, r_best] = best
    taken = np.zeros((steps, PAIRS), dtype=bool)
    picks = []
    every = np.arange(steps)
    for k in range(int(counts.max())):  # a light group serves one heavy group a round
        row = np.where(taken, np.inf, table[:, k])
        r = row.argmin(axis=1)  # (ties: the lowest light rank)
        got = np.isfinite(row[every, r]).nonzero()[0]
        taken[got, r[got]] = True
        picks.append(choice[got, k, r[got]])
        done[got] = True
    chosen = np.concatenate(picks) if picks else np.zeros(0, np.int64)
    if len(chosen):
        i, j = hs[chosen], ls[chosen]
        new_bin = p.bin.copy()
        for pieces, to in ((e_a[i], e_bin[j]), (e_b[i], e_bin[j]), (e_a[j], e_bin[i]),
                           (e_b[j], e_bin[i])):  # fmt: skip
            new_bin[pieces[pieces >= 0]] = to[pieces >= 0]
        p.bin = new_bin
        rebin(p, bins)
    return done

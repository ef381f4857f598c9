"""Pass 3 of the balancer: even the heaviest group against the lightest ones.

When every group is full of tokens, LPT can only give the last pieces to whoever has room, and
only an exchange moves attention cost: a long piece for several short ones of as many tokens.
Each round takes the heaviest group and tries its lightest partners for the move, swap or
exchange of pieces whose cost shift is nearest half their gap::

    both groups full (no room for a move or a one-for-one swap), cost grows faster than L
    heavy: pieces of cost 40 (16 tokens) and 10     light: 4 pieces of cost 5 (4 tokens each)
    gap = 50 - 20 = 30; exchange the 40 for the 4 short pieces: shift 40 - 20 = 20
    loads 30, 40 -> the step costs 40 instead of 50

It works on group totals (a group may hold ``micro_batches * seq_len`` tokens of a bucket); the
groups it changed are packed into micro-batches again (:func:`~.placement.place` with
``redo``). Its work is bounded (``REFINE_BUDGET`` piece pairs per step), so planning time is
too.
"""

from __future__ import annotations

import numpy as np

from omniload_dask.batching.placement import Pieces

__all__ = ["REFINE_BUDGET", "refine_groups"]

REFINE_TOLERANCE = 2e-3  # stop once the heaviest group is within 0.2% of the mean
REFINE_PARTNERS = 4  # lightest groups tried against the heaviest before giving up
REFINE_BUDGET = 3_000_000  # piece pairs the refinement may weigh per global batch (~10 ms)
SWAP_SAMPLE = 96  # pieces of each group weighed for moves and swaps (all, below that)
REFINE_PROGRESS = 1e-4  # a run of moves must lower the heaviest group by this fraction ...
# ... within as many moves as there are groups (each move evens one heavy group), or it stops


def refine_groups(
    p: Pieces, cap: np.ndarray, groups: int, max_moves: int | None = None
) -> np.ndarray:
    """Pass 3: even the heaviest group against the lightest ones; returns the groups changed.

    Works on group totals (a group may hold ``micro_batches * seq_len`` tokens of a bucket);
    the changed groups are packed into micro-batches again afterwards.
    """
    group, length, cost, bucket = p.group, p.length, p.cost, p.bucket
    nb = len(cap)
    load = np.bincount(group, cost, groups)
    tokens = np.bincount(group * nb + bucket, length, groups * nb).astype(np.int64)
    tokens = tokens.reshape(groups, nb)
    touched = np.zeros(groups, dtype=bool)
    ids = np.arange(groups)
    peak, stalled = float(load.max()), 0
    budget = REFINE_BUDGET  # pairs weighed: a deterministic bound on the planning time
    for _ in range(max_moves if max_moves is not None else 8 * groups + 64):
        heavy = int(np.argmax(load))
        if load[heavy] - load.mean() <= REFINE_TOLERANCE * load[heavy]:
            break
        if load[heavy] < peak * (1 - REFINE_PROGRESS):
            peak, stalled = float(load[heavy]), 0
        elif stalled > max(groups, 4):
            break  # tiny gains only: not worth the planning time
        stalled += 1
        mine = np.flatnonzero(group == heavy)
        mine_sample = _spread(cost[mine], SWAP_SAMPLE)  # the same for every partner below
        room_h = np.maximum(cap, tokens[heavy]) - tokens[heavy]
        for light in np.lexsort((ids, load))[:REFINE_PARTNERS].tolist():
            gap = load[heavy] - load[light]
            if gap <= 0:
                break
            room_l = np.maximum(cap, tokens[light]) - tokens[light]
            others = np.flatnonzero(group == light)
            budget -= min(len(mine), SWAP_SAMPLE) * (min(len(others), SWAP_SAMPLE) + 1)
            if budget < 0:
                return touched  # few groups of many small pieces: near even already
            move = _best_move(mine, others, gap, length, cost, bucket, room_h, room_l, mine_sample)
            if move is None:
                continue
            to_light, to_heavy, delta = move
            group[to_light] = light
            group[to_heavy] = heavy
            load[heavy] -= delta
            load[light] += delta
            for src, dst, moved in ((heavy, light, to_light), (light, heavy, to_heavy)):
                np.add.at(tokens[src], bucket[moved], -length[moved])
                np.add.at(tokens[dst], bucket[moved], length[moved])
            touched[[heavy, light]] = True
            break
        else:
            break  # the heaviest group cannot be improved: it sets the step time
    return touched


def _spread(values: np.ndarray, k: int) -> np.ndarray:
    """Positions of at most ``k`` of ``values``, evenly spaced over their sorted order."""
    n = len(values)
    if n <= k:
        return np.arange(n)
    order = np.argsort(values, kind="stable")
    return np.unique(order[np.linspace(0, n - 1, k).round().astype(np.int64)])


def _best_move(
    heavy: np.ndarray,
    light: np.ndarray,
    gap: float,
    length: np.ndarray,
    cost: np.ndarray,
    bucket: np.ndarray,
    room_h: np.ndarray,
    room_l: np.ndarray,
    hs: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, float] | None:
    """The move, swap or exchange between two groups whose cost shift is nearest ``gap / 2``.

    A shift ``delta`` in (0, gap) lowers the pair's larger cost. ``room_*`` are per bucket;
    ``hs``: the positions in ``heavy`` weighed for moves and swaps (its ``_spread``), when the
    caller has them already.
    """
    best: tuple[float, np.ndarray, np.ndarray, float] | None = None
    lh, ch, bh = length[heavy], cost[heavy], bucket[heavy]
    # Moves (the last column: nothing comes back) and one-for-one swaps, among at most
    # SWAP_SAMPLE pieces of each group spread over its range of costs (groups of hundreds of
    # small documents offer many near-equal choices; weighing all pairs cost milliseconds).
    if hs is None:
        hs = _spread(ch, SWAP_SAMPLE)
    ls = _spread(cost[light], SWAP_SAMPLE)
    sub_h, sub_l = heavy[hs], light[ls]
    lhs, chs, bhs = lh[hs], ch[hs], bh[hs]
    lq = np.append(length[sub_l], 0)
    cq = np.append(cost[sub_l], 0.0)
    bq = np.append(bucket[sub_l], -1)
    same = (bhs[:, None] == bq[None, :]) | (bq[None, :] < 0)
    fits_l = lhs[:, None] - np.where(same, lq[None, :], 0) <= room_l[bhs][:, None]
    fits_h = np.where(
        same,
        lq[None, :] - lhs[:, None] <= room_h[bhs][:, None],
        lq[None, :] <= room_h[np.maximum(bq, 0)][None, :],
    )
    delta = chs[:, None] - cq[None, :]
    ok = fits_l & fits_h & (delta > 0) & (delta < gap)
    if ok.any():
        score = np.where(ok, np.abs(gap / 2 - delta), np.inf)
        i, j = np.unravel_index(int(np.argmin(score)), score.shape)
        back = sub_l[j : j + 1] if j < len(sub_l) else sub_l[:0]
        best = (float(score[i, j]), sub_h[i : i + 1], back, float(delta[i, j]))
    # Exchanges: a heavy piece for the light group's shortest pieces of its bucket.
    for b in np.unique(bh).tolist():
        pool = light[bucket[light] == b]
        if not len(pool):
            continue
        pool = pool[np.lexsort((pool, length[pool]))]
        cum_tokens = np.cumsum(length[pool])
        cum_cost = np.cumsum(cost[pool])
        sel = np.flatnonzero(bh == b)
        short = lh[sel] - room_l[b]  # tokens the light group must give back
        k = np.searchsorted(cum_tokens, short, side="left")
        valid = (short > 0) & (k < len(pool))
        k = np.minimum(k, len(pool) - 1)
        d = ch[sel] - cum_cost[k]
        ok = valid & (d > 0) & (d < gap) & (cum_tokens[k] - lh[sel] <= room_h[b])
        if not ok.any():
            continue
        score = np.where(ok, np.abs(gap / 2 - d), np.inf)
        at = int(np.argmin(score))
        if best is None or score[at] < best[0]:
            best = (float(score[at]), heavy[sel[at] : sel[at] + 1], pool[: k[at] + 1], float(d[at]))
    return None if best is None else best[1:]

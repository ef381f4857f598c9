"""Pass 4's halves: what one side of an exchange gives, nothing, one piece or a pair.

An exchange of the polish (:mod:`.polish`) takes up to two pieces out of a heavy group's
micro-batch and up to two out of a light group's, and puts each side's into the other's. A
side of it is a *half*: nothing, one piece, or a pair of pieces of one micro-batch, with their
tokens and cost::

    micro-batch of pieces 4, 2, 1 (cost L^2: 16, 4, 1)
    halves: {} (0 tokens), {1}, {2}, {4}, {1, 2}, {1, 4}, {2, 4} (6 tokens, cost 20)

A micro-batch of n pieces has 1 + n + n(n - 1)/2 halves, so a long one has its ``PIECES``
weighed at most, spread over its lengths. Every half is built at once for all micro-batches of
a round (a repeat and the offsets of running sums, no loop over micro-batches).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from omniload_dask.batching.balance.pieces import Bins, Pieces

__all__ = ["PIECES", "Halves", "halves_of"]

PIECES = 12  # pieces of a micro-batch weighed at most, spread over its lengths


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


def halves_of(p: Pieces, bins: Bins, side: np.ndarray) -> Halves:
    """Per micro-batch of the round's groups (``side >= 0``, by group): nothing, each weighed
    piece, and each pair of them."""
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

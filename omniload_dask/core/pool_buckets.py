"""``batch.pack_pool`` with ``batch.buckets``: the window packed into every bucket at once.

The balancer routes each document of a step to a context bucket by its length (the shortest
bucket without sources that holds it whole) or by its source (a bucket that names it), and
packs every bucket into its own micro-batches (:mod:`omniload_dask.batching.balance.routing`).
So the pooled draw (:mod:`.pool`) routes the window's documents the same way and packs them by
the one-bucket rule, each into its own bucket: first every bucket's head (its oldest documents
of the window within ``HEAD`` of its part of the budget, at least one), then the other
documents, all buckets' together, longest first (ties: mix order); each into its bucket's
micro-batch with the least room that holds it, while the step stays within ``global_tokens``::

    buckets 1k x 2 and 4k x 1 per rank, dp 2; parts of the budget 4k and 8k
    window (mix order)   3.5k 0.6k 0.9k 2k 0.3k 0.8k ... 3k 0.7k ...
    routed               1k bucket: 0.6k 0.9k 0.3k 0.8k 0.7k ...  (4 micro-batches of 1k)
                         4k bucket: 3.5k 2k 3k ...                (2 micro-batches of 4k)
    heads                1k: 0.6k 0.9k 0.3k (within 2k)    4k: 3.5k (the first, at least)
    then                 the rest longest first: 3k, 2k, 0.8k, 0.7k, ... where they fit

A bucket's part (:func:`omniload_dask.plan.parse_batch.pool_budgets`: its share of
``global_tokens``, never more than its micro-batches hold) only sizes its head: the parts add up
to at most the budget and parsing makes each hold a whole document of the bucket's
``seq_len``, so every bucket's head fits (as with one bucket) and is placed. The window's oldest
document leads its bucket, so it is placed every step, each bucket's front moves on by about
half its part a step, and no document waits for ever. The rest may fill any bucket up to its
micro-batches (the budget is the step's, as without the pool); the mixture weights hold as with
one bucket, so a bucket whose micro-batches hold more than the mix's documents of its lengths
stays part empty.

The balancer routes the step's documents as here and spills none (no bucket holds more than
its micro-batches, and a whole document never fits a shorter bucket's ``seq_len``). Where it
must pack a bucket by length it packs it in the order the draw did: the step's documents come
with all the heads first (:func:`.pool.commit`), so ``Documents.head`` counts the heads of all
buckets and each bucket's share of them is its own head
(:func:`omniload_dask.batching.balance.place._fit_decreasing`). What waits is held as with one
bucket (holes behind the cursors), so checkpoints, resume and exactly-once are unchanged.

Pure: no I/O and no Dask.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from omniload_dask.batching.balance import Bucket, route
from omniload_dask.batching.mixing import Mixer, Selection
from omniload_dask.core.pool import best_fit, commit, head_of, lengths_of
from omniload_dask.core.streams import Candidates
from omniload_dask.errors import JobError
from omniload_dask.plan import BatchSpec
from omniload_dask.plan.parse_batch import pool_budgets

__all__ = ["BucketPool", "pack_buckets", "place_buckets"]


@dataclass(frozen=True)
class BucketPool:
    """A step's buckets as the pooled draw packs them: the buckets and pins that route a
    document (as the balancer's), each bucket's micro-batches in the step (``bins``: all
    ranks'), and its part of the token budget (``budgets``)."""

    buckets: tuple[Bucket, ...]
    pinned: dict[int, int]  # source index -> the bucket that names it
    bins: tuple[int, ...]
    budgets: tuple[int, ...]
    budget: int  # the step's tokens (``global_tokens``)

    @classmethod
    def of(cls, batch: BatchSpec, groups: int, names: list[str]) -> BucketPool:
        """The buckets of ``batch`` over ``groups`` DP groups; ``names``: the sources'."""
        specs = batch.context_buckets
        return cls(
            buckets=tuple(Bucket(b.seq_len, b.micro_batches, bool(b.sources)) for b in specs),
            pinned={names.index(n): i for i, b in enumerate(specs) for n in b.sources},
            bins=tuple(groups * b.micro_batches for b in specs),
            budgets=tuple(pool_budgets(specs, batch.global_tokens, groups)),
            budget=batch.global_tokens or sum(groups * b.micro_batches * b.seq_len for b in specs),
        )


def pack_buckets(
    lengths: np.ndarray, sources: np.ndarray, shape: BucketPool
) -> tuple[np.ndarray, np.ndarray]:
    """Which documents of a window (``lengths`` and ``sources``, in mix order) a step
    places, and which are of their bucket's head (module doc). Returns two boolean masks
    (placed, head).

    >>> pool = BucketPool((Bucket(8, 1), Bucket(32, 1)), {}, (2, 1), (16, 32), 48)
    >>> placed, head = pack_buckets(np.array([20, 6, 2, 30, 7, 1]), np.zeros(6, int), pool)
    >>> placed.astype(int).tolist(), head.astype(int).tolist()
    ([1, 1, 1, 0, 1, 1], [1, 1, 1, 0, 0, 0])
    """
    bucket, _ = route(lengths, sources, shape.buckets, shape.pinned)
    head = np.zeros(len(lengths), dtype=bool)
    for b, spec in enumerate(shape.buckets):
        mine = (bucket == b).nonzero()[0]
        if not len(mine):
            continue
        if int(lengths[mine].max()) > spec.seq_len:
            raise JobError(
                f"a whole document of {int(lengths[mine].max())} tokens exceeds its bucket's "
                f"seq_len ({spec.seq_len})"
            )
        head[mine[: head_of(lengths[mine], shape.budgets[b])]] = True
    rooms = [[spec.seq_len] * bins for spec, bins in zip(shape.buckets, shape.bins, strict=True)]
    index = np.arange(len(lengths))
    order = np.lexsort((index, -lengths, ~head))  # the heads first, longest first
    return best_fit(order, lengths, rooms, bucket, shape.budget), head


def place_buckets(
    mixer: Mixer,
    rows: np.ndarray,
    cands: list[Candidates],
    weights: np.ndarray,
    shape: BucketPool,
) -> tuple[Selection, int]:
    """:func:`.pool.place` with buckets: the window's documents the step places, every
    bucket's head first (:func:`.pool.commit`), and how many are of the heads."""
    lengths = lengths_of(rows, cands)
    sources = rows[:, 0] if len(rows) else np.zeros(0, dtype=np.int64)
    placed, head = pack_buckets(lengths, sources, shape)
    return commit(mixer, rows, cands, weights, placed, head)

"""Passes 1 and 2 of several steps in one table: each step's tables are those it makes alone.

``firstpass.pieces_of_steps`` (pass 1 of one-bucket steps) must give every step the pieces,
micro-batches and bound that ``routing.pieces_of`` gives it, and ``room.fill_rooms`` (pass 2's
best fit and pour, side by side) the pieces, bins and cuts that ``place.fill_room`` leaves, to
the last bit: costly pieces cut over several rounds, steps that cut nothing, steps without
documents, documents of no tokens, extra (image) costs and pieces that must be poured.
"""

from __future__ import annotations

import copy

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from omniload_dask.batching.balance.firstpass import pieces_of_steps
from omniload_dask.batching.balance.pieces import Bins, Pieces, by_cost
from omniload_dask.batching.balance.place import fill_room
from omniload_dask.batching.balance.room import fill_rooms
from omniload_dask.batching.balance.rounds import group_rounds
from omniload_dask.batching.balance.routing import Bucket, pieces_of
from omniload_dask.plan.cost import CostModel

COST = CostModel(linear=1.0, quadratic=0.02)
COLUMNS = ("doc", "start", "length", "cost", "bucket", "extra", "bin")


def same_pieces(a: Pieces, b: Pieces) -> None:
    for name in COLUMNS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and np.array_equal(x, y), name
    assert (a.cuts, a.head) == (b.cuts, b.head)


def a_step(rng: np.random.Generator, seq: int, extra: bool):
    """Documents of a step: none, short ones, some longer than ``seq``, a few of no tokens."""
    n = int(rng.integers(0, 30))
    lengths = rng.integers(0, 3 * seq, n) * (rng.random(n) < 0.95)
    costs = rng.random(n) * 50 if extra and n else None
    return lengths.astype(np.int64), costs, int(rng.integers(1, 4))


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1), steps=st.integers(1, 9), groups=st.integers(1, 12),
    micro=st.integers(1, 3), extra=st.booleans(), cut=st.booleans(),
)  # fmt: skip
def test_pass_one_of_steps_is_each_step_alone(seed, steps, groups, micro, extra, cut):
    rng = np.random.default_rng(seed)
    bucket = Bucket(64, micro)
    docs = [a_step(rng, 64, extra) for _ in range(steps)]
    together = pieces_of_steps(docs, bucket, groups, COST, cut)
    for (lengths, x, head), got in zip(docs, together, strict=True):
        alone = pieces_of(lengths, np.zeros(len(lengths), np.int64), [bucket], groups, COST,
                          None, cut, x, head)  # fmt: skip
        same_pieces(got.pieces, alone.pieces)
        assert np.array_equal(got.micro, alone.micro)
        assert (got.spilled, got.bound) == (alone.spilled, alone.bound)


def test_pass_one_cuts_costly_pieces_over_several_rounds():
    # One document costs far more than a group's share: cut, and cut again as the share falls.
    docs = [(np.asarray([60, 3, 2], np.int64), None, 1), (np.full(8, 2, np.int64), None, 1)]
    cost = CostModel(linear=1.0, quadratic=1.0)
    got = pieces_of_steps(docs, Bucket(64, 1), 4, cost, True)
    assert got[0].pieces.cuts > 0 and len(got[0].pieces) > 3
    assert got[1].pieces.cuts == 0 and len(got[1].pieces) == 8  # (under its share: whole)
    for (lengths, _, _), one in zip(docs, got, strict=True):
        alone = pieces_of(lengths, np.zeros(len(lengths), np.int64), [Bucket(64, 1)], 4, cost,
                          None, True, None)  # fmt: skip
        same_pieces(one.pieces, alone.pieces)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(2, 9), groups=st.integers(2, 8),
       micro=st.integers(1, 3))  # fmt: skip
def test_fill_rooms_of_steps_is_each_step_alone(seed, steps, groups, micro):
    rng = np.random.default_rng(seed)
    bucket = Bucket(64, micro)
    docs = []
    for _ in range(steps):  # full steps (most rounds leave pieces to fit or pour)
        lengths = rng.integers(1, 64, int(rng.integers(groups * micro, 6 * groups * micro)))
        docs.append((lengths.astype(np.int64), None, 1))
    routed = pieces_of_steps(docs, bucket, groups, COST, True)
    seq = np.asarray([64], np.int64)
    pieces = [r.pieces for r in routed]
    bins = [Bins.new(seq, r.micro, groups) for r in routed]
    fits = [len(b.room) == len(bins[0].room) for b in bins]
    pieces = [p for p, ok in zip(pieces, fits, strict=True) if ok]
    bins = [b for b, ok in zip(bins, fits, strict=True) if ok]
    queues = [by_cost(p, np.arange(len(p))) for p in pieces]
    lefts = group_rounds(pieces, bins, queues, groups, len(bins[0].room) // groups)
    alone = copy.deepcopy((pieces, bins))
    for p, b, left in zip(*alone, lefts, strict=True):
        fill_room(p, b, left, 0, len(b.room), COST, True)
    fill_rooms(pieces, bins, lefts, groups, COST)
    for p, b, q, c in zip(pieces, bins, *alone, strict=True):
        same_pieces(p, q)
        assert np.array_equal(b.room, c.room) and np.array_equal(b.load, c.load)
        assert (p.bin >= 0).all() and (b.room >= 0).all()

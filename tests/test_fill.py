"""Filling the micro-batches a DP group was left without: moves and cuts, tokens kept."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from omniload_dask.batching.assignment import Assignment
from omniload_dask.batching.balance import Bucket, balance, route
from omniload_dask.batching.fill import fill_empty


def cost(lengths):
    return np.asarray(lengths, dtype=np.float64)


def assignment(cells: list[list[list[int]]], capacity: int = 2048) -> Assignment:
    """``cells[g][m]``: the piece lengths in group g's micro-batch m (each piece a document)."""
    rows = [(g, m, n) for g, micro in enumerate(cells) for m, ns in enumerate(micro) for n in ns]
    g, m, n = (np.asarray(c, dtype=np.int64) for c in zip(*rows, strict=True))
    micro = len(cells[0])
    return Assignment(
        doc=np.arange(len(n)),
        start=np.zeros(len(n), np.int64),
        length=n,
        cost=n.astype(np.float64),
        group=g,
        micro=m,
        micro_capacity=np.full(micro, capacity),
        micro_bucket=np.zeros(micro, np.int64),
        groups=len(cells),
    )


def test_worked_example_from_the_docstring():
    plan = assignment([[[2048], [2048], [2048], [2048]], [[1500, 400], [1800], [], []]])
    out = fill_empty(plan, [Bucket(2048, 4)], cost, cut=True)
    assert out.micro_tokens.tolist() == [[2048] * 4, [400, 900, 1500, 900]]
    assert out.cuts == 1
    tail = np.flatnonzero((out.group == 1) & (out.micro == 3))
    assert out.start[tail].tolist() == [900] and out.length[tail].tolist() == [900]


def test_without_cutting_only_whole_pieces_move():
    plan = assignment([[[100, 100], [100]], [[300], []]])
    out = fill_empty(plan, [Bucket(2048, 2)], cost, cut=False)
    # group 1 has one piece: group 0 (the costliest) gives a whole one of its two
    assert out.micro_tokens.tolist() == [[100, 100], [300, 100]] and out.cuts == 0
    stuck = fill_empty(assignment([[[100], [100]], [[300], []]]), [Bucket(2048, 2)], cost, False)
    assert stuck.micro_tokens.tolist() == [[100, 100], [300, 0]]  # nothing it may give


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    groups=st.integers(1, 4),
    docs=st.integers(1, 30),
    cut=st.booleans(),
)
def test_every_token_stays_once_within_limits_and_no_micro_batch_is_left_empty(
    seed, groups, docs, cut
):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 900, docs) ** rng.integers(1, 3, docs) // 7 + 1
    buckets = [Bucket(128, 4), Bucket(1024, 2), Bucket(1024, 1, pinned=True)]
    sources = rng.integers(0, 3, docs)
    bucket, by_length = route(lengths, sources, buckets, {2: 2})
    plan = balance(lengths, bucket, buckets, groups, cost, by_length=by_length, cut=cut)
    out = fill_empty(plan, buckets, cost, cut)
    # every token of every document, once
    for d in range(docs):
        mine = np.flatnonzero(out.doc == d)
        spans = sorted(zip(out.start[mine].tolist(), out.length[mine].tolist(), strict=True))
        assert spans[0][0] == 0
        assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(spans))
        assert spans[-1][0] + spans[-1][1] == lengths[d]
    assert (out.micro_tokens <= out.micro_capacity[None, :]).all()
    assert np.isclose(out.cost.sum(), out.length.sum())  # cost = L here: nothing lost
    pinned_doc = sources[out.doc] == 2  # pinned documents never leave their bucket
    assert (out.micro_bucket[out.micro[pinned_doc]] == 2).all()
    if cut and lengths[sources != 2].sum() >= 2 * groups * out.num_micro_steps:
        assert (out.micro_tokens > 0).all()

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from omniload_dask.balance import CostModel, assign, split_documents


def test_split_documents_cuts_into_seq_len_pieces():
    doc, start = split_documents(np.array([5, 10, 11, 1]), 5)
    assert doc.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert start.tolist() == [0, 0, 5, 0, 5, 10, 0]


def test_worked_example_from_the_docstring():
    lengths = np.array([6, 5, 3, 2])
    plan = assign(lengths, lengths.astype(float), 2, 1, 8)
    assert plan.efficiency == 1.0
    assert sorted(map(int, plan.group_tokens)) == [8, 8]


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 64), min_size=0, max_size=200),
    groups=st.integers(1, 8),
    micro=st.integers(1, 4),
)
def test_assign_keeps_every_piece_once_and_respects_capacity(lengths, groups, micro):
    lengths = np.asarray(lengths, dtype=np.int64)
    cost = CostModel(1.0, 0.01)
    plan = assign(lengths, cost(lengths), groups, micro, 64)
    placed = np.concatenate([mb for g in plan.bins for mb in g]) if len(lengths) else []
    assert sorted(np.asarray(placed).tolist()) == list(range(len(lengths)))
    assert plan.num_micro_steps >= micro
    for g in plan.bins:
        assert len(g) == plan.num_micro_steps
        for mb in g:
            assert int(lengths[mb].sum()) <= 64
    again = assign(lengths, cost(lengths), groups, micro, 64)
    assert all(
        np.array_equal(x, y)
        for a, b in zip(plan.bins, again.bins, strict=True)
        for x, y in zip(a, b, strict=True)
    )

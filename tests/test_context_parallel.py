"""Zigzag context-parallel slices: complete, disjoint, equal work, right positions and labels."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from omniload_dask.batching.context_parallel import slice_micro_batch, zigzag_index
from omniload_dask.batching.formats import IGNORE_INDEX, Recipe, Shard, build


def micro_batch(lengths: list[int], pad_to: int | None = None) -> dict:
    tokens = np.arange(sum(lengths), dtype=np.uint32) + 1000
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    shard = Shard(0, tokens, offsets, np.arange(len(lengths), dtype=np.int64))
    pieces = np.array([[0, 0, d, 0, n] for d, n in enumerate(lengths)], dtype=np.int64)
    seq = pad_to or max(1, sum(lengths))
    recipe = Recipe(
        0, 0, 1, pieces.reshape(-1, 5), seq, pad_to_seq_len=pad_to is not None, pad_id=7
    )
    return build(recipe, [shard]).micro_batches[0]


def work(positions: np.ndarray) -> int:
    """Causal attention work of query tokens at these positions (keys attended)."""
    return int((positions + 1).sum())


def test_worked_example_from_the_docstring():
    mb = micro_batch([8])
    a, b = (slice_micro_batch(mb, 2, c) for c in (0, 1))
    assert a["position_ids"].tolist() == [0, 1, 6, 7]
    assert b["position_ids"].tolist() == [2, 3, 4, 5]
    assert work(a["position_ids"]) == work(b["position_ids"]) == 18
    assert a["labels"].tolist() == [
        1001,
        1002,
        1007,
        IGNORE_INDEX,
    ]  # next tokens, as before slicing
    assert a["cu_seqlens"].tolist() == [0, 4] and a["cu_seqlens_global"].tolist() == [0, 8]
    assert (a["cp_rank"], a["cp_size"], a["num_tokens"]) == (0, 2, 4)


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 300), min_size=1, max_size=12), cp=st.integers(1, 5))
def test_slices_partition_every_document_with_equal_work(lengths, cp):
    mb = micro_batch(lengths)
    cu = mb["cu_seqlens"]
    seen = np.zeros(int(cu[-1]), dtype=np.int64)
    works = np.zeros((cp, len(lengths)))
    for c in range(cp):
        index, local = zigzag_index(cu, cp, c)
        seen[index] += 1
        s = slice_micro_batch(mb, cp, c)
        assert np.array_equal(s["input_ids"], mb["input_ids"][index])
        assert np.array_equal(s["labels"], mb["labels"][index])
        assert np.array_equal(s["position_ids"], mb["position_ids"][index])
        assert np.array_equal(np.diff(s["cu_seqlens"]), local)
        for d in range(len(lengths)):
            works[c, d] = work(s["position_ids"][s["cu_seqlens"][d] : s["cu_seqlens"][d + 1]])
    assert np.all(seen == 1)  # every token in exactly one slice
    for d, n in enumerate(lengths):
        if n % (2 * cp) == 0:
            assert np.all(works[:, d] == works[0, d])
        assert works[:, d].max() - works[:, d].min() <= 2 * n  # a boundary token at most


def test_padded_micro_batches_give_every_peer_the_same_width():
    mb = micro_batch([5, 3, 9], pad_to=24)
    slices = [slice_micro_batch(mb, 3, c) for c in range(3)]
    assert {len(s["input_ids"]) for s in slices} == {8}
    for s in slices:
        n = s["num_tokens"]
        assert np.all(s["input_ids"][n:] == 7) and np.all(s["labels"][n:] == IGNORE_INDEX)

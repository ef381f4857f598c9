from __future__ import annotations

import itertools
import pickle

import numpy as np

from omniload_dask.batching.formats import IGNORE_INDEX, Recipe, RecipeTable, Shard, build
from omniload_dask.batching.wire import expand


def shard(source: int, docs: list[list[int]]) -> Shard:
    offsets = np.concatenate([[0], np.cumsum([len(d) for d in docs])]).astype(np.int64)
    tokens = np.asarray([t for d in docs for t in d], dtype=np.uint32)
    return Shard(
        source=source,
        tokens=tokens,
        offsets=offsets,
        sample_ids=np.arange(len(docs), dtype=np.int64) + 100 * source,
    )


def test_packed_layout_matches_the_worked_example():
    s = shard(0, [[5, 6, 7], [8, 9]])
    pieces = np.array([[0, 0, 0, 0, 3], [0, 0, 1, 0, 2]])
    mb = build(
        Recipe(step=3, group=1, num_micro_steps=1, pieces=pieces, seq_len=8, slot_epochs=(2,)), [s]
    ).micro_batches[0]
    assert mb["input_ids"].tolist() == [5, 6, 7, 8, 9]
    assert mb["labels"].tolist() == [6, 7, IGNORE_INDEX, 9, IGNORE_INDEX]
    assert mb["position_ids"].tolist() == [0, 1, 2, 0, 1]
    assert mb["cu_seqlens"].tolist() == [0, 3, 5] and mb["cu_seqlens"].dtype == np.int32
    assert mb["max_seqlen"] == 3 and mb["num_tokens"] == 5
    assert mb["doc_id"].tolist() == [0, 1] and mb["doc_epoch"].tolist() == [2, 2]
    assert (mb["step"], mb["micro_step"], mb["num_micro_steps"], mb["dp_rank"]) == (3, 0, 1, 1)
    assert mb["input_ids"].dtype == np.int64


def test_pieces_of_a_split_document_and_padding():
    a, b = shard(0, [[1, 2, 3, 4, 5, 6]]), shard(1, [[7, 8]])
    pieces = np.array([[0, 0, 0, 0, 4], [1, 0, 0, 4, 6], [1, 1, 0, 0, 2]])
    batch = build(
        Recipe(
            step=0,
            group=0,
            num_micro_steps=2,
            pieces=pieces,
            seq_len=4,
            pad_to_seq_len=True,
            pad_id=99,
        ),
        [a, b],
    )
    first, second = batch.micro_batches
    assert first["input_ids"].tolist() == [1, 2, 3, 4]
    assert second["input_ids"].tolist() == [5, 6, 7, 8]
    assert second["doc_offset"].tolist() == [4, 0]
    assert second["doc_source"].tolist() == [0, 1]
    assert second["doc_id"].tolist() == [0, 100]
    empty = build(
        Recipe(
            step=0,
            group=0,
            num_micro_steps=1,
            pieces=np.zeros((0, 5), int),
            seq_len=4,
            pad_to_seq_len=True,
            pad_id=99,
        ),
        [],
    )
    mb = empty.micro_batches[0]
    assert mb["input_ids"].tolist() == [99] * 4 and mb["num_tokens"] == 0
    assert mb["labels"].tolist() == [IGNORE_INDEX] * 4


def test_wire_form_expands_to_exactly_the_full_layout():
    # documents cut across micro-batches, padding, and an empty micro-batch
    a, b = shard(0, [[1, 2, 3, 4, 5, 6], [40, 41, 42]]), shard(1, [[7, 8], [9]])
    pieces = np.array(
        [[0, 0, 0, 0, 4], [1, 0, 0, 4, 6], [1, 1, 0, 0, 2], [1, 0, 1, 0, 1], [3, 1, 1, 0, 1]]
    )
    for pad in (False, True):
        recipe = Recipe(
            step=2, group=0, num_micro_steps=4, pieces=pieces, seq_len=6, pad_to_seq_len=pad
        )
        full = build(recipe, [a, b]).micro_batches
        wire = build(recipe, [a, b], wire=True).micro_batches
        for f, w in zip(full, wire, strict=True):
            assert "labels" not in w and "position_ids" not in w
            assert w["input_ids"].dtype == np.uint32
            assert w["input_ids"].nbytes * 2 == f["input_ids"].nbytes
            e = expand(w)
            assert set(e) == set(f)
            for key, value in f.items():
                if isinstance(value, np.ndarray):
                    assert e[key].dtype == value.dtype, key
                    assert np.array_equal(e[key], value), key
                else:
                    assert e[key] == value, key
            assert expand(f) is f  # a full micro-batch is left alone


def test_dask_counts_the_arrays_of_shards_and_built_batches():
    """Workers account memory with ``dask.sizeof``: the cluster registers our classes' sizes."""
    from dask.sizeof import sizeof

    import omniload_dask.cluster.sizeof  # noqa: F401  (what workers and the scheduler import)

    s = shard(0, [list(range(1000)), list(range(500))])
    pieces = np.array([[0, 0, 0, 0, 1000], [0, 0, 1, 0, 500]])
    batch = build(Recipe(step=0, group=0, num_micro_steps=1, pieces=pieces, seq_len=2048), [s])
    arrays = sum(v.nbytes for v in batch.micro_batches[0].values() if isinstance(v, np.ndarray))
    assert arrays > 1500 * 8 * 3  # input_ids, labels and position_ids are int64
    assert sizeof(batch) == arrays + 256
    assert sizeof(s) == s.tokens.nbytes + s.offsets.nbytes + s.sample_ids.nbytes + 256


def test_a_recipe_table_pickles_as_one_frame_and_comes_back_the_same():
    """A block's construction task carries a table per step; Dask sends every out-of-band
    buffer as a frame of its own, so a table pickles its arrays in-band, as one byte string."""
    rng = np.random.default_rng(3)
    for groups, pieces in ((4, 11), (1, 0), (0, 0)):
        table = RecipeTable(
            step=9,
            groups=np.arange(groups, dtype=np.int64),
            piece_bounds=np.linspace(0, pieces, groups + 1).astype(np.int64),
            pieces=rng.integers(0, 1 << 40, (pieces, 5)),
            slot_bounds=np.arange(groups + 1, dtype=np.int64),
            slot_reads=np.arange(groups, dtype=np.int64)[::-1],  # not contiguous
            slot_epochs=rng.integers(0, 3, groups).astype(np.int32),
            num_micro_steps=2,
            seq_len=64,
            micro_seq_lens=(32, 64),
        )
        buffers: list[pickle.PickleBuffer] = []
        again = pickle.loads(pickle.dumps(table, protocol=5, buffer_callback=buffers.append))
        assert buffers == []  # nothing out of band
        assert type(again) is RecipeTable
        for name in RecipeTable.ARRAYS:
            mine, theirs = getattr(again, name), getattr(table, name)
            assert mine.dtype == theirs.dtype and mine.shape == theirs.shape, name
            assert np.array_equal(mine, theirs), name
            assert mine.flags.writeable, name
        assert (again.step, again.num_micro_steps, again.seq_len) == (9, 2, 64)
        assert again.micro_seq_lens == (32, 64)
        if groups:
            assert again.recipe(0).slot_epochs == table.recipe(0).slot_epochs


def test_a_recipe_table_selects_any_groups_with_their_reads_numbered_by_first_use():
    rng = np.random.default_rng(5)
    n = 12
    piece_bounds = np.concatenate([[0], np.cumsum(rng.integers(0, 5, n))]).astype(np.int64)
    slot_bounds = np.concatenate([[0], np.cumsum(rng.integers(1, 4, n))]).astype(np.int64)
    table = RecipeTable(
        step=7,
        groups=np.arange(n, dtype=np.int64),
        piece_bounds=piece_bounds,
        pieces=rng.integers(0, 50, (int(piece_bounds[-1]), 5)),
        slot_bounds=slot_bounds,
        slot_reads=rng.integers(0, 9, int(slot_bounds[-1])),
        slot_epochs=rng.integers(0, 3, int(slot_bounds[-1])),
        num_micro_steps=1,
        seq_len=64,
    )
    for rows in (np.arange(3, 9), np.array([0, 2, 7, 11]), np.arange(n), np.zeros(0, np.int64)):
        block, used = table.select_reads(rows)
        assert block.groups.tolist() == rows.tolist()
        first_use = dict.fromkeys(t for r in rows for t in table.reads_of(r).tolist())
        assert used.tolist() == list(first_use)  # each read once, in order of first use
        assert np.array_equal(table.used_reads(rows), used)
        for j, r in enumerate(rows.tolist()):
            mine, whole = block.recipe(j), table.recipe(r)
            assert np.array_equal(mine.pieces, whole.pieces)
            assert mine.slot_epochs == whole.slot_epochs
            assert used[block.reads_of(j)].tolist() == table.reads_of(r).tolist()

    # A step's blocks in one pass: each run of rows as select_reads gives it alone.
    for edges in ([0, 4, 8, 12], [0, 12], [0, 3, 3, 10, 12], [2, 5, 11]):
        runs = table.select_runs(np.asarray(edges))
        alone = [
            table.select_reads(np.arange(lo, hi)) for lo, hi in itertools.pairwise(edges) if hi > lo
        ]
        assert len(runs) == len(alone)
        for (block, used), (block_alone, used_alone) in zip(runs, alone, strict=True):
            assert np.array_equal(used, used_alone)
            for name in ("groups", "piece_bounds", "pieces", "slot_bounds", "slot_reads"):
                assert np.array_equal(getattr(block, name), getattr(block_alone, name)), name
            assert np.array_equal(block.slot_epochs, block_alone.slot_epochs)


def test_a_built_block_carries_its_size_and_dask_reports_it_without_walking_the_parts():
    """A construction task works a block's size out once (``BatchBlock.nbytes``): Dask's
    ``sizeof`` then reports it, equal to walking every part, and a copy keeps it."""
    from dask.sizeof import sizeof

    from omniload_dask.batching.block import BatchBlock
    from omniload_dask.cluster.sizeof import block_bytes
    from omniload_dask.cluster.tasks import construct_block

    shards = [shard(0, [list(range(300)), list(range(200))]), shard(1, [list(range(100))])]
    table = RecipeTable(
        step=4,
        groups=np.arange(2, dtype=np.int64),
        piece_bounds=np.array([0, 1, 3], dtype=np.int64),
        pieces=np.array([[0, 0, 0, 0, 300], [0, 0, 1, 0, 200], [0, 1, 0, 0, 100]]),
        slot_bounds=np.array([0, 1, 3], dtype=np.int64),
        slot_reads=np.array([0, 0, 1], dtype=np.int64),
        slot_epochs=np.zeros(3, dtype=np.int64),
        num_micro_steps=1,
        seq_len=512,
    )
    block = construct_block([table, table], 1, 2, *shards)
    assert sorted(block.parts) == [0, 1, 2, 3]
    walked = block_bytes(block)
    assert walked > 600 * 4  # the tokens, 4 bytes each in wire form
    assert block.nbytes == walked == sizeof(block)
    assert sizeof(BatchBlock(dict(block.parts))) == walked  # (none worked out: walked)
    assert pickle.loads(pickle.dumps(block, protocol=5)).nbytes == walked
    assert block.shared is not None and not block.shared.flags.writeable

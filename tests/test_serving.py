"""Parts as the workers serve them: packed into plain fields and one buffer, unpacked the same."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from distributed.protocol import dumps, loads

from omniload_dask.batching.formats import GroupBatch
from omniload_dask.batching.wire import pack_part, split_parts, unpack_part
from omniload_dask.cluster.serving import wire_parts
from omniload_dask.cluster.tasks import group_parts
from omniload_dask.plan import load_plan
from omniload_dask.testing import InlineDataPlane

PLANS = Path(__file__).resolve().parent.parent / "plans"


def over_the_wire(value: object) -> object:
    """``value`` as the part handler sends it, after Dask's encoding of the reply and its
    decoding on the other side."""
    return replied([value])[0]


def replied(values: list[object]) -> list[object]:
    """``values`` as the part handler replies with them, after Dask's encoding of the reply
    and its decoding on the other side, each as :func:`pack_part` gave it (or as it was)."""
    reply = loads(dumps({"reply": wire_parts(values)}))["reply"]
    return split_parts(list(reply["parts"]), reply.get("buffer"))


def assert_same(a: GroupBatch, b: GroupBatch) -> None:
    assert (a.step, a.group, len(a.micro_batches)) == (b.step, b.group, len(b.micro_batches))
    for x, y in zip(a.micro_batches, b.micro_batches, strict=True):
        assert list(x) == list(y)
        for key in x:
            if isinstance(x[key], np.ndarray):
                assert x[key].dtype == y[key].dtype and x[key].shape == y[key].shape, key
                assert np.array_equal(x[key], y[key]) and y[key].flags.writeable, key
            else:
                assert type(x[key]) is type(y[key]) and x[key] == y[key], key


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omniload_dask.demo import make_demo_data

    folder = tmp_path_factory.mktemp("serving")
    make_demo_data(folder / "demo-data")
    return folder


@pytest.mark.parametrize("name", ["quickstart", "long_context", "vlm"])
def test_every_part_of_the_demo_plans_packs_and_comes_back_identical(demo, name):
    shutil.copy(PLANS / f"{name}.yaml", demo / f"{name}.yaml")
    plan = load_plan(demo / f"{name}.yaml")
    plan = type(plan)(**{**vars(plan), "checkpoint": None})
    cp = plan.layout.cp
    seen = 0
    for _, batches in InlineDataPlane(plan).stream(3):
        for group, batch in batches.items():
            for part in group_parts(batch, group, cp).values():
                packed = pack_part(part)
                assert packed is not None  # the fast path, not Dask's pickling
                assert_same(part, unpack_part(over_the_wire(packed)))
                seen += 1
    assert seen > 0


def test_a_parts_buffer_travels_in_a_frame_of_its_own_and_comes_back_as_a_copy():
    ids = np.arange(100_000, dtype=np.uint32)
    batch = GroupBatch(step=1, group=0, micro_batches=[{"input_ids": ids, "num_tokens": 100_000}])
    packed = pack_part(batch)
    assert packed is not None
    frames = dumps({"reply": wire_parts([packed])})
    assert max(len(memoryview(f).cast("B")) for f in frames) == packed["buffer"].nbytes
    assert sum(len(memoryview(f).cast("B")) for f in frames) < ids.nbytes + 1024
    reply = loads(frames)["reply"]
    back = unpack_part(split_parts(list(reply["parts"]), reply["buffer"])[0])
    # writable, and not the worker's buffer (in-process comms pass it as it is)
    assert not packed["buffer"].flags.writeable
    assert not np.shares_memory(back.micro_batches[0]["input_ids"], packed["buffer"])
    assert_same(batch, back)


def test_the_parts_of_a_reply_share_one_frame_and_come_back_without_a_copy_each():
    batches = [
        GroupBatch(step=s, group=0, micro_batches=[{"input_ids": np.arange(n, dtype=np.uint32),
                                                    "cu_seqlens": np.asarray([0, n], np.int32),
                                                    "num_tokens": n}])
        for s, n in enumerate(range(10_001, 10_006))
    ]  # fmt: skip
    odd = GroupBatch(step=9, group=0, micro_batches=[{"n": np.int64(3)}])  # does not pack
    packed = [pack_part(b) for b in batches]
    values = [packed[0], None, packed[1], odd, *packed[2:]]
    frames = dumps({"reply": wire_parts(values)})
    joined = sum(p["buffer"].nbytes for p in packed)  # (each part's 8-byte aligned already)
    assert max(len(memoryview(f).cast("B")) for f in frames) == joined
    reply = loads(frames)["reply"]
    back = [unpack_part(v) for v in split_parts(list(reply["parts"]), reply["buffer"])]
    assert back[1] is None
    assert back[3].micro_batches == odd.micro_batches
    for want, got in zip(batches, [back[0], back[2], *back[4:]], strict=True):
        assert_same(want, got)
        # a view of the reply's one buffer: unpacking copied nothing
        assert np.shares_memory(got.micro_batches[0]["input_ids"], reply["buffer"])


def test_parts_holding_other_values_go_as_they_are():
    odd = GroupBatch(step=1, group=0, micro_batches=[{"n": np.int64(3)}])
    assert pack_part(odd) is None
    assert pack_part(GroupBatch(1, 0, [{"a": np.array(["x"], dtype=object)}])) is None
    assert unpack_part(None) is None and unpack_part(odd) is odd


def test_arrays_of_any_shape_and_empty_ones_keep_their_layout():
    mb = {
        "ids": np.arange(5, dtype=np.uint32),
        "none": np.zeros(0, dtype=np.int64),
        "patches": np.arange(2 * 3 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3, 3),
        "no_patches": np.zeros((0, 3, 3, 3), dtype=np.uint8),
        "grid": np.asarray([[1, 2], [3, 4]], dtype=np.int32, order="F"),
        "strided": np.arange(10, dtype=np.int64)[::2],
        "count": 7,
        "ratio": 0.5,
        "missing": None,
    }
    batch = GroupBatch(step=4, group=2, micro_batches=[mb, {"last": np.zeros(0, np.int8)}])
    back = unpack_part(over_the_wire(pack_part(batch)))
    assert_same(batch, back)
    for array in back.micro_batches[0].values():
        if isinstance(array, np.ndarray) and array.size:
            assert array.ctypes.data % array.dtype.itemsize == 0  # aligned views


def test_a_block_holds_its_parts_packed_and_its_standby_copy_keeps_them(demo):
    """Construction packs each part as it is served, every packed part's buffer a view of
    the block's one array; a copy of the block for another worker (Dask's serialization of a
    task result) sends that array once, out of band, neither pickling every array nor copying
    the buffers into the pickle, and a part that does not pack travels as itself."""
    import pickle

    from dask.sizeof import sizeof

    from omniload_dask.batching.block import BatchBlock, shared_block
    from omniload_dask.batching.wire import is_packed, packed

    shutil.copy(PLANS / "quickstart.yaml", demo / "quickstart.yaml")
    plan = load_plan(demo / "quickstart.yaml")
    plan = type(plan)(**{**vars(plan), "checkpoint": None})
    wanted: dict[int, GroupBatch] = {}
    for _, batches in InlineDataPlane(plan).stream(2):
        for batch in batches.values():
            wanted[len(wanted)] = batch
    odd = GroupBatch(step=9, group=0, micro_batches=[{"n": np.int64(3)}])  # (does not pack)
    block = shared_block({**{p: packed(b) for p, b in wanted.items()}, len(wanted): odd})
    assert all(is_packed(block.parts[p]) for p in wanted) and block.parts[len(wanted)] is odd
    assert block.shared is not None and not block.shared.flags.writeable
    for p in wanted:
        assert block.parts[p]["buffer"].base is block.shared
    buffers: list[object] = []
    copy = pickle.loads(
        pickle.dumps(block, protocol=5, buffer_callback=buffers.append), buffers=buffers
    )
    assert len(buffers) == 1  # the block's one array, out of band
    assert loads(dumps({"x": copy}))["x"].parts.keys() == block.parts.keys()
    for p, batch in wanted.items():
        assert not copy.parts[p]["buffer"].flags.writeable
        assert_same(batch, unpack_part(over_the_wire(copy.parts[p])))
    assert copy.parts[len(wanted)].micro_batches[0]["n"] == 3
    arrays = sum(v.nbytes for b in wanted.values() for mb in b.micro_batches
                 for v in mb.values() if isinstance(v, np.ndarray))  # fmt: skip
    assert arrays <= sizeof(block) <= arrays + 2048 * len(block.parts)
    # without a shared array (or with a part outside it), a block pickles part by part
    alone = BatchBlock({p: packed(b) for p, b in wanted.items()})
    buffers.clear()
    pickle.dumps(alone, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == len(wanted)
    stray = BatchBlock({**block.parts, 0: packed(wanted[0])}, shared=block.shared)
    back = pickle.loads(pickle.dumps(stray, protocol=5))
    assert_same(wanted[0], unpack_part(over_the_wire(back.parts[0])))
    # a part that does not pack stays as it is
    odd = GroupBatch(step=1, group=0, micro_batches=[{"n": np.int64(3)}])
    assert packed(odd) is odd

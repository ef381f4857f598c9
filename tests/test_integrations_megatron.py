from __future__ import annotations

import itertools

import pytest
import torch

from omniload_dask.errors import JobError
from omniload_dask.integrations.megatron import packed_seq_params, thd_batch


def micro_batch(lengths: list[int], seq_len: int = 64) -> dict:
    gen = torch.Generator().manual_seed(sum(lengths))
    ids = torch.randint(1, 100, (sum(lengths),), generator=gen)
    labels = ids.clone()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    for end in cu[1:]:
        labels[int(end) - 1] = -100  # a document's last token is no target
    positions = torch.cat([torch.arange(n) for n in lengths])
    return {
        "input_ids": ids,
        "labels": labels,
        "position_ids": positions,
        "cu_seqlens": cu,
        "seq_len": seq_len,
        "step": 0,
        "micro_step": 0,
    }


class _Group:
    """A context-parallel group's size and this rank in it: what Megatron's slicing reads."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


@pytest.fixture(scope="module")
def one_process_group():
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("lengths", [[5, 3], [17, 1, 9, 30], [8]])
def test_every_cp_ranks_thd_slice_is_megatrons_zigzag_of_each_padded_document(
    cp, lengths, one_process_group
):
    pytest.importorskip("megatron.core")
    from megatron.core import utils as mcore

    mb = micro_batch(lengths, seq_len=128)
    whole = thd_batch(mb, cp_size=1, pad_multiple=2 * cp)  # the padded batch, uncut
    bounds = whole["cu_seqlens_padded"].tolist()
    for rank in range(cp):
        mine = thd_batch(mb, cp_size=cp, cp_rank=rank)
        assert mine["cu_seqlens_padded"].tolist() == bounds  # boundaries stay global
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            expected = []
            for start, end in itertools.pairwise(bounds):
                doc = {key: whole[key][:, start:end].clone()}
                expected.append(mcore.get_batch_on_this_cp_rank(doc, _Group(cp, rank))[key])
            assert torch.equal(mine[key], torch.cat(expected, dim=1)), (key, rank)


def test_thd_padding_is_never_a_target_and_is_counted():
    mb = micro_batch([5, 3])
    out = thd_batch(mb, cp_size=2, cp_rank=0)
    whole = thd_batch(mb, pad_multiple=4)
    assert whole["cu_seqlens"].tolist() == [0, 5, 8]
    assert whole["cu_seqlens_padded"].tolist() == [0, 8, 12]
    assert whole["num_padding"] == 4 == out["num_padding"]
    pads = whole["tokens"][0] == 0
    assert (whole["labels"][0][pads] == -100).all() and (whole["loss_mask"][0][pads] == 0).all()
    assert whole["loss_mask"].sum() == (mb["labels"] != -100).sum()
    assert whole["max_seqlen"] == 8
    params = packed_seq_params(whole) if _has_megatron() else None
    if params is not None:
        assert params.qkv_format == "thd" and params.max_seqlen_q == 8


def test_fixed_shapes_for_cuda_graphs():
    out = thd_batch(micro_batch([5, 3]), cp_size=2, cp_rank=1, fixed_tokens=32, fixed_docs=4)
    assert out["tokens"].shape == (1, 16)
    assert out["cu_seqlens"].tolist() == [0, 5, 8, 8, 8]
    assert out["cu_seqlens_padded"].tolist() == [0, 8, 32, 32, 32]


def test_bad_thd_requests_are_clear_errors():
    with pytest.raises(JobError, match="more than the capacity 12"):
        thd_batch(micro_batch([5, 5, 1], seq_len=12), cp_size=2, cp_rank=0)
    with pytest.raises(JobError, match="already the feeder's cp slice"):
        thd_batch({**micro_batch([4]), "cp_size": 2}, cp_size=2)
    with pytest.raises(JobError, match="more than fixed_docs 1"):
        thd_batch(micro_batch([4, 4]), fixed_docs=1)
    with pytest.raises(JobError, match="cp_rank must be in 0..1"):
        thd_batch(micro_batch([4]), cp_size=2, cp_rank=2)


def _has_megatron() -> bool:
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        return False
    return True

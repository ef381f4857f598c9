from __future__ import annotations

import hashlib

import pytest

pytest.importorskip("torchtitan.components.dataloader")

from omniload_dask.errors import JobError
from omniload_dask.integrations.torchtitan import titan_batch
from tests.trainer_runs import PLAN, REPO, uninterrupted

pytestmark = pytest.mark.slow


def _digest(input_dict, labels) -> str:
    ids = input_dict["input"][0].numpy().tobytes()
    return hashlib.sha1(ids + labels[0].numpy().tobytes()).hexdigest()


def test_the_titan_loader_resumes_from_a_dcp_checkpoint_with_each_dp_ranks_stream_exact(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.stateful import Stateful
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.loss import IGNORE_INDEX

    from omniload_dask import Job, load_plan
    from omniload_dask.demo import make_demo_data
    from omniload_dask.integrations.torchtitan import OmniloadDataLoader

    make_demo_data(REPO / "plans" / "demo-data")
    reference = uninterrupted(4)
    seen: dict[int, list[tuple[int, int, str]]] = {0: [], 1: []}
    with Job.start(load_plan(PLAN), dp=2, dashboard_address=None) as job:

        def loaders():
            out = {}
            for r in (0, 1):
                feeder = job.feeder(dp_rank=r, max_steps=4)
                out[r] = OmniloadDataLoader(feeder, dp_rank=r, dp_world_size=2)
            return out

        first = loaders()
        assert all(
            isinstance(x, BaseDataLoader) and isinstance(x, Stateful) for x in first.values()
        )
        iters = {r: iter(x) for r, x in first.items()}
        for step in range(2):
            valid = 0
            for r in (0, 1):
                for micro in range(2):
                    input_dict, labels = next(iters[r])
                    assert input_dict["input"].shape == labels.shape
                    assert input_dict["positions"].shape == labels.shape
                    valid += int((labels != IGNORE_INDEX).sum())  # torchtitan's count
                    seen[r].append((step, micro, _digest(input_dict, labels)))
            assert valid > 0
        state = {f"loader{r}": first[r] for r in (0, 1)}
        dcp.save(state, checkpoint_id=str(tmp_path / "ckpt"))
        for x in first.values():
            x.feeder.close()
        second = loaders()
        dcp.load({f"loader{r}": second[r] for r in (0, 1)}, checkpoint_id=str(tmp_path / "ckpt"))
        for r in (0, 1):
            for step, (micro_step, (input_dict, labels)) in enumerate(
                zip([0, 1, 0, 1], second[r], strict=True)
            ):
                seen[r].append((2 + step // 2, micro_step, _digest(input_dict, labels)))
        for r in (0, 1):
            assert [d for *_, d in seen[r]] == [d for *_, d in reference[r]]
        with pytest.raises(JobError, match="written with 2 DP ranks, this run has 3"):
            bad = second[0]
            bad.dp_world_size = 3
            bad.load_state_dict({"dp_rank_0": {}, "world_size": 2})
        with pytest.raises(JobError, match="already yields one DP rank's share"):
            OmniloadDataLoader(second[1].feeder, dp_rank=0, dp_world_size=2)
        for x in second.values():
            x.feeder.close()


def test_titan_batch_pads_to_a_fixed_length_with_padding_that_is_no_target():
    import torch

    from omniload_dask.integrations.torchtitan import titan_batch

    mb = {
        "input_ids": torch.tensor([5, 6, 7]),
        "labels": torch.tensor([6, 7, -100]),
        "position_ids": torch.tensor([0, 1, 2]),
    }
    inputs, labels = titan_batch(mb, pad_to=6)
    assert inputs["input"].tolist() == [[5, 6, 7, 0, 0, 0]]
    assert inputs["positions"].tolist() == [[0, 1, 2, 0, 1, 2]]  # a document of its own
    assert labels.tolist() == [[6, 7, -100, -100, -100, -100]]
    with pytest.raises(JobError, match="do not fit pad_to=2"):
        titan_batch(mb, pad_to=2)


def test_torchtitans_config_manager_builds_the_examples_train_and_validation_loaders(monkeypatch):
    """What runs on CPU of examples/train_torchtitan.py: torchtitan's ConfigManager takes the
    example's config function and overrides, its model config builds, and the loaders built as
    torchtitan's Trainer and Validator build them give the feeders' streams (the model needs a
    GPU to train: examples/gpu_check_torchtitan.py)."""
    import dataclasses

    import torch
    from torchtitan.config import ConfigManager
    from torchtitan.models.llama3 import Llama3Model

    from omniload_dask import Job, load_plan
    from omniload_dask.demo import make_demo_data
    from omniload_dask.integrations.torchtitan import OmniloadDataLoader
    from omniload_dask.internals import comms

    make_demo_data(REPO / "plans" / "demo-data")
    monkeypatch.syspath_prepend(str(REPO / "examples"))
    import train_torchtitan as example

    plan = load_plan(PLAN)
    with Job.start(plan, dp=1, dashboard_address=None) as job:
        address = comms.scheduler_address(job.client)
        vocab = int(job.info["tokenizer"]["vocab_size"])
        monkeypatch.setattr(
            example,
            "RUN",
            dict(
                plan=plan, dp=1, out="", record="", job=job.name, address=address, vocab_size=vocab
            ),
        )
        args = ["--module", "train_torchtitan", "--config", "omniload_debugmodel"]
        args += ["--training.steps", "7", "--validator.freq", "3", "--dataloader.max_steps", "2"]
        config = ConfigManager().parse_args(args)
        assert (config.training.steps, config.validator.freq) == (7, 3)
        assert config.training.global_batch_size == 4  # 1024 tokens a step, rows of 256
        assert config.checkpoint.enable and config.validator.enable
        assert isinstance(config.dataloader, OmniloadDataLoader.Config)
        with torch.device("meta"):
            model = config.model_spec.model.build()
        assert isinstance(model, Llama3Model)
        assert model.tok_embeddings.weight.shape[0] == vocab

        build = dict(dp_world_size=1, dp_rank=0, tokenizer=None, seq_len=256, local_batch_size=1)
        loader = config.dataloader.build(**build, snapshot_every_n_steps=None)
        assert isinstance(loader, OmniloadDataLoader)
        got = [_digest(*batch) for batch in loader]
        with job.feeder(dp_rank=0, max_steps=2) as feeder:
            want = [_digest(*titan_batch(mb, 256)) for mb in feeder]
        assert got == want and len(got) == 8  # two steps of four micro-batches

        val_config = dataclasses.replace(config.validator.dataloader, infinite=False)
        passes = [[_digest(*b) for b in val_config.build(**build)] for _ in range(2)]
        assert passes[0] == passes[1] and len(passes[0]) == 4  # the same batches every pass
        assert passes[0][0] not in got

        with pytest.raises(JobError, match="set job= and address="):
            OmniloadDataLoader.Config().build(**build)
        with pytest.raises(JobError, match="either a feeder or a config"):
            OmniloadDataLoader(dp_rank=0, dp_world_size=1)

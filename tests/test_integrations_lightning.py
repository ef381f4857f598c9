from __future__ import annotations

import pytest

pytest.importorskip("lightning")

from omniload_dask.errors import JobError
from tests.trainer_runs import REPO, losses, recorded, torchrun, uninterrupted

pytestmark = pytest.mark.slow


def test_lightning_example_trains_with_ddp_is_killed_and_resumes_with_every_ranks_stream_exact(
    tmp_path,
):
    from omniload_dask.demo import make_demo_data

    make_demo_data(REPO / "plans" / "demo-data")
    out, first, second = tmp_path / "out", tmp_path / "rec1", tmp_path / "rec2"
    common = ["--out", str(out), "--steps", "5", "--save-steps", "2"]
    killed = torchrun(
        "train_lightning.py", *common, "--record", str(first), "--kill-after-step", "2"
    )
    assert killed.returncode != 0, killed.stdout[-2000:]
    assert "killing rank 0 after step 2" in killed.stdout, killed.stderr[-3000:]
    assert (out / "step2.ckpt").exists()
    resumed = torchrun("train_lightning.py", *common, "--record", str(second), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    before, after, reference = recorded(first), recorded(second), uninterrupted(5)
    for rank in (0, 1):
        trained = [b for b in before[rank] if b[0] < 2]
        assert trained == reference[rank][:4]
        assert after[rank] == reference[rank][4:]
    all_losses = losses(killed.stdout) + losses(resumed.stdout)
    assert len(all_losses) == 5
    assert all_losses[-1] < all_losses[0]


def test_the_data_module_saves_the_position_after_the_last_batch_a_step_took():
    from omniload_dask.integrations.lightning import OmniloadDataModule

    dm = OmniloadDataModule(str(REPO / "plans" / "tiny_trainers.yaml"))
    assert dm.state_dict()["step"] == 0
    dm.on_before_batch_transfer({"step": 3, "micro_step": 0, "num_micro_steps": 2}, 0)
    assert (dm.state_dict()["step"], dm.state_dict()["micro_step"]) == (3, 1)
    dm.on_before_batch_transfer({"step": 3, "micro_step": 1, "num_micro_steps": 2}, 0)
    assert (dm.state_dict()["step"], dm.state_dict()["micro_step"]) == (4, 0)
    dm.load_state_dict({"version": 1, "step": 9, "micro_step": 0})
    assert dm.state_dict()["step"] == 9
    with pytest.raises(JobError, match="has no 'step'"):
        dm.load_state_dict({"micro_step": 0})
    with pytest.raises(JobError, match="not a feeder micro-batch"):
        dm.on_before_batch_transfer({"input_ids": None}, 0)

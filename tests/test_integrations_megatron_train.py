"""examples/train_megatron.py trains megatron-core's GPTModel on 2 gloo ranks, is killed after
a checkpoint and resumes with every rank's stream, and the model, exactly where they were."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

from tests.trainer_runs import REPO, eval_losses, losses, recorded, torchrun, uninterrupted

pytestmark = pytest.mark.slow


def test_megatron_example_trains_is_killed_and_resumes_with_every_ranks_stream_exact(tmp_path):
    from omniload_dask.demo import make_demo_data

    make_demo_data(REPO / "plans" / "demo-data")
    out, first, second = tmp_path / "out", tmp_path / "rec1", tmp_path / "rec2"
    common = ["--out", str(out), "--steps", "5", "--save-steps", "2"]
    killed = torchrun(
        "train_megatron.py", *common, "--record", str(first), "--kill-after-step", "2"
    )
    assert killed.returncode != 0, killed.stdout[-2000:]
    assert "killing rank 0 after step 2" in killed.stdout, killed.stderr[-3000:]
    assert (out / "step2" / "done").exists()
    resumed = torchrun("train_megatron.py", *common, "--record", str(second), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    before, after, reference = recorded(first), recorded(second), uninterrupted(5)
    for rank in (0, 1):
        # rank 1 may start step 2 before rank 0's kill stops the world: not in the checkpoint
        assert [b for b in before[rank] if b[0] < 2] == reference[rank][:4]
        assert after[rank] == reference[rank][4:]
    all_losses = losses(killed.stdout) + losses(resumed.stdout)
    assert len(all_losses) == 5
    assert all_losses[-1] < all_losses[0]
    # the model and optimizer came back too: the same losses as a run never killed
    whole = torchrun("train_megatron.py", "--out", str(tmp_path / "whole"), "--steps", "5")
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert losses(whole.stdout) == all_losses
    # an evaluation at step 2 before the kill, one at step 4 after the resume: the same pass
    assert eval_losses(killed.stdout) and eval_losses(resumed.stdout), killed.stdout[-2000:]
    for rank in (0, 1):
        evals = recorded(first, name="eval-rank")[rank]
        again = recorded(second, name="eval-rank")[rank]
        assert evals and again == evals


def test_megatron_example_resumes_only_from_a_complete_checkpoint(tmp_path):
    """A step folder without ``done`` (a crash while saving) is never resumed from."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ex", REPO / "examples" / "train_megatron.py")
    assert spec and spec.loader
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.last_checkpoint(str(tmp_path / "none")) is None
    for step in (2, 4):
        (tmp_path / f"step{step}").mkdir()
    (tmp_path / "step2" / "done").touch()
    assert example.last_checkpoint(str(tmp_path)) == str(tmp_path / "step2")

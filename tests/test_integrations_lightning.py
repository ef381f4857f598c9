from __future__ import annotations

import pytest

pytest.importorskip("lightning")

from omniload_dask.errors import JobError
from tests.trainer_runs import REPO, eval_losses, losses, recorded, torchrun, uninterrupted

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
    # an evaluation at step 2 before the kill, one at step 4 after the resume: the same pass
    assert eval_losses(killed.stdout) and eval_losses(resumed.stdout), killed.stdout[-2000:]
    for rank in (0, 1):
        evals, again = (
            recorded(first, name="eval-rank")[rank],
            recorded(second, name="eval-rank")[rank],
        )
        assert evals and again and again == evals * (len(again) // len(evals))


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


def test_validation_runs_read_the_same_pass_and_leave_the_training_position(tmp_path):
    import lightning.pytorch as pl
    import torch
    from torch import nn

    from omniload_dask.integrations.lightning import OmniloadDataModule
    from tests.datagen import validation_plan

    plan = validation_plan(tmp_path, "pl-eval", {"steps": 2}, loader={"workers": 1})

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(260, 8)
            self.head = nn.Linear(8, 260)
            self.validated: list[list[bytes]] = []

        def training_step(self, mb, batch_idx):
            logits = self.head(self.embed(mb["input_ids"]))
            return nn.functional.cross_entropy(logits, mb["labels"], ignore_index=-100)

        def on_validation_epoch_start(self) -> None:
            self.validated.append([])

        def validation_step(self, mb, batch_idx):
            self.validated[-1].append(mb["input_ids"].numpy().tobytes())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    import socket

    import torch.distributed as dist

    with socket.socket() as sock:  # a one-rank process group, as a launcher would make it
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    dm = OmniloadDataModule(plan, max_steps=3)
    model = Tiny()
    trainer = pl.Trainer(
        max_steps=3, accelerator="cpu", devices=1, val_check_interval=1,
        check_val_every_n_epoch=None, num_sanity_val_steps=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    try:
        trainer.fit(model, datamodule=dm)
    finally:
        dist.destroy_process_group()
    assert len(model.validated) == 3 and len(model.validated[0]) >= 2
    assert model.validated[0] == model.validated[1] == model.validated[2]
    assert dm.state_dict()["step"] == 3  # validation batches never moved the position


def test_a_resumed_fit_goes_on_with_the_validation_rotation(tmp_path):
    import socket

    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch import nn

    from omniload_dask.integrations.lightning import OmniloadDataModule
    from tests.datagen import validation_plan

    plan = validation_plan(
        tmp_path, "pl-rotation", {"steps": 1, "rotation": 3}, loader={"workers": 1}
    )

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(260, 8)
            self.head = nn.Linear(8, 260)
            self.validated: list[bytes] = []

        def training_step(self, mb, batch_idx):
            logits = self.head(self.embed(mb["input_ids"]))
            return nn.functional.cross_entropy(logits, mb["labels"], ignore_index=-100)

        def validation_step(self, mb, batch_idx):
            self.validated.append(mb["input_ids"].numpy().tobytes())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def fit(steps, folder, resume=None):
        dm, model = OmniloadDataModule(plan, max_steps=steps), Tiny()
        keep = ModelCheckpoint(dirpath=folder, every_n_train_steps=1, save_top_k=-1)
        trainer = pl.Trainer(
            max_steps=steps, accelerator="cpu", devices=1, val_check_interval=1,
            check_val_every_n_epoch=None, num_sanity_val_steps=1, logger=False,
            callbacks=[keep], enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(model, datamodule=dm, ckpt_path=resume)
        return model.validated, dm

    with socket.socket() as sock:  # a one-rank process group, as a launcher would make it
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        whole, _ = fit(4, tmp_path / "whole")  # the sanity check, then passes 0 .. 3
        first, _ = fit(2, tmp_path / "run")
        checkpoint = sorted((tmp_path / "run").glob("*step=2*.ckpt"))[0]
        saved = torch.load(checkpoint, weights_only=False)["OmniloadDataModule"]
        resumed, dm = fit(4, tmp_path / "run", resume=str(checkpoint))
    finally:
        dist.destroy_process_group()
    # (rotation 3: pass 3 gives pass 0's batches again; the sanity check reads pass 0 uncounted)
    assert whole[1] != whole[2] != whole[3] and whole[4] == whole[1] and whole[0] == whole[1]
    assert first == whole[:3] and saved["eval_passes"] == 1  # (saved before step 2's run)
    # the runs after steps 3 and 4 are the uninterrupted run's passes 2 and 3, not 0 and 1
    assert resumed == whole[3:] and dm.eval_passes == 4

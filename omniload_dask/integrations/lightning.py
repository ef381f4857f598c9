"""Lightning (``lightning.pytorch.Trainer``) on feeder micro-batches: a data module whose
position goes into the Lightning checkpoint.

Lightning restores a data module's ``load_state_dict`` before it asks for the train loader, so
:class:`OmniloadDataModule` starts (rank 0) or attaches to (other ranks) the job only in
``train_dataloader()``, at the step the checkpoint says; its ``state_dict()`` is the position
after the last micro-batch that reached a training step (recorded in
``on_before_batch_transfer``, since Lightning's loop fetches one batch ahead). Under DDP the
ranks step together, so rank 0's position, the one Lightning writes, is every rank's::

    dm = OmniloadDataModule("plans/tiny_trainers.yaml", max_steps=100)
    trainer = L.Trainer(strategy="ddp", accumulate_grad_batches=dm.micro_batches, ...)
    trainer.fit(model, datamodule=dm, ckpt_path=last_or_None)

Set ``accumulate_grad_batches`` to the plan's micro-batches per step (one optimizer step per
global batch). Each batch is one packed micro-batch (dict of tensors, see the Feeder).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from omniload_dask.errors import JobError
from omniload_dask.integrations.launch import SharedJob
from omniload_dask.integrations.positions import after, feeder_state
from omniload_dask.integrations.versions import require
from omniload_dask.plan import Plan, load_plan

LIGHTNING_RANGE = ("2.1", "3")  # data module state in the checkpoint, batch-transfer hooks
require("lightning", *LIGHTNING_RANGE)

import lightning.pytorch as pl  # noqa: E402  (after the version check)

__all__ = ["OmniloadDataModule"]


class _Stream(IterableDataset):
    """A feeder's micro-batches, refused in DataLoader worker processes (each would replay
    this rank's stream)."""

    def __init__(self, feeder: Any) -> None:
        super().__init__()
        self.feeder = feeder

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if get_worker_info() is not None:
            raise JobError(
                "OmniloadDataModule: iterated in a DataLoader worker process; each worker "
                "would replay this rank's stream. Use num_workers=0 (the feeder prefetches)"
            )
        return iter(self.feeder)


class _Passes(IterableDataset):
    """Passes over a further stream: each iteration (one validation run) is the next pass,
    counted by the data module (its checkpoint state keeps the count); the sanity check
    before training reads the next pass without counting it."""

    def __init__(self, module: OmniloadDataModule, stream: str) -> None:
        super().__init__()
        self.module, self.stream = module, stream

    def __iter__(self) -> Iterator[dict[str, Any]]:
        module = self.module
        index = module.eval_passes
        trainer = getattr(module, "trainer", None)
        if trainer is None or not trainer.sanity_checking:
            module.eval_passes += 1
        with module.start().feeder(stream=self.stream, pass_index=index) as feeder:
            yield from feeder


class OmniloadDataModule(pl.LightningDataModule):
    """The job's training stream for this rank, resumable from a Lightning checkpoint.

    ``plan``: a Plan or its path; ``address``: a running scheduler (default: an embedded
    cluster in rank 0); ``max_steps``: where the feeder stops; ``job_args`` go to
    ``Job.start`` (``workers=...``). The layout's ``dp`` is the world size.
    """

    def __init__(
        self,
        plan: Plan | str,
        *,
        address: str | None = None,
        max_steps: int | None = None,
        **job_args: Any,
    ) -> None:
        super().__init__()
        self.plan = plan if isinstance(plan, Plan) else load_plan(plan)
        self.address = address
        self.max_steps = max_steps
        self.job_args = job_args
        self.shared: SharedJob | None = None
        self.feeder: Any = None
        self._position: tuple[int, int] = (0, 0)
        self.eval_passes = 0  # validation runs so far (the same on every rank): the next pass

    @property
    def micro_batches(self) -> int:
        """Micro-batches per rank and step: the ``accumulate_grad_batches`` to train with."""
        return int(self.plan.batch.micro_batches)

    @property
    def info(self) -> dict[str, Any]:
        """The job's info (tokenizer, sources), once ``train_dataloader()`` has run."""
        if self.shared is None:
            raise JobError("OmniloadDataModule.info: the job starts in train_dataloader()")
        return self.shared.info

    def start(self) -> SharedJob:
        """Start (rank 0) or attach to the job at the restored step: a collective."""
        if self.shared is None:
            import torch.distributed as dist

            world = dist.get_world_size() if dist.is_initialized() else 1
            self.shared = SharedJob.start(
                self.plan,
                address=self.address,
                start_step=self._position[0],
                dp=world,
                **self.job_args,
            )
        return self.shared

    def train_dataloader(self) -> DataLoader:
        """This rank's micro-batches, from the restored position (starts the job: a collective)."""
        shared = self.start()
        if self.feeder is None:
            self.feeder = shared.feeder(max_steps=self.max_steps)
            self.feeder.load_state_dict(feeder_state(*self._position))
        return DataLoader(_Stream(self.feeder), batch_size=None, num_workers=0)

    def val_dataloader(self) -> DataLoader:
        """Passes over the plan's ``validation`` stream (``streams``), one per validation run:
        the same batches every run, this rank's share (starts the job: a collective)."""
        if "validation" not in self.plan.stream_names:
            raise JobError(
                "OmniloadDataModule.val_dataloader: the plan has no streams.validation "
                "(add one, or give no validation loop)"
            )
        self.start()
        return DataLoader(_Passes(self, "validation"), batch_size=None, num_workers=0)

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Note the position after ``batch`` when it goes to a training step."""
        trainer = getattr(self, "trainer", None)
        if trainer is None or trainer.training:
            self._position = after(batch)
        return batch

    def state_dict(self) -> dict[str, Any]:
        """Where this rank resumes: after the last micro-batch a training step took, and the
        count of validation passes (a resumed run goes on with the plan's rotation)."""
        return {**feeder_state(*self._position), "eval_passes": self.eval_passes}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume at the checkpoint's position (the job starts there in ``train_dataloader``)."""
        for key in ("step", "micro_step"):
            if key not in state_dict:
                raise JobError(f"OmniloadDataModule: checkpoint state has no {key!r}")
        self._position = (int(state_dict["step"]), int(state_dict["micro_step"]))
        self.eval_passes = int(state_dict.get("eval_passes", 0))

    def teardown(self, stage: str) -> None:
        """Close the feeder, then (a collective) stop the job on rank 0."""
        if self.feeder is not None:
            self.feeder.close()
            self.feeder = None
        if self.shared is not None:
            self.shared.close()
            self.shared = None

"""Hugging Face ``transformers.Trainer`` (and so ``accelerate``) on feeder micro-batches.

Three traps of that stack are closed here:

- **A second sharding.** ``accelerate`` prepares a train ``DataLoader`` over an
  ``IterableDataset`` by sharding it again across processes (``IterableDatasetShard``), or, with
  ``dispatch_batches``, by reading it on rank 0 only and splitting what it reads. A feeder
  already yields this rank's share, so :class:`OmniloadTrainer` hands the Trainer a plain
  ``DataLoader`` (one packed micro-batch per item, no workers) and refuses the accelerator
  settings that would split it; :class:`OmniloadCallback` refuses a loader that ``accelerate``
  wrapped anyway.
- **The loss normaliser.** Each item is a padding-free micro-batch in the fields Llama-style
  models take (``input_ids``, ``position_ids``; ``cu_seq_lens_q/k`` and ``max_length_q/k`` as
  ``DataCollatorWithFlattening`` gives them), with the feeder's next-token targets as
  ``shift_labels``, so the Trainer's ``num_items_in_batch`` (its count of targets over the
  accumulated micro-batches, summed over ranks) is the step's count of loss tokens; with
  ``gradient_accumulation_steps`` equal to the plan's micro-batches per step, one optimizer
  step is one global batch. Where micro-batches carry ``global_loss_tokens``, training checks
  the two agree.
- **Resume.** Trainer's resume skips already-seen batches by reading them again; here the
  feeder's position goes into each checkpoint folder (one small JSON per rank) and
  ``train(resume_from_checkpoint=...)`` restores it, with the Trainer's skipping turned off.

::

    data = OmniloadIterable(feeder)
    trainer = OmniloadTrainer(model=model, args=args, train_dataset=data)
    trainer.train(resume_from_checkpoint=ckpt_or_None)

An ``eval_dataset=OmniloadEvalIterable(make)`` evaluates on passes over a validation stream
(the Trainer's own evaluation loop, loaded without a second sharding).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from omniload_dask.errors import JobError
from omniload_dask.integrations.positions import after
from omniload_dask.integrations.versions import require

TRANSFORMERS_RANGE = ("4.56", "6")  # shift_labels in the causal-LM loss and the batch count
ACCELERATE_RANGE = ("1.0", "2")
require("transformers", *TRANSFORMERS_RANGE)
require("accelerate", *ACCELERATE_RANGE)

from transformers import Trainer, TrainerCallback  # noqa: E402  (after the version check)
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint  # noqa: E402

__all__ = [
    "OmniloadCallback",
    "OmniloadEvalIterable",
    "OmniloadIterable",
    "OmniloadTrainer",
    "hf_batch",
    "load_rank_state",
    "state_file",
]


def hf_batch(mb: dict[str, Any]) -> dict[str, torch.Tensor | int]:
    """A feeder micro-batch as a padding-free batch of one row for a Hugging Face causal LM.

    ``labels`` and ``shift_labels`` are the feeder's targets, already shifted (-100 where the
    loss must not count): the model's loss uses ``shift_labels`` as they are, so a document cut
    between micro-batches keeps the target of its last token here. ``use_cache=False``:
    a model with a key-value cache does not look for documents in ``position_ids``.
    """
    if int(mb.get("cp_size", 1)) > 1:
        raise JobError(
            "hf_batch: this micro-batch is one cp rank's slice; transformers.Trainer has no "
            "context parallelism over it. Start the job with cp=1"
        )
    cu = mb["cu_seqlens"].to(torch.int32)
    longest = int(mb["max_seqlen"])
    labels = mb["labels"][None]
    return {
        "input_ids": mb["input_ids"][None],
        "position_ids": mb["position_ids"][None],
        "labels": labels,
        "shift_labels": labels,
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": longest,
        "max_length_k": longest,
        # Without a cache the model finds the documents from position_ids (with one, it
        # would let attention cross them); training never needs one.
        "use_cache": False,
    }


def loss_tokens(mb: dict[str, Any]) -> int:
    """The micro-batch's count of targets: its ``num_loss_tokens``, else ``labels != -100``."""
    if "num_loss_tokens" in mb:
        return int(mb["num_loss_tokens"])
    return int((mb["labels"] != -100).sum())


class OmniloadIterable(IterableDataset):
    """A feeder's micro-batches as Hugging Face batches (see :func:`hf_batch`), with the
    position after the last one handed out as ``state_dict()``.

    ``on_batch(mb)``, if given, sees each feeder micro-batch before it is converted (to log
    or record what a rank trained on).
    """

    def __init__(self, feeder: Any, *, on_batch: Any = None) -> None:
        super().__init__()
        self.feeder = feeder
        self.on_batch = on_batch
        self.micro_steps: int | None = None  # set by OmniloadTrainer: gradient accumulation
        self.step_loss_tokens: dict[int, int] = {}  # step -> global_loss_tokens, where given
        self._position: tuple[int, int] | None = None

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if get_worker_info() is not None:
            raise JobError(
                "OmniloadIterable: iterated in a DataLoader worker process; each worker would "
                "replay this rank's stream. Use num_workers=0 (the feeder prefetches itself)"
            )
        for mb in self.feeder:
            count = int(mb["num_micro_steps"])
            if self.micro_steps is not None and count != self.micro_steps:
                raise JobError(
                    f"OmniloadIterable: step {int(mb['step'])} has {count} micro-batches per "
                    f"rank but gradient_accumulation_steps is {self.micro_steps}; set "
                    f"gradient_accumulation_steps={count} so one optimizer step is one global batch"
                )
            if "global_loss_tokens" in mb:
                self.step_loss_tokens = {int(mb["step"]): int(mb["global_loss_tokens"])}
            if self.on_batch is not None:
                self.on_batch(mb)
            self._position = after(mb)
            yield hf_batch(mb)

    def state_dict(self) -> dict[str, Any]:
        """The feeder state after the last micro-batch handed out (``Feeder.state_dict``)."""
        state = dict(self.feeder.state_dict())
        if self._position is not None:
            state["step"], state["micro_step"] = self._position
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at ``state`` (see ``Feeder.load_state_dict``)."""
        self.feeder.load_state_dict(state)
        self._position = (int(state["step"]), int(state["micro_step"]))


class OmniloadEvalIterable(IterableDataset):
    """Passes over a plan's further stream (``validation`` under ``streams``) as an ``eval_dataset``:
    each iteration (one ``Trainer.evaluate``) is the next pass, ``make(pass_index)`` the
    feeder for it (e.g. ``lambda k: shared.feeder(stream="validation", pass_index=k)``).

    Every rank evaluates as often as the others, so their pass numbers agree; a pass gives the
    same batches whenever it runs (or the plan's rotation), this rank's share of each step.
    The count of passes goes into each checkpoint with the feeder's state
    (``eval_passes``), so a resumed run goes on with the rotation where it was.
    ``on_batch(mb)`` as :class:`OmniloadIterable`'s.
    """

    def __init__(self, make: Callable[[int], Any], *, on_batch: Any = None) -> None:
        super().__init__()
        self.make = make
        self.on_batch = on_batch
        self.passes = 0  # evaluations so far: the next pass's number

    def __iter__(self) -> Iterator[dict[str, Any]]:
        index, self.passes = self.passes, self.passes + 1
        feeder = self.make(index)
        try:
            for mb in feeder:
                if self.on_batch is not None:
                    self.on_batch(mb)
                yield hf_batch(mb)
        finally:
            feeder.close()


def state_file(checkpoint: str | os.PathLike[str], rank: int) -> str:
    """Where rank ``rank``'s feeder state lies in a Trainer checkpoint folder."""
    return os.path.join(os.fspath(checkpoint), f"omniload-rank{rank}.json")


def load_rank_state(checkpoint: str | os.PathLike[str], rank: int) -> dict[str, Any]:
    """Rank ``rank``'s feeder state saved in ``checkpoint`` (a clear error if it is not there)."""
    path = state_file(checkpoint, rank)
    if not os.path.exists(path):
        raise JobError(
            f"{path}: no feeder state in this checkpoint for rank {rank}; was it written by "
            "OmniloadTrainer (or with OmniloadCallback), with as many ranks?"
        )
    with open(path) as f:
        return dict(json.load(f))


def resolve_checkpoint(resume: str | bool | None, output_dir: str) -> str | None:
    """The checkpoint folder ``resume_from_checkpoint`` names (``True``: the last one)."""
    if resume is None or resume is False:
        return None
    if resume is True:
        last = get_last_checkpoint(output_dir)
        if last is None:
            raise JobError(f"resume_from_checkpoint=True: no checkpoint in {output_dir}")
        return str(last)
    return os.fspath(resume)


class OmniloadCallback(TrainerCallback):
    """Saves each rank's feeder state (and the count of evaluation passes of ``evals()``, an
    :class:`OmniloadEvalIterable` or None) into every checkpoint folder, and refuses a train
    loader that ``accelerate`` sharded again."""

    def __init__(self, data: OmniloadIterable, evals: Callable[[], Any] = lambda: None) -> None:
        self.data = data
        self.evals = evals

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Refuse a train loader that ``accelerate`` wrapped in its own sharding."""
        loader = kwargs.get("train_dataloader")
        inner = getattr(loader, "dataset", None)
        if inner is not self.data and getattr(inner, "dataset", None) is self.data:
            raise JobError(
                f"the train loader wraps the feeder's dataset in {type(inner).__name__}, which "
                "splits it again across processes; each rank's feeder already yields that "
                "rank's share. Train with OmniloadTrainer (a plain DataLoader, no dispatch)"
            )

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Write this rank's feeder position into the checkpoint folder just saved."""
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        os.makedirs(folder, exist_ok=True)
        path = state_file(folder, args.process_index)
        state = self.data.state_dict()
        evals = self.evals()
        if isinstance(evals, OmniloadEvalIterable):
            state["eval_passes"] = evals.passes
        with open(path + ".tmp", "w") as f:
            json.dump(state, f)
        os.replace(path + ".tmp", path)  # never half a state beside a whole checkpoint


class OmniloadTrainer(Trainer):
    """A ``transformers.Trainer`` for an :class:`OmniloadIterable` train dataset: no second
    sharding, one global batch per optimizer step, feeder state in each checkpoint."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        data = self.train_dataset
        if not isinstance(data, OmniloadIterable):
            raise JobError(
                f"OmniloadTrainer: train_dataset must be an OmniloadIterable, got "
                f"{type(data).__name__}"
            )
        config = self.args.accelerator_config
        for name in ("dispatch_batches", "split_batches"):
            if getattr(config, name, None):
                raise JobError(
                    f"OmniloadTrainer: accelerator_config.{name}=True splits each batch across "
                    "processes, but every rank's feeder already yields that rank's share; "
                    f"leave {name} unset"
                )
        self.args.ignore_data_skip = True  # the feeder resumes itself; skipping would read
        data.micro_steps = self.args.gradient_accumulation_steps
        self.add_callback(OmniloadCallback(data, lambda: self.eval_dataset))

    def get_train_dataloader(self) -> DataLoader:
        """A plain loader: each item is already this rank's packed micro-batch."""
        return DataLoader(self.train_dataset, batch_size=None, num_workers=0)  # type: ignore[arg-type]

    def get_eval_dataloader(self, eval_dataset: Any = None) -> DataLoader:
        """A plain loader over an :class:`OmniloadEvalIterable` (each rank's share already);
        any other evaluation set as the Trainer loads it."""
        data = eval_dataset if eval_dataset is not None else self.eval_dataset
        if isinstance(data, OmniloadEvalIterable):
            return DataLoader(data, batch_size=None, num_workers=0)
        return super().get_eval_dataloader(eval_dataset)

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
    ) -> Any:
        """``Trainer.train``; resuming also puts this rank's feeder where the checkpoint was."""
        folder = resolve_checkpoint(resume_from_checkpoint, str(self.args.output_dir))
        if folder is not None:
            assert isinstance(self.train_dataset, OmniloadIterable)
            state = load_rank_state(folder, self.args.process_index)
            self.train_dataset.load_state_dict(state)
            if isinstance(self.eval_dataset, OmniloadEvalIterable):  # the rotation goes on
                self.eval_dataset.passes = int(state.get("eval_passes", 0))
        return super().train(
            resume_from_checkpoint=folder, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval
        )

    def compute_loss(
        self,
        model: Any,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        """The Trainer's loss; in training, checks its normaliser against the feeder's count."""
        data = self.train_dataset
        if model.training and num_items_in_batch is not None and isinstance(data, OmniloadIterable):
            for step, expected in data.step_loss_tokens.items():
                if int(num_items_in_batch) != expected:
                    raise JobError(
                        f"step {step}: the Trainer normalises the loss by {int(num_items_in_batch)} "
                        f"tokens, the feeder counts {expected} (global_loss_tokens)"
                    )
        return super().compute_loss(
            model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )

"""torchtitan: a ``BaseDataLoader`` over a feeder, for a train spec's data loader builder.

torchtitan's training loop takes ``(input_dict, labels)`` pairs: ``input_dict["input"]`` the
token ids, further keys model-forward arguments (``positions``, from which its varlen and flex
attention build per-document masks); ``labels`` already shifted, ``-100`` where the loss must
not count. It normalises the loss by the count of ``labels != -100`` over its gradient
accumulation steps, summed over DP ranks: with ``gradient_accumulation_steps`` equal to the
plan's micro-batches per step, that count is the step's ``global_loss_tokens``, and every token
weighs the same whatever rank holds it.

Its checkpointer saves a data loader as a ``Stateful`` under per-DP-rank keys (non-tensor
values of different keys are written by their own rank); :class:`OmniloadDataLoader` does the
same with the feeder's position, and refuses a state of another DP size or a missing rank
rather than starting over silently.

torchtitan 0.3 builds its loaders from configs (``Trainer.Config.dataloader``, and the validator's
``Validator.Config.dataloader``, built afresh for every validation pass):
:class:`OmniloadDataLoader.Config` names the job and its scheduler, and each build attaches a
feeder for the DP rank torchtitan gives::

    config.dataloader = OmniloadDataLoader.Config(job=job.name, address=address)
    config.validator.dataloader = OmniloadDataLoader.Config(
        job=job.name, address=address, stream="validation")
    trainer = config.build()

or, given a feeder already (torchtitan 0.2's ``build_dataloader_fn``),
``OmniloadDataLoader(feeder, dp_rank=r, dp_world_size=dp)``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from omniload_dask.errors import JobError
from omniload_dask.integrations.positions import after, feeder_state
from omniload_dask.integrations.versions import require

TORCHTITAN_RANGE = ("0.2", "0.4")  # (input_dict, labels) batches, BaseDataLoader as Stateful
require("torchtitan", *TORCHTITAN_RANGE)

from torchtitan.components.dataloader import BaseDataLoader  # noqa: E402

# torchtitan 0.3 builds loaders from ``BaseDataLoader.Config``; 0.2 has no loader configs (its
# train spec's ``build_dataloader_fn`` makes the loader), so there the config is a plain one.
_ConfigBase: Any = getattr(BaseDataLoader, "Config", object)

__all__ = ["OmniloadDataLoader", "titan_batch"]


def titan_batch(mb: dict[str, Any], pad_to: int | None = None) -> tuple[dict[str, Any], Any]:
    """A feeder micro-batch as torchtitan's ``({"input", "positions"}, labels)``, one row.

    ``pad_to`` pads the row to a fixed length (for compiled attention that wants one shape):
    the padding is a document of its own (positions from 0), never a target (label -100).
    """
    ids, labels, pos = mb["input_ids"], mb["labels"], mb["position_ids"]
    if pad_to is not None:
        extra = pad_to - len(ids)
        if extra < 0:
            raise JobError(f"titan_batch: {len(ids)} tokens do not fit pad_to={pad_to}")
        ids = torch.cat([ids, torch.zeros(extra, dtype=ids.dtype)])
        labels = torch.cat([labels, torch.full((extra,), -100, dtype=labels.dtype)])
        pos = torch.cat([pos, torch.arange(extra, dtype=pos.dtype)])
    return {"input": ids[None], "positions": pos[None]}, labels[None]


class OmniloadDataLoader(BaseDataLoader):
    """This DP rank's micro-batches as a torchtitan data loader, stateful per DP rank.

    The feeder must serve ``dp_rank`` of a job whose layout has ``dp_world_size`` DP ranks:
    torchtitan must not split it again (a wrong rank or size is an error here). Made from a
    :class:`Config` (``config.build(dp_rank=..., dp_world_size=..., ...)``, as torchtitan's
    trainer and validator do), it makes that feeder itself; torchtitan's other build arguments
    (tokenizer, seq_len, batch size) are the plan's business and are ignored. When the stream
    ends (a validation pass, or ``max_steps``), the loader closes its feeder: torchtitan never
    closes a loader. ``on_batch`` sees each feeder micro-batch before it is converted.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(_ConfigBase):
        job: str = ""
        """The job's name (``Job.name``)."""
        address: str = ""
        """The job's scheduler address."""
        stream: str | None = None
        """A further stream of the plan (``validation``) instead of the training stream."""
        pass_index: int = 0
        """Which pass over that stream (the same batches every time for the same pass)."""
        max_steps: int | None = None
        """Stop after this many steps of the stream (None: the plan's end)."""
        pad_to: int | None = None
        """Pad every row to this length (fixed shapes for compiled attention)."""
        infinite: bool = True
        """Set by torchtitan's validator; a stream's pass ends where the plan says."""

    def __init__(
        self,
        feeder: Any = None,
        *,
        dp_rank: int,
        dp_world_size: int,
        pad_to: int | None = None,
        config: OmniloadDataLoader.Config | None = None,
        on_batch: Callable[[dict[str, Any]], None] | None = None,
        **_framework: Any,
    ) -> None:
        if (feeder is None) == (config is None):
            raise JobError("OmniloadDataLoader: give either a feeder or a config, not both")
        if config is not None:
            feeder, pad_to = _feeder_of(config, dp_rank), config.pad_to
        if feeder.dp_rank != dp_rank or feeder.layout.dp != dp_world_size:
            raise JobError(
                f"OmniloadDataLoader: torchtitan asks for DP rank {dp_rank} of {dp_world_size}, "
                f"the feeder serves DP rank {feeder.dp_rank} of {feeder.layout.dp}; the feeder "
                "already yields one DP rank's share: give it that rank (and the job that DP size)"
            )
        self.feeder = feeder
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.pad_to = pad_to
        self.on_batch = on_batch
        self._key = f"dp_rank_{dp_rank}"
        self._position: tuple[int, int] | None = None

    def __iter__(self) -> Iterator[tuple[dict[str, Any], Any]]:
        for mb in self.feeder:
            self._position = after(mb)
            if self.on_batch is not None:
                self.on_batch(mb)
            yield titan_batch(mb, self.pad_to)
        self.feeder.close()

    def state_dict(self) -> dict[str, Any]:
        """``{"dp_rank_<r>": feeder state, "world_size": dp}``, as torchtitan's loaders keep it."""
        position = self._position
        if position is None:
            state = self.feeder.state_dict()
            position = (int(state["step"]), int(state["micro_step"]))
        return {self._key: feeder_state(*position), "world_size": self.dp_world_size}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume this DP rank's feeder; another DP size or a missing rank is an error."""
        if not state_dict:
            return  # torchtitan's first run: nothing saved yet
        if state_dict.get("world_size") != self.dp_world_size:
            raise JobError(
                f"OmniloadDataLoader: the checkpoint was written with {state_dict.get('world_size')} "
                f"DP ranks, this run has {self.dp_world_size}; resume the job with "
                "Job.start(resume=step) and load no loader state, or keep the DP size"
            )
        if self._key not in state_dict:
            raise JobError(f"OmniloadDataLoader: the checkpoint has no state for {self._key}")
        state = state_dict[self._key]
        self.feeder.load_state_dict(state)
        self._position = (int(state["step"]), int(state["micro_step"]))


def _feeder_of(config: OmniloadDataLoader.Config, dp_rank: int) -> Any:
    """The feeder a config names, for ``dp_rank``; a config without a job is an error."""
    if not config.job or not config.address:
        raise JobError(
            "OmniloadDataLoader.Config: set job= and address= (the job's name and its "
            f"scheduler address), got job={config.job!r}, address={config.address!r}"
        )
    from omniload_dask.trainer.feeder import Feeder

    return Feeder(
        config.job,
        address=config.address,
        dp_rank=dp_rank,
        stream=config.stream,
        pass_index=config.pass_index,
        max_steps=config.max_steps,
    )

"""Which micro-batch a framework has consumed, as a feeder state to save in its checkpoint.

Frameworks fetch ahead: Lightning's loop holds the next batch to know whether an epoch ends,
``accelerate`` looks one batch ahead, torch's ``DataLoader`` prefetches with workers. So the
feeder's own position, when a checkpoint is written, may be past what was trained on. Every
micro-batch says where it belongs (``step``, ``micro_step``, ``num_micro_steps``); the position
*after* the last one the training step took is the state to save::

    consumed: step 4, micro_step 1 of 2   ->  resume at step 5, micro_step 0
    consumed: step 4, micro_step 0 of 2   ->  resume at step 4, micro_step 1
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omniload_dask.errors import JobError

__all__ = ["FEEDER_STATE_VERSION", "after", "feeder_state"]

FEEDER_STATE_VERSION = 1  # the version Feeder.load_state_dict reads


def after(mb: Mapping[str, Any]) -> tuple[int, int]:
    """``(step, micro_step)`` of the micro-batch that follows ``mb`` in its rank's stream."""
    try:
        step, micro, count = (int(mb[k]) for k in ("step", "micro_step", "num_micro_steps"))
    except KeyError as exc:
        raise JobError(
            f"not a feeder micro-batch: it has no {exc.args[0]!r} field (was it collated or "
            "wrapped by a framework? give the micro-batches through unchanged)"
        ) from None
    return (step + 1, 0) if micro + 1 >= count else (step, micro + 1)


def feeder_state(step: int, micro_step: int = 0) -> dict[str, Any]:
    """A state that ``Feeder.load_state_dict`` takes: resume at ``step``, ``micro_step``."""
    return {"version": FEEDER_STATE_VERSION, "step": int(step), "micro_step": int(micro_step)}

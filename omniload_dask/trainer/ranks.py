"""Which trainer rank a feeder serves: given, from torch.distributed, or from the environment.

A rank is one global number in the job's layout (``dp x pp x cp x tp``, see
:class:`~omniload_dask.plan.LayoutSpec`); callers may give it as that number, as coordinates
(``dp_rank`` with ``tp_rank``/``pp_rank``/``cp_rank``), or not at all::

    resolve_rank(layout, rank=5)                   -> 5 (checked against the layout)
    resolve_rank(layout, dp_rank=1, tp_rank=1)     -> layout.rank(1, 1, 0, 0)
    resolve_rank(layout)                           -> torch.distributed's rank, else $RANK
                                                      (with $WORLD_SIZE == layout.world_size)
"""

from __future__ import annotations

import os

from omniload_dask.errors import JobError
from omniload_dask.plan import LayoutSpec

__all__ = ["distributed_rank", "resolve_rank", "torch_available"]


def resolve_rank(
    layout: LayoutSpec,
    *,
    rank: int | None = None,
    dp_rank: int | None = None,
    dp_size: int | None = None,
    tp_rank: int = 0,
    pp_rank: int = 0,
    cp_rank: int = 0,
) -> int:
    """The global rank from what the caller gave, torch.distributed, or the environment.

    ``dp_size``, if given, must match the layout's (a trainer started with another DP size
    than the job would get the wrong share of each batch).
    """
    if dp_size is not None and dp_size != layout.dp:
        raise JobError(
            f"dp_size {dp_size} does not match the job's layout "
            f"(layout.dp = {layout.dp}); start the job with dp={dp_size}"
        )
    if rank is not None:
        if dp_rank is not None:
            raise JobError("give rank or dp_rank, not both")
        layout.coords(rank)  # range check
        return rank
    if dp_rank is not None:
        return layout.rank(dp_rank, tp_rank, pp_rank, cp_rank)
    world_rank, world_size = distributed_rank()
    if world_rank is None:
        if layout.world_size == 1:
            return 0
        raise JobError(
            f"the job's layout has {layout.world_size} ranks; give rank or dp_rank, "
            "or run under torch.distributed (RANK and WORLD_SIZE set)"
        )
    if world_size != layout.world_size:
        raise JobError(
            f"WORLD_SIZE is {world_size} but the job's layout has "
            f"{layout.world_size} ranks (dp={layout.dp} tp={layout.tp} "
            f"pp={layout.pp} cp={layout.cp})"
        )
    return world_rank


def torch_available() -> bool:
    """Whether torch can be imported here (without importing it)."""
    try:
        import importlib.util

        return importlib.util.find_spec("torch") is not None
    except ValueError:
        return False


def distributed_rank() -> tuple[int | None, int | None]:
    """``(rank, world size)`` of an initialised torch.distributed, else from the environment."""
    if torch_available():
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None, None

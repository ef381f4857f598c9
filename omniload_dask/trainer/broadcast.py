"""One fetch per model-parallel group: the group's lowest rank broadcasts to the others.

The paper's ``broadcast_at``: the ranks of one DP group (its tensor-, pipeline- and
context-parallel ranks) need the same batch, or slices of it. The group's lowest global rank
fetches every slice the group needs and broadcasts them within a gloo group of
``torch.distributed`` (CPU tensors need gloo; the trainer's own NCCL groups stay untouched);
each rank keeps its own slice::

    dp=2, tp=2, cp=2 (8 ranks)   DP group 0 = ranks 0, 1, 2, 3: rank 0 fetches slices 0, 1
                                 and broadcasts them; ranks 0, 1 keep slice 0, ranks 2, 3
                                 slice 1 (ranks by the plan's layout order)

The layout's global ranks must be torch.distributed's ranks. Without a ``group`` given, one
gloo group per DP group is made with ``new_group`` (collective: every rank makes all of them,
in the same order), once per process and layout.
"""

from __future__ import annotations

from typing import Any

from omniload_dask.errors import JobError
from omniload_dask.plan import LayoutSpec

__all__ = ["GroupShare", "dp_groups"]

_groups: dict[tuple[Any, ...], list[Any]] = {}


def dp_groups(layout: LayoutSpec) -> list[Any]:
    """One gloo process group per DP group of ``layout`` (made once per process)."""
    import torch.distributed as dist

    key = (layout.dp, layout.tp, layout.pp, layout.cp, layout.order, layout.rank_map)
    if key not in _groups:
        _groups[key] = [
            dist.new_group(ranks=layout.group_ranks(g), backend="gloo") for g in range(layout.dp)
        ]
    return _groups[key]


class GroupShare:
    """Rank ``rank``'s DP group, its leader (lowest rank), and the broadcast among them."""

    def __init__(self, layout: LayoutSpec, rank: int, group: Any = None) -> None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise JobError(
                "fanout 'broadcast' needs torch.distributed initialised "
                "(init_process_group, any backend: the broadcast uses a gloo group)"
            )
        if dist.get_rank() != rank:
            raise JobError(
                f"fanout 'broadcast': this feeder serves rank {rank} but torch.distributed's "
                f"rank is {dist.get_rank()}; the layout's ranks must be torch's"
            )
        dp = layout.coords(rank)["dp"]
        self.members = layout.group_ranks(dp)
        self.leader = self.members[0]
        self.is_leader = rank == self.leader
        self._dist = dist
        self.group = None
        if len(self.members) > 1:
            self.group = group if group is not None else dp_groups(layout)[dp]

    def exchange(self, message: Any) -> Any:
        """The leader's ``message``, on every rank of the group (collective)."""
        if self.group is None:
            return message
        box = [message]
        self._dist.broadcast_object_list(box, src=self.leader, group=self.group)
        return box[0]

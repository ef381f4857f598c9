"""The names of the data plane's tasks: deterministic within a run, unique across runs.

::

    read unit   omniload-read-{run}-{source}-{epoch}-{position}   (read in parts: ...-p{p})
    block       omniload-batch-{run}-{step}-{block}               the batches of a block of DP
                                                                  groups of one step
    steps       omniload-batch-{run}-{first}-k{k}                 every group's batches of the k
                                                                  steps from first on
    rebuild     omniload-batch-{run}-{step}-g{group}-r{n}         one group's batch, built again

A block task builds the batches of ``groups_per_task`` consecutive DP groups (block b holds
groups ``b * size .. (b + 1) * size - 1``); a fetcher asks the worker holding it for its own
*part*: part ``group * cp + c`` is group ``group``'s batch, or with context parallelism its
slice ``c``::

    dp=4, groups_per_task=2, cp=2     block 0 = groups 0, 1   parts 0, 1 (group 0), 2, 3
                                      block 1 = groups 2, 3   parts 4, 5, 6, 7

A block of several steps numbers its parts step by step: part ``offset * dp * cp + group * cp
+ c`` is step ``first + offset``'s.

The scheduler plugin relies on the ``omniload-`` prefix to tell the data plane's tasks apart.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PREFIX", "Keys"]

PREFIX = "omniload-"  # every task key of the data plane starts with it


@dataclass(frozen=True)
class Keys:
    """Key names for one run (``run_id``) of a layout with ``cp`` context-parallel ranks."""

    run_id: str
    cp: int = 1

    def read(self, source: int, ref: tuple[int, int]) -> str:
        """The key of source ``source``'s read unit at ``ref`` = (epoch, position)."""
        return f"omniload-read-{self.run_id}-{source}-{ref[0]}-{ref[1]}"

    def block(self, step: int, block: int) -> str:
        """The key of block ``block``'s batches of ``step``."""
        return f"omniload-batch-{self.run_id}-{step}-{block}"

    def steps_block(self, first: int, steps: int) -> str:
        """The key of the block of every group's batches of ``steps`` steps from ``first``."""
        return f"omniload-batch-{self.run_id}-{first}-k{steps}"

    def rebuild(self, step: int, group: int, rebuild: int) -> str:
        """The key of the ``rebuild``-th rebuild of group ``group``'s batch of ``step``."""
        return f"omniload-batch-{self.run_id}-{step}-g{group}-r{rebuild}"

    def part(self, group: int, cp_rank: int = 0) -> int:
        """The part of a block that DP group ``group``'s cp rank ``cp_rank`` fetches."""
        return group * self.cp + cp_rank

"""The names of the data plane's tasks: deterministic within a run, unique across runs.

::

    read unit   omniload-read-{run}-{source}-{epoch}-{position}   (read in parts: ...-p{p})
    batch       omniload-batch-{run}-{step}-{group}               (rebuilt: ...-r{n})
    cp slice    {batch key}-cp{c}                                 (context parallelism)

The scheduler plugin relies on the ``omniload-`` prefix to tell the data plane's tasks apart.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Keys"]


@dataclass(frozen=True)
class Keys:
    """Key names for one run (``run_id``) of a layout with ``cp`` context-parallel ranks."""

    run_id: str
    cp: int = 1

    def read(self, source: int, ref: tuple[int, int]) -> str:
        """The key of source ``source``'s read unit at ``ref`` = (epoch, position)."""
        return f"omniload-read-{self.run_id}-{source}-{ref[0]}-{ref[1]}"

    def batch(self, step: int, group: int, rebuild: int = 0) -> str:
        """The key of DP group ``group``'s batch of ``step`` (``rebuild``: its n-th rebuild)."""
        suffix = f"-r{rebuild}" if rebuild else ""
        return f"omniload-batch-{self.run_id}-{step}-{group}{suffix}"

    def slices(self, key: str) -> tuple[str, ...]:
        """Keys of a batch's context-parallel slices (none without context parallelism)."""
        return tuple(f"{key}-cp{c}" for c in range(self.cp)) if self.cp > 1 else ()

"""A Feeder as a ``torch.utils.data.IterableDataset`` (imports torch; keep it out of pure code).

Made by :meth:`Feeder.as_torch_dataset`::

    loader = DataLoader(feeder.as_torch_dataset(), batch_size=None)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from torch.utils.data import IterableDataset

__all__ = ["FeederDataset", "MicroBatches"]


class MicroBatches(Protocol):
    """What the dataset wraps: an iterable of micro-batches with a resumable position
    (a :class:`~omniload_dask.trainer.feeder.Feeder`)."""

    def __iter__(self) -> Iterator[dict[str, Any]]: ...

    def state_dict(self) -> dict[str, Any]:
        """Where the iteration is."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``."""
        ...


class FeederDataset(IterableDataset):
    """Yields the feeder's micro-batches. Use ``DataLoader(ds, batch_size=None)``: the feeder
    already batches and prefetches, so DataLoader worker processes add nothing."""

    def __init__(self, feeder: MicroBatches) -> None:
        super().__init__()
        self.feeder = feeder

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.feeder)

    def state_dict(self) -> dict[str, Any]:
        """The feeder's position (see :meth:`Feeder.state_dict`)."""
        return self.feeder.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the feeder at ``state`` (see :meth:`Feeder.load_state_dict`)."""
        self.feeder.load_state_dict(state)

"""A Feeder as a ``torch.utils.data.IterableDataset`` (imports torch; keep it out of pure code)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from torch.utils.data import IterableDataset

if TYPE_CHECKING:
    from omniload_dask.trainer.feeder import Feeder


class FeederDataset(IterableDataset):
    """Yields the feeder's micro-batches. Use ``DataLoader(ds, batch_size=None)``: the feeder
    already batches and prefetches, so DataLoader worker processes add nothing."""

    def __init__(self, feeder: Feeder) -> None:
        super().__init__()
        self.feeder = feeder

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.feeder)

    def state_dict(self) -> dict[str, Any]:
        return self.feeder.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.feeder.load_state_dict(state)

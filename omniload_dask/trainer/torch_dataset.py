"""A Feeder as a ``torch.utils.data.IterableDataset`` (imports torch; keep it out of pure code).

Made by :meth:`Feeder.as_torch_dataset`, or by :meth:`Feeder.dataset`, which makes its feeder
where it is first used (so the dataset can be pickled, e.g. into a DataLoader worker process)
with the connection settings it was given, TLS included::

    loader = DataLoader(feeder.as_torch_dataset(), batch_size=None)
    ds = Feeder.dataset("my-job", address="tls://scheduler:8786", security=sec, rank=r)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
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

    def __init__(
        self,
        feeder: MicroBatches | None = None,
        *,
        make: Callable[[], MicroBatches] | None = None,
    ) -> None:
        super().__init__()
        if (feeder is None) == (make is None):
            raise TypeError("FeederDataset: give a feeder or make, a function that makes one")
        self._feeder = feeder
        self._make = make

    @property
    def feeder(self) -> MicroBatches:
        """The wrapped feeder (made now, by ``make``, on first use)."""
        if self._feeder is None:
            assert self._make is not None
            self._feeder = self._make()
        return self._feeder

    def __getstate__(self) -> dict[str, Any]:
        if self._make is not None:  # a connected feeder stays here; a copy makes its own
            return {**self.__dict__, "_feeder": None}
        return self.__dict__

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.feeder)

    def state_dict(self) -> dict[str, Any]:
        """The feeder's position (see :meth:`Feeder.state_dict`)."""
        return self.feeder.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the feeder at ``state`` (see :meth:`Feeder.load_state_dict`)."""
        self.feeder.load_state_dict(state)

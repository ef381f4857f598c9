"""What the data plane asks its adapter to do: submit a read, submit a construction, release.

::

    SubmitRead(ReadSpec("omniload-read-r1-0-0-3", source=0, file_index=2, ...), lead=1.5)
    SubmitConstruct("omniload-batch-r1-7-0", recipe, reads=(spec_a, spec_b))
    Release(("omniload-read-r1-0-0-3", "omniload-batch-r1-6-0"))

The coordinator returns these from :meth:`~omniload_dask.core.coordinator.Coordinator.advance`; the
scheduler plugin (or :class:`~omniload_dask.testing.InlineDataPlane`) carries them out.
"""

from __future__ import annotations

from dataclasses import dataclass

from omniload_dask.batching.formats import Recipe

__all__ = ["Action", "ReadSpec", "Release", "SubmitConstruct", "SubmitRead"]


@dataclass(frozen=True)
class ReadSpec:
    """Everything a read task needs; the key is deterministic within a run."""

    key: str
    source: int
    file_index: int
    file_url: str
    start: int
    stop: int


@dataclass(frozen=True)
class SubmitRead:
    """Read one unit (or one part of it) into a shard that stays in worker memory."""

    read: ReadSpec
    # Steps of this source's data queued before this unit (-1: a draw waits for it): reads
    # needed sooner run first.
    lead: float = 0.0


@dataclass(frozen=True)
class SubmitConstruct:
    """Build one group's batch; with ``slices``, also cut slice c of it under ``slices[c]``."""

    key: str
    recipe: Recipe
    reads: tuple[ReadSpec, ...]  # in shard-slot order
    slices: tuple[str, ...] = ()


@dataclass(frozen=True)
class Release:
    """Forget these keys: the data plane needs their shards or batches no longer."""

    keys: tuple[str, ...]


Action = SubmitRead | SubmitConstruct | Release

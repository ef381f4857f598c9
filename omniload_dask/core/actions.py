"""What the data plane asks its adapter to do: submit a read, submit a construction, release.

::

    SubmitRead(ReadSpec("omniload-read-r1-0-0-3", source=0, file_index=2, ...), lead=1.5)
    SubmitConstruct("omniload-batch-r1-7-0", recipes=(<RecipeTable of groups 0, 1>,),
                    reads=(spec_a, spec_b, spec_c))
    Release(("omniload-read-r1-0-0-3", "omniload-batch-r1-6-0"))

A construction builds a *block*: the batches of several DP groups of one step in one task
(``loader.groups_per_task``), so the scheduler's work follows blocks, not groups. The recipes
travel packed (a :class:`~omniload_dask.batching.formats.RecipeTable`: a few arrays, whatever
the number of groups), one table per step of the block (several where one task builds
several steps, ``loader.steps_per_task``); each read of the block appears once in ``reads``,
and the tables' ``slot_reads`` index into it.

The coordinator returns these from :meth:`~omniload_dask.core.coordinator.Coordinator.advance`; the
scheduler plugin (or :class:`~omniload_dask.testing.InlineDataPlane`) carries them out.
"""

from __future__ import annotations

from dataclasses import dataclass

from omniload_dask.batching.formats import RecipeTable

__all__ = ["Action", "ReadSpec", "Release", "SubmitConstruct", "SubmitRead"]


@dataclass(frozen=True)
class ReadSpec:
    """Everything a read task needs; the key is deterministic within a run.

    ``more`` are further ``(file index, file url, start, stop)`` reads of the same task, after
    the first (a unit of several small files, :func:`~omniload_dask.sources.catalog.
    merge_small_files`): its records are theirs in this order. ``epoch`` is the source's epoch
    the unit is read for (it seeds the generator of a source's transform).
    """

    key: str
    source: int
    file_index: int
    file_url: str
    start: int
    stop: int
    more: tuple[tuple[int, str, int, int], ...] = ()
    epoch: int = 0


@dataclass(frozen=True)
class SubmitRead:
    """Read one unit (or one portion of it) into a shard that stays in worker memory."""

    read: ReadSpec
    # Steps of this source's data queued before this unit (-1: a draw waits for it): reads
    # needed sooner run first.
    lead: float = 0.0


@dataclass(frozen=True)
class SubmitConstruct:
    """Build a block of DP groups' batches (one recipe each) under one key.

    With ``cp`` > 1 the block holds each group's context-parallel slices instead of the whole
    batch (part ``group * cp + c``, see :class:`~omniload_dask.core.keys.Keys`); the parts of
    the ``i``-th step of a block of several are numbered from ``i * stride``.
    """

    key: str
    recipes: tuple[RecipeTable, ...]  # one per step, in step order
    reads: tuple[ReadSpec, ...]  # each read of the block once
    cp: int = 1
    stride: int = 0  # parts of one step (dp * cp) in a block of several steps

    @property
    def groups(self) -> tuple[int, ...]:
        """The DP groups whose batches the block holds (of any of its steps)."""
        return tuple(sorted({g for t in self.recipes for g in t.groups.tolist()}))


@dataclass(frozen=True)
class Release:
    """Forget these keys: the data plane needs their shards or batches no longer."""

    keys: tuple[str, ...]


Action = SubmitRead | SubmitConstruct | Release

"""Carrying out the coordinator's actions on Dask: submits, releases and their priorities.

The coordinator says *what* to do (:mod:`omniload_dask.core.actions`); an
:class:`ActionExecutor` does it with the data plane's own client and holds the futures, which
is what keeps reads and batches in worker memory::

    SubmitRead(read, lead)         -> submit tasks.read_unit, priority by lead (steps to need)
    SubmitConstruct(key, recipe)   -> submit tasks.construct on the reads' futures
                                      (+ one tasks.cp_slice per context-parallel rank)
    Release(keys)                  -> release the futures (and their standby copies)

Worker queues run higher priorities first: constructions (short, wanted now), then reads a
draw waits for, then reads ahead, those needed in fewer steps first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from distributed import Client, Future

from omniload_dask.cluster import tasks
from omniload_dask.cluster.standby import StandbyCopies
from omniload_dask.core.actions import Action, ReadSpec, Release, SubmitConstruct, SubmitRead
from omniload_dask.plan import Plan, SourceSpec

__all__ = [
    "CONSTRUCT_PRIORITY",
    "LEAD_LEVELS",
    "READ_PRIORITY",
    "URGENT_READ_PRIORITY",
    "ActionExecutor",
    "read_priority",
]

READ_PRIORITY, URGENT_READ_PRIORITY, CONSTRUCT_PRIORITY = 0, 5, 10
LEAD_LEVELS = 1000  # read-ahead priorities go down to READ_PRIORITY - LEAD_LEVELS


def read_priority(lead: float) -> int:
    """Dask priority of a read whose data is needed in ``lead`` steps (< 0: now)."""
    if lead < 0:
        return URGENT_READ_PRIORITY
    return READ_PRIORITY - min(int(lead), LEAD_LEVELS)


class ActionExecutor:
    """One job's futures, and the Dask calls that make and release them.

    ``source_spec(i)`` gives source ``i``'s spec as the coordinator has it now (sources join
    while a job runs); ``read_resources()`` the worker resources every read asks for (None:
    the workers lack the read resource), which change as workers come and go.
    """

    def __init__(
        self,
        client: Client,
        plan: Plan,
        source_spec: Callable[[int], SourceSpec],
        standby: StandbyCopies,
        read_resources: Callable[[], dict[str, int] | None],
    ) -> None:
        self.client = client
        self.plan = plan
        self.standby = standby
        self.futures: dict[str, Future] = {}
        self._source_spec = source_spec
        self._read_resources = read_resources

    def execute(self, actions: Sequence[Action]) -> None:
        """Carry out ``actions`` in order."""
        for action in actions:
            if isinstance(action, SubmitRead):
                self.futures[action.read.key] = self.submit_read(action.read, action.lead)
            elif isinstance(action, SubmitConstruct):
                self._construct(action)
            elif isinstance(action, Release):
                self.release(action.keys)

    def submit_read(self, read: ReadSpec, lead: float = -1.0) -> Future:
        """Submit the read task of ``read`` (not held: the caller keeps the future)."""
        plan = self.plan
        return self.client.submit(
            tasks.read_unit,
            self._source_spec(read.source),
            read.source,
            plan.tokenizer,
            plan.on_error,
            read.file_index,
            read.file_url,
            read.start,
            read.stop,
            images=plan.images,
            key=read.key,
            retries=plan.loader.read_retries,
            priority=read_priority(lead),
            resources=self._read_resources(),
        )

    def release(self, keys: Sequence[str]) -> None:
        """Let go of ``keys``: their futures, and standby copies if any."""
        self.standby.forget(keys)
        for key in keys:
            fut = self.futures.pop(key, None)
            if fut is not None:
                fut.release()

    def release_all(self) -> None:
        """Let go of every future the job holds (it stops)."""
        self.standby.forget(self.futures)
        for fut in self.futures.values():
            fut.release()
        self.futures.clear()

    def _construct(self, action: SubmitConstruct) -> None:
        """Submit a group's construction on its reads, and its context-parallel slices."""
        deps: list[Any] = []
        for read in action.reads:
            fut = self.futures.get(read.key)
            if fut is None:  # a rebuild after the unit was released: read it again
                fut = self.submit_read(read)  # a rebuild waits for it
            deps.append(fut)
        built = self.client.submit(
            tasks.construct,
            action.recipe,
            *deps,
            key=action.key,
            priority=CONSTRUCT_PRIORITY,
            retries=1,
        )
        cp = len(action.slices)
        for c, key in enumerate(action.slices):
            self.futures[key] = self.client.submit(
                tasks.cp_slice,
                built,
                cp,
                c,
                key=key,
                priority=CONSTRUCT_PRIORITY,
                retries=1,
            )
        if cp:
            # Ranks fetch only slices; the scheduler keeps the batch until they are cut (and
            # can recompute it if a slice is lost).
            built.release()
        else:
            self.futures[action.key] = built

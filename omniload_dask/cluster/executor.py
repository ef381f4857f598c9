"""Carrying out the coordinator's actions on Dask: submits, releases and their priorities.

The coordinator says *what* to do (:mod:`omniload_dask.core.actions`); an
:class:`ActionExecutor` does it with the data plane's own client and holds the futures, which
is what keeps reads and batches in worker memory::

    SubmitRead(read, lead)           -> submit tasks.read_unit, priority by lead (steps to need)
    SubmitConstruct(key, recipes)    -> submit tasks.construct_block on the reads' futures:
                                        one task for a block of DP groups
    Release(keys)                    -> release the futures (and their standby copies)

Worker queues run higher priorities first: constructions (short, wanted now), then reads a
draw waits for, then reads ahead, those needed in fewer steps first.

It also remembers the action behind every future it holds, so that after the data plane's
client lost its connection (the scheduler then forgets what that client held) everything can
be submitted again on a new one (:meth:`ActionExecutor.resubmit`): reads and constructions
are deterministic, so the same keys get the same values.
"""

from __future__ import annotations

import time
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
        self.actions: dict[str, SubmitRead | SubmitConstruct] = {}  # behind each future
        self._since: dict[str, float] = {}  # when each was submitted (monotonic)
        self.resubmits = 0
        self.recomputed = {"read": 0, "batch": 0}  # keys that reached memory again (lost)
        self._landed: set[str] = set()  # held keys that reached memory once
        self._source_spec = source_spec
        self._read_resources = read_resources

    def execute(self, actions: Sequence[Action]) -> None:
        """Carry out ``actions`` in order."""
        for action in actions:
            if isinstance(action, SubmitRead):
                key = action.read.key
                self.futures[key] = self.submit_read(action.read, action.lead)
                self.actions[key] = action
                self._since[key] = time.monotonic()
            elif isinstance(action, SubmitConstruct):
                self._construct(action)
            elif isinstance(action, Release):
                self.release(action.keys)

    def landed(self, key: str, kind: str) -> None:
        """``key`` (a ``"read"`` or ``"batch"``) reached memory; a second time for a key still
        held means it was lost (its worker died without a standby copy) and recomputed."""
        if key not in self.futures:
            return
        if key in self._landed:
            self.recomputed[kind] += 1
        else:
            self._landed.add(key)

    def batches_in(self, key: str) -> int:
        """Group batches the block ``key`` builds (its groups times its steps; 1 if unknown)."""
        action = self.actions.get(key)
        if not isinstance(action, SubmitConstruct):
            return 1
        return max(1, sum(len(table) for table in action.recipes))

    def lost(self) -> bool:
        """Whether futures the job holds were cancelled under it (a lost client connection)."""
        return any(fut.cancelled() for fut in self.futures.values())

    def held_for(self, seconds: float) -> list[str]:
        """Keys held for at least ``seconds`` (the scheduler has surely heard of them)."""
        before = time.monotonic() - seconds
        return [k for k, t in self._since.items() if t <= before]

    def resubmit(self, client: Client) -> int:
        """Submit everything the job holds again, on ``client``; returns how many tasks."""
        self.client = client
        held = list(self.actions.values())
        self.futures.clear()
        self.actions.clear()
        self._since.clear()
        self._landed.clear()
        self.resubmits += 1
        self.execute([a for a in held if isinstance(a, SubmitRead)])
        self.execute([a for a in held if isinstance(a, SubmitConstruct)])
        return len(held)

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
            plan.images,
            plan.loader.read_retries,  # transient errors only, inside the task (not Dask's)
            read.more,
            plan.seed,
            read.epoch,
            key=read.key,
            priority=read_priority(lead),
            resources=self._read_resources(),
        )

    def release(self, keys: Sequence[str]) -> None:
        """Let go of ``keys``: their futures, and standby copies if any."""
        self.standby.forget(keys)
        for key in keys:
            self.actions.pop(key, None)
            self._since.pop(key, None)
            self._landed.discard(key)
            fut = self.futures.pop(key, None)
            if fut is not None:
                fut.release()

    def release_all(self) -> None:
        """Let go of every future the job holds (it stops)."""
        self.standby.forget(self.futures)
        for fut in self.futures.values():
            fut.release()
        self.futures.clear()
        self.actions.clear()
        self._since.clear()
        self._landed.clear()

    def _construct(self, action: SubmitConstruct) -> None:
        """Submit a block's construction on its reads (a read released already is read again:
        a rebuild waits for it)."""
        deps: list[Any] = []
        for read in action.reads:
            fut = self.futures.get(read.key)
            if fut is None:
                fut = self.submit_read(read)
            deps.append(fut)
        self.futures[action.key] = self.client.submit(
            tasks.construct_block,
            action.recipes,
            action.cp,
            action.stride,
            *deps,
            key=action.key,
            priority=CONSTRUCT_PRIORITY,
            retries=1,
        )
        self.actions[action.key] = action
        self._since[action.key] = time.monotonic()

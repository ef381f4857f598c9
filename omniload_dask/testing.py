"""Helpers for tests and benchmarks: run the data plane without Dask, compare streams.

:class:`InlineDataPlane` drives the real :class:`Coordinator` with the real worker functions,
called inline in this process in a chosen order. It produces the reference stream a cluster
must reproduce bit for bit, and lets tests shuffle the order in which reads report to show that
timing never changes the result.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from . import tasks
from .batches import GroupBatch, Shard
from .coordinator import Coordinator, Release, SubmitConstruct, SubmitRead
from .errors import JobError, OmniloadError
from .plan import Plan

__all__ = ["InlineDataPlane", "assert_batches_equal", "batch_digest"]


class InlineDataPlane:
    """The coordinator plus inline execution of its actions (no cluster, no threads)."""

    def __init__(
        self,
        plan: Plan,
        *,
        run_id: str = "inline",
        start_step: int = 0,
        shuffle_reports: int | None = None,
        build: bool = True,
        timing: Callable[[Any, Shard], float] | None = None,
    ) -> None:
        self.plan = plan
        self.build = build
        self.timing = timing  # seconds a read "took" (feeds the cost meters), or None
        catalogs = [tasks.discover(spec) for spec in plan.sources]
        self.coord = Coordinator(plan, catalogs, run_id, start_step=start_step)
        self.shards: dict[str, Shard] = {}
        self.batches: dict[str, GroupBatch] = {}
        self._pending: list[Any] = []
        self._rng = random.Random(shuffle_reports) if shuffle_reports is not None else None
        self.reads = 0

    def _run(self, actions: list[Any]) -> None:
        for action in actions:
            if isinstance(action, SubmitRead):
                self._pending.append(action.read)
            elif isinstance(action, SubmitConstruct):
                if not self.build:
                    continue
                shards = [self._shard(r) for r in action.reads]
                built = tasks.construct(action.recipe, *shards)
                self.batches[action.key] = built
                for c, key in enumerate(action.slices):
                    self.batches[key] = tasks.cp_slice(built, len(action.slices), c)
            elif isinstance(action, Release):
                for key in action.keys:
                    self.shards.pop(key, None)

    def _shard(self, read: Any) -> Shard:
        shard = self.shards.get(read.key)
        if shard is None:
            shard = self._read(read)
        return shard

    def _read(self, read: Any) -> Shard:
        spec = self.coord.streams[read.source].spec
        shard = tasks.read_unit(
            spec,
            read.source,
            self.plan.tokenizer,
            self.plan.on_error,
            read.file_index,
            read.file_url,
            read.start,
            read.stop,
            images=self.plan.images,
        )
        self.reads += 1
        self.shards[read.key] = shard
        return shard

    def _settle(self) -> None:
        """Run pending reads (in shuffled order if asked) until nothing is left to do."""
        while True:
            self._run(self.coord.advance())
            if not self._pending:
                if self.coord.error:
                    raise JobError(self.coord.error)
                return
            if self._rng is not None:
                self._rng.shuffle(self._pending)
            read = self._pending.pop()
            try:
                shard = self._read(read)
            except OmniloadError as exc:  # what the plugin does with an erred read task
                self.coord.on_failure(read.key, str(exc))
                continue
            seconds = self.timing(read, shard) if self.timing is not None else None
            self.coord.on_report(
                read.key, shard.lengths, shard.skipped, seconds=seconds, **tasks.report_of(shard)
            )

    def step(self, step: int, ranks: list[int] | None = None) -> dict[int, GroupBatch]:
        """The whole batches of ``step`` for every DP group (every rank asks for one step)."""
        fetched = self.fetch(step, ranks)
        layout = self.plan.layout
        out: dict[int, GroupBatch] = {}
        for rank, key in fetched.items():
            group = layout.coords(rank)["dp"]
            whole = key.rsplit("-cp", 1)[0] if layout.cp > 1 else key
            out[group] = self.batches[whole]
        return out

    def fetch(self, step: int, ranks: list[int] | None = None) -> dict[int, str]:
        """Ask for ``step`` as every rank (or ``ranks``); the key each one fetches.

        ``batches[key]`` is what that rank's feeder gets (its cp slice with context
        parallelism).
        """
        ranks = list(range(self.plan.layout.world_size)) if ranks is None else ranks
        for rank in ranks:
            self.coord.on_request(rank, step, 1)
        for _ in range(10_000):
            self._settle()
            keys = {rank: self.coord.batch_for(rank, step) for rank in ranks}
            self._run(self.coord.advance())
            if all(key is not None and key in self.batches for key in keys.values()):
                return {rank: key for rank, key in keys.items() if key is not None}
        raise RuntimeError(f"step {step} never completed")

    def add_source(self, spec: Any, at_step: int | None = None) -> int:
        """Add a source live (discovered inline); returns the step it joins at."""
        return self.coord.add_source(spec, tasks.discover(spec), at_step)

    def draw(self, steps: int) -> None:
        """Let the data plane draw ``steps`` more steps (no batches built unless ``build``)."""
        target = self.coord.next_step + steps
        while self.coord.next_step < target and self.coord.end_step is None:
            for rank in range(self.plan.layout.world_size):
                self.coord.on_request(rank, self.coord.next_step, 1)
            before = self.coord.next_step
            self._settle()
            if self.coord.next_step == before and self.coord.end_step is None:
                raise RuntimeError(f"the data plane did not draw step {before}")

    def stream(self, steps: int, start: int = 0) -> Iterator[tuple[int, dict[int, GroupBatch]]]:
        for t in range(start, start + steps):
            yield t, self.step(t)


def batch_digest(batch: GroupBatch) -> list[tuple[int, ...]]:
    """A comparable summary: every micro-batch's tokens and provenance as tuples."""
    out = []
    for mb in batch.micro_batches:
        out.append(
            tuple(np.asarray(mb["input_ids"]).tolist())
            + tuple(np.asarray(mb["doc_id"]).tolist())
            + tuple(np.asarray(mb["cu_seqlens"]).tolist())
        )
    return out


def assert_batches_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Micro-batches (numpy or torch) are identical in every array and field."""
    assert set(a) == set(b), (sorted(a), sorted(b))
    for key in a:
        x, y = a[key], b[key]
        if hasattr(x, "numpy"):
            x = x.numpy()
        if hasattr(y, "numpy"):
            y = y.numpy()
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and np.array_equal(x, y), key
        else:
            assert x == y, (key, x, y)

"""Helpers for tests and benchmarks: run the data plane without Dask, compare streams.

:class:`InlineDataPlane` drives the real :class:`Coordinator` with the real worker functions,
called inline in this process in a chosen order. It produces the reference stream a cluster
must reproduce bit for bit, and lets tests shuffle the order in which reads report to show that
timing never changes the result.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from omniload_dask.batching.formats import IMAGE_FIELDS, GroupBatch, Shard
from omniload_dask.batching.wire import expand
from omniload_dask.checkpoint import (
    CheckpointWriter,
    check_catalogs,
    load_for_resume,
    registry_plan,
)
from omniload_dask.cluster import tasks
from omniload_dask.core.actions import Release, SubmitConstruct, SubmitRead
from omniload_dask.core.coordinator import Coordinator
from omniload_dask.core.events import ReadReported, StepsRequested, TaskFailed
from omniload_dask.errors import JobError, OmniloadError
from omniload_dask.plan import Plan
from omniload_dask.plan.credentials import resolve

__all__ = [
    "InlineDataPlane",
    "assert_batches_equal",
    "batch_digest",
    "check_resume_equivalence",
    "part_ref",
]


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
        resume: bool | int | None = None,
        timing: Callable[[Any, Shard], float] | None = None,
        together: int = 1,
        resume_unverified: bool = False,
    ) -> None:
        """``together``: steps drawn before they are dealt, side by side, and committed
        (the scheduler plugin deals up to ``dealing.STEPS_AT_ONCE``; 1: one by one).
        ``resume_unverified``: as ``Job.start``'s (a manifest without its own digest)."""
        self.plan = plan
        self.together = together
        self.build = build
        self.timing = timing  # seconds a read "took" (feeds the cost meters), or None
        saved = state = None
        sources = plan
        if resume is not None and resume is not False:
            saved, state = load_for_resume(plan, resume, resume_unverified)
            sources = registry_plan(plan, state)
        catalogs = [tasks.discover(spec, plan.on_error) for spec in sources.sources]
        if state is not None:
            catalogs = check_catalogs(state, catalogs)
        self.coord = Coordinator(sources, catalogs, run_id, start_step=start_step)
        if state is not None:
            self.coord.load_state_dict(state)
            if saved is not None and saved.plan.stream_fingerprint() != plan.stream_fingerprint():
                self.coord.adopt_plan(plan, catalogs)
        self.writer: CheckpointWriter | None = None
        if plan.checkpoint is not None:
            spec = plan.checkpoint
            self.writer = CheckpointWriter(
                spec.url,
                plan,
                compact_every=spec.compact_every,
                keep_bases=spec.keep_bases,
                storage_options=dict(spec.storage_options),
            )
            self.writer.start(self.coord.state_dict(), saved)
            self.coord.take_deltas()
        self.shards: dict[str, Shard] = {}
        # What each part of a block is (by part_ref(key, part)): what a rank fetches; and
        # each group's whole batch (wire form) by (block key, step, group).
        self.batches: dict[str, GroupBatch] = {}
        self.wholes: dict[tuple[str, int, int], GroupBatch] = {}  # (key, step, group)
        self._pending: list[Any] = []
        self._rng = random.Random(shuffle_reports) if shuffle_reports is not None else None
        self.reads = 0

    def _run(self, actions: list[Any]) -> None:
        """Carry out the coordinator's actions: queue reads, build batches, drop shards."""
        for action in actions:
            if isinstance(action, SubmitRead):
                self._pending.append(action.read)
            elif isinstance(action, SubmitConstruct):
                if not self.build:
                    continue
                shards = [self._shard(r) for r in action.reads]
                for at, table in enumerate(action.recipes):
                    for recipe, whole in tasks.built(table, shards):
                        self.wholes[(action.key, recipe.step, recipe.group)] = whole
                        parts = tasks.group_parts(whole, recipe.group, action.cp)
                        for part, batch in parts.items():
                            self.batches[part_ref(action.key, at * action.stride + part)] = batch
            elif isinstance(action, Release):
                for key in action.keys:
                    self.shards.pop(key, None)

    def _shard(self, read: Any) -> Shard:
        """The shard of ``read``, read (again) when it is not held."""
        shard = self.shards.get(read.key)
        if shard is None:
            shard = self._read(read)
        return shard

    def _read(self, read: Any) -> Shard:
        """Run the worker's read task inline and keep its shard."""
        spec = self.coord.view.spec_of(read.source)
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
            more=read.more,
            seed=self.plan.seed,
            epoch=read.epoch,
        )
        self.reads += 1
        self.shards[read.key] = shard
        return shard

    def checkpoint(self) -> None:
        """Write the deltas drawn so far (every step is flushed at once here)."""
        if self.writer is not None:
            positions = self.coord.view.rank_positions()
            self.writer.add(self.coord.take_deltas(), dict(enumerate(positions)))
            base = self.writer.manifest.bases[-1]["step"] if self.writer.manifest.bases else 0
            due = self.coord.view.next_step - base >= self.writer.compact_every
            self.writer.flush(self.coord.state_dict() if due else None)

    def _settle(self) -> None:
        """Run pending reads (in shuffled order if asked) until nothing is left to do."""
        while True:
            self._run(self.coord.advance(together=self.together))
            self.checkpoint()
            if not self._pending:
                failure = self.coord.view.failure
                if failure is not None:
                    raise JobError(failure.message)
                return
            self.read_one()

    def read_one(self) -> None:
        """Run one queued read (a random one if reports are shuffled) and report it, as a
        read task and the plugin would; no draw."""
        if self._rng is not None:
            self._rng.shuffle(self._pending)
        read = self._pending.pop()
        try:
            shard = self._read(read)
        except OmniloadError as exc:  # what the plugin does with an erred read task
            self.coord.handle(TaskFailed(read.key, str(exc)))
            return
        seconds = self.timing(read, shard) if self.timing is not None else None
        self.coord.handle(
            ReadReported(
                read.key, shard.lengths, shard.skipped, seconds=seconds, **tasks.report_of(shard)
            )
        )

    def step(self, step: int, ranks: list[int] | None = None) -> dict[int, GroupBatch]:
        """The whole batches of ``step`` for every DP group (every rank asks for one step), as
        constructor tasks build them: in wire form (:func:`~omniload_dask.batching.wire.expand` gives the full layout)."""
        fetched = self.fetch(step, ranks)
        layout = self.plan.layout
        out: dict[int, GroupBatch] = {}
        for rank, ref in fetched.items():
            group = layout.coords(rank)["dp"]
            out[group] = self.wholes[(ref.rsplit(":", 1)[0], step, group)]
        return out

    def fetch(self, step: int, ranks: list[int] | None = None) -> dict[int, str]:
        """Ask for ``step`` as every rank (or ``ranks``); the part each one fetches, as
        ``part_ref(block key, part)``.

        ``batches[ref]`` is what that rank's feeder gets (its cp slice with context
        parallelism).
        """
        ranks = list(range(self.plan.layout.world_size)) if ranks is None else ranks
        for rank in ranks:
            self._run(self.coord.handle(StepsRequested(rank, step, 1)))
        for _ in range(10_000):
            self._settle()
            parts = {rank: self.coord.batch_for(rank, step) for rank in ranks}
            self._run(self.coord.advance(together=self.together))
            refs = {r: part_ref(*p) for r, p in parts.items() if p is not None}
            if len(refs) == len(ranks) and all(ref in self.batches for ref in refs.values()):
                return refs
        raise RuntimeError(f"step {step} never completed")

    def add_source(self, spec: Any, at_step: int | None = None) -> int:
        """Add a source live (discovered inline); returns the step it joins at."""
        catalog = tasks.discover(spec, self.plan.on_error)
        return self.coord.add_source(spec, catalog, at_step)

    def update_plan(self, plan: Plan, at_step: int | None = None) -> int:
        """Apply a new plan version's sources, weights and stages live, as
        ``Job.update_plan`` does (its new sources discovered inline); returns the step it
        takes effect at."""
        change = self.coord.view.plan_change(plan.sources, at_step)
        stages = self.coord.view.stage_change(plan.batch, at_step)
        catalogs = [tasks.discover(spec) for spec in change.added]
        step = self.coord.apply_change(change, catalogs, at_step)
        return self.coord.apply_stages(stages) if stages is not None else step

    def draw(self, steps: int) -> None:
        """Let the data plane draw ``steps`` more steps (no batches built unless ``build``)."""
        view = self.coord.view
        target = view.next_step + steps
        while view.next_step < target and view.end_step is None:
            for rank in range(self.plan.layout.world_size):
                self._run(self.coord.handle(StepsRequested(rank, view.next_step, 1)))
            before = view.next_step
            self._settle()
            if view.next_step == before and view.end_step is None:
                raise RuntimeError(f"the data plane did not draw step {before}")

    def stream(self, steps: int, start: int = 0) -> Iterator[tuple[int, dict[int, GroupBatch]]]:
        """``(step, batches by DP group)`` for ``steps`` steps from ``start``, as :meth:`step`."""
        for t in range(start, start + steps):
            yield t, self.step(t)


def part_ref(key: str, part: int) -> str:
    """How :class:`InlineDataPlane` names part ``part`` of block ``key``."""
    return f"{key}:{part}"


def batch_digest(batch: GroupBatch) -> list[tuple[int, ...]]:
    """A comparable summary: every micro-batch's tokens, labels and provenance as tuples (with images,
    also a hash of its image fields: patches, grids and where their tokens sit)."""
    out = []
    for mb in batch.micro_batches:
        images: tuple[int, ...] = ()
        if "pixel_patches" in mb:
            h = hashlib.sha256()
            for key in IMAGE_FIELDS:
                h.update(np.ascontiguousarray(np.asarray(mb[key])).tobytes())
            images = (int.from_bytes(h.digest()[:8], "little"),)
        out.append(
            tuple(np.asarray(mb["input_ids"]).tolist())
            + tuple(np.asarray(mb["doc_id"]).tolist())
            + tuple(np.asarray(mb["cu_seqlens"]).tolist())
            + tuple(np.asarray(expand(mb)["labels"]).tolist())  # (the masks travel too)
            + images
        )
    return out


def assert_batches_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Micro-batches (numpy or torch; either may be in wire form) are identical in every array
    and field of the full layout."""
    a, b = expand(a), expand(b)
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


def check_resume_equivalence(
    plan: Plan,
    steps: int,
    restore_at: list[int],
    *,
    changes: Callable[[InlineDataPlane], None] | None = None,
    resume_plan: Plan | None = None,
    together: int = 1,
) -> int:
    """The shared resume check: run ``steps`` steps with the plan's checkpoint, then restore
    the data plane at every step of ``restore_at`` and require every later batch, of every
    DP group, to equal the uninterrupted run's bit for bit (its loss-token counts too). Returns
    the steps compared.

    ``changes`` is called with the uninterrupted run before it draws: live changes queued for
    later steps (``set_weights``, ``add_source``, ``update_plan`` with ``at_step``), which the
    checkpoint's log must replay. ``resume_plan`` is the plan the restored runs start with
    (default: ``plan``), e.g. the plan version the live changes led to. Each restore starts
    from the checkpoint as the uninterrupted run left it.
    ``together``: the runs deal that many steps together (the checkpoint is then
    written with steps in flight between draws and commits).
    """
    if plan.checkpoint is None:
        raise ValueError("check_resume_equivalence needs a plan with checkpoint.url")
    run = InlineDataPlane(plan, together=together)
    if changes is not None:
        changes(run)
    ref = {t: {g: _resume_digest(b) for g, b in bs.items()} for t, bs in run.stream(steps)}
    run.checkpoint()
    saved = _CheckpointFiles(plan)
    compared = 0
    for step in restore_at:
        saved.put_back()
        again = InlineDataPlane(resume_plan or plan, resume=step, together=together)
        if again.coord.view.next_step != step:
            raise AssertionError(f"restored at {again.coord.view.next_step}, asked for {step}")
        for t, batches in again.stream(steps - step, start=step):
            got = {g: _resume_digest(b) for g, b in batches.items()}
            if got != ref[t]:
                raise AssertionError(f"restored at step {step}: step {t} differs")
            compared += 1
    return compared


def _resume_digest(batch: GroupBatch) -> tuple[Any, ...]:
    """:func:`batch_digest` and each micro-batch's loss-token counts (its own, its step's)."""
    counts = [(mb["num_loss_tokens"], mb.get("global_loss_tokens")) for mb in batch.micro_batches]
    return batch_digest(batch), counts


class _CheckpointFiles:
    """Every file of a plan's checkpoint, kept to be written back (a resume rewrites them)."""

    def __init__(self, plan: Plan) -> None:
        from fsspec.core import url_to_fs

        assert plan.checkpoint is not None
        spec = plan.checkpoint
        self.fs, self.root = url_to_fs(spec.url, **resolve(spec.storage_options))
        self.files = {path: self.fs.cat_file(path) for path in self.fs.find(self.root)}

    def put_back(self) -> None:
        """The checkpoint's files as they were, and no others."""
        for path in self.fs.find(self.root):
            if path not in self.files:
                self.fs.rm(path)
        for path, blob in self.files.items():
            self.fs.pipe_file(path, blob)

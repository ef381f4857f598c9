"""From a drawn step's documents to one recipe per DP group: the assignment, then the pieces.

:meth:`StepDealer.assign` routes the documents to context buckets and balances them over the
DP groups by cost (:mod:`omniload_dask.batching.balance`), then fills any micro-batch a group
was left without (:mod:`omniload_dask.batching.fill`). :meth:`StepDealer.recipes` turns the
split into each group's :class:`~omniload_dask.batching.formats.Recipe`, all packed in one
:class:`~omniload_dask.batching.formats.RecipeTable`: rows of ``(micro-step, shard slot, row,
token start, token stop)`` (tokens of the record: a document continued from an earlier step
starts past 0), where a group's shard slots number the read tasks it uses in order of first
use::

    group 1, micro-step 0: the first 4096 tokens of document 2 (read task R3, row 12),
    then document 7 whole (900 tokens; R1, row 4)
    shard slots  0 -> R3, 1 -> R1          reads (R3, R1)
    pieces       (0, 0, 12, 0, 4096)  (0, 1, 4, 0, 900)

Pure: no I/O and no Dask.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from omniload_dask.batching.balance import (
    Assignment,
    Bucket,
    RoutedDocuments,
    balance_steps,
    route,
)
from omniload_dask.batching.fill import fill_empty
from omniload_dask.batching.formats import RecipeTable
from omniload_dask.batching.sorting import first_use
from omniload_dask.core.actions import ReadSpec
from omniload_dask.core.draw import Documents
from omniload_dask.core.loss_tokens import step_loss_tokens
from omniload_dask.plan import BatchSpec, Plan
from omniload_dask.plan.cost import CostModel

__all__ = ["DealtStep", "DrawnStep", "StepDealer"]


@dataclass
class DrawnStep:
    """A step drawn and not yet dealt: its documents and the reads that hold them."""

    step: int
    docs: Documents
    specs: list[ReadSpec]  # specs[k] reads docs.slots[k]
    epochs: np.ndarray  # epochs[k]: the source epoch docs.slots[k] was drawn in
    started: float  # perf_counter() when the draw began


@dataclass
class DealtStep:
    """A drawn step split among the DP groups: every group's recipe, packed."""

    drawn: DrawnStep
    assignment: Assignment
    recipes: RecipeTable  # reads as indices into drawn.specs
    assign_ms: float
    recipes_ms: float


class StepDealer:
    """The plan's cost model, context buckets and batch shape, applied to one step at a time."""

    def __init__(self, plan: Plan) -> None:
        """Buckets and pins from ``plan.batch``, the cost model from ``plan.cost``."""
        self.cost = CostModel.from_spec(plan.cost)
        names = plan.source_names
        self._names = names
        self.restage(plan.batch)
        self.buckets, self.pinned, _ = self._staged[1][0]
        self._groups = plan.layout.dp
        self._effort = plan.layout.balance
        self._patch_size = plan.images.patch_size if plan.images else 0

    def restage(self, batch: BatchSpec, version: int = 0) -> None:
        """Plan with ``batch`` and its stages (a live stage change, :mod:`.stages`), the
        ``version`` of the stages that the recipes say.

        The batch, its version and the buckets and pins of each of its stages are swapped as
        one value, read once per call: a plan running in another thread sees either (a step
        it plans with the old one is drawn again, :mod:`.rewind`)."""
        stages = batch.every_stage
        # Buckets and pins per stage, and whether it may cut a document between micro-batches
        # (never where documents are kept whole).
        shapes = [(*_shape(b, self._names), not b.whole_documents) for b in stages]
        self._staged = (batch, shapes, version)

    @property
    def declared_micro_steps(self) -> int:
        """Micro-steps per step that the plan declares (a step may need more)."""
        return sum(b.micro_batches for b in self.buckets)

    def deal(self, drawn: DrawnStep) -> DealtStep:
        """Split a drawn step and write its recipes (pure: safe in another thread)."""
        docs = drawn.docs
        t0 = time.perf_counter()
        split = self.assign(docs.sources, docs.lengths, docs.extra, drawn.step, docs.head)
        t1 = time.perf_counter()
        recipes = self.recipes(drawn.step, split, docs, drawn.epochs)
        t2 = time.perf_counter()
        return DealtStep(drawn, split, recipes, (t1 - t0) * 1e3, (t2 - t1) * 1e3)

    def deal_steps(self, drawn: Sequence[DrawnStep]) -> list[DealtStep]:
        """:meth:`deal` of several steps at once: the same dealt steps, their splits made
        side by side where the balancer can (:func:`~.balance.balance_steps`); each step's
        times are its share of the whole. (One step goes through :meth:`deal`.)"""
        if len(drawn) == 1:
            return [self.deal(drawn[0])]
        t0 = time.perf_counter()
        splits = self.assign_steps(
            [(d.docs.sources, d.docs.lengths, d.docs.extra) for d in drawn],
            [d.step for d in drawn],
            [d.docs.head for d in drawn],
        )
        t1 = time.perf_counter()
        recipes = [
            self.recipes(d.step, s, d.docs, d.epochs) for d, s in zip(drawn, splits, strict=True)
        ]
        t2 = time.perf_counter()
        n = len(drawn)
        return [
            DealtStep(d, s, r, (t1 - t0) * 1e3 / n, (t2 - t1) * 1e3 / n)
            for d, s, r in zip(drawn, splits, recipes, strict=True)
        ]

    def assign(
        self,
        src: np.ndarray,
        lengths: np.ndarray,
        extra: np.ndarray | None = None,
        step: int = 0,
        head: int = 1,
    ) -> Assignment:
        """Route a step's documents to buckets and split them among the DP groups; no
        micro-batch is left empty where the step has tokens to give it
        (:mod:`omniload_dask.batching.fill`).

        ``extra`` is each document's encoder cost (images), balanced with the backbone's;
        ``step`` picks the stage whose buckets rule; ``head``: the first documents a pooled
        draw packed first (:attr:`.Documents.head`).
        """
        return self.assign_steps([(src, lengths, extra)], [step], [head])[0]

    def assign_steps(
        self,
        steps: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray | None]],
        at: Sequence[int] | None = None,
        heads: Sequence[int] | None = None,
    ) -> list[Assignment]:
        """:meth:`assign` of several steps, ``(src, lengths, extra)`` each (steps ``at``,
        default 0): the same splits, made side by side where the balancer can
        (:func:`~.balance.balance_steps`), the steps of one stage together. ``heads``: each
        step's first documents that its pooled draw packed first (:attr:`.Documents.head`)."""
        batch, shapes, _ = self._staged
        stage = [batch.stage_index(t) for t in (at if at is not None else [0] * len(steps))]
        out: list[Assignment] = []
        first = 0
        while first < len(steps):
            end = first + 1
            while end < len(steps) and stage[end] == stage[first]:
                end += 1
            buckets, pinned, cut = shapes[stage[first]]
            routed = [
                RoutedDocuments(n, *route(n, src, buckets, pinned), x, head)
                for (src, n, x), head in zip(
                    steps[first:end], (heads or [1] * len(steps))[first:end], strict=True
                )
            ]
            splits = balance_steps(
                routed, buckets, self._groups, self.cost, cut=cut, effort=self._effort
            )
            out += [fill_empty(s, buckets, self.cost, cut) for s in splits]
            first = end
        return out

    def recipes(
        self, step: int, split: Assignment, docs: Documents, epochs: np.ndarray
    ) -> RecipeTable:
        """Every group's recipe, packed: its pieces, and its reads in shard-slot order as
        indices into the step's reads (read k holds ``docs.slots[k]``, drawn in epoch
        ``epochs[k]``)."""
        groups, nu = self._groups, max(1, len(docs.slots))
        order = split.output_order()
        group = split.group[order]
        doc = split.doc[order]
        # The (group, read) pairs of the pieces in order of first use (from one pass, see
        # sorting.first_use). Pieces are in group order, so the pairs are too: each group's
        # shard slots number its reads in order of first use.
        pair_of = group * nu + docs.slot[doc]
        pair, number = first_use(pair_of)
        # pair_bounds[g]: the first pair of group g; a piece's shard slot is its pair's number
        # less that, so every group's slots count from 0 (a group's task reads only its own).
        pair_bounds = np.searchsorted(pair // nu, np.arange(groups + 1))
        table = np.empty((len(order), 5), dtype=np.int64)
        table[:, 0] = split.micro[order]
        table[:, 1] = number - pair_bounds[group]
        table[:, 2] = docs.rows[doc]
        start = table[:, 3]
        start[:] = split.start[order]
        if docs.starts is not None:  # the rest of a document begun in an earlier step
            start += docs.starts[doc]
        np.add(start, split.length[order], out=table[:, 4])
        used = pair % nu
        staged, _, version = self._staged
        batch = staged.at(step)
        return RecipeTable(
            step=step,
            groups=np.arange(groups, dtype=np.int64),
            piece_bounds=np.searchsorted(group, np.arange(groups + 1)).astype(np.int64),
            pieces=table,
            slot_bounds=pair_bounds.astype(np.int64),
            slot_reads=used,
            slot_epochs=np.asarray(epochs, dtype=np.int64)[used],
            num_micro_steps=split.num_micro_steps,
            seq_len=batch.seq_len,
            pad_to_seq_len=batch.pad_to_seq_len,
            micro_seq_lens=tuple(split.micro_capacity.tolist()),
            patch_size=self._patch_size,
            global_loss_tokens=step_loss_tokens(docs, doc, start, table[:, 4]),
            stage=staged.stage_index(step) if staged.stages else -1,
            stages_version=version,
        )


def _shape(batch: BatchSpec, names: list[str]) -> tuple[list[Bucket], dict[int, int]]:
    """The buckets of ``batch`` and the bucket each pinned source (by index) goes to."""
    specs = batch.context_buckets
    buckets = [Bucket(b.seq_len, b.micro_batches, bool(b.sources)) for b in specs]
    return buckets, {names.index(n): b for b, spec in enumerate(specs) for n in spec.sources}

"""The balancer's entry: the split of one step, or of several side by side, through the passes.

:func:`balance_steps` runs the five passes (package doc) on the steps it is given;
:func:`balance` is :func:`balance_steps` of one step. Pass 1 runs on all steps in one table
where there is one bucket (:mod:`.firstpass`), else step by step; pass 2's rounds over groups
and its best fit and pour (:mod:`.room`) run side by side for steps of one bucket and as many
micro-batches; passes 3 to 5 run on the steps' pieces and bins side by side (:func:`~.pieces.side_by_side`) where the
steps have one bucket, at most ``STEPS_UP_TO`` groups and as many bins, else one step at a
time. Side by side or alone, a step gets the same split, to the last bit::

    balance_steps([a, b, c])    a, b: 8 bins each, c: 16 (its tokens needed more)
      passes 1-2: a, b side by side; c alone
      passes 3-5: (a, b) side by side; c alone
      -> [split of a, split of b, split of c] == [balance(a), balance(b), balance(c)]

Few documents per group. No split of whole pieces does better than the *structural bound*,
the mean group cost over the costliest piece (:func:`~.routing.structural_bound`, kept as
``Assignment.bound``): a group that holds that piece costs at least that much. Where the plan
lets documents be cut (``long_documents: split``), pieces that cost more than a group's fair
share are cut into as many parts of equal tokens as it takes (pass 1), and a step still below
``refine.CUT_FROM`` after pass 3's whole-piece changes gets cut rounds: every group gets work,
at the price of cutting most documents (``Assignment.cuts``). Otherwise documents are only cut
where a piece fits no micro-batch whole, and a group or micro-batch may get no piece when its
bucket has fewer pieces than micro-batches: it is handed out empty and counted
(``Assignment.empty_micro_batches``; :mod:`omniload_dask.batching.fill` fills it after).

A document's ``extra`` cost (the vision encoder's cost of its images, see
:mod:`omniload_dask.plan.cost`) is added to its first piece, where its images sit, so groups
are balanced on backbone and encoder cost together; a piece cut keeps it in its first part.
``effort="fast"`` (the plan's ``layout.balance: fast``) runs passes 1, 2 and 5 only: passes 3 and
4 are most of a step's dealing CPU where steps are small (a few groups of one micro-batch), and
some plans would rather spend that CPU elsewhere than even the groups to the last percent.
``benchmarks/balance.py --compare`` measures what each pass adds and ``benchmarks/dealing.py``
what dealing costs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from omniload_dask.batching.assignment import Assignment
from omniload_dask.batching.balance.firstpass import pieces_of_steps
from omniload_dask.batching.balance.pieces import apart, side_by_side
from omniload_dask.batching.balance.place import Placed, place_steps
from omniload_dask.batching.balance.polish import polish
from omniload_dask.batching.balance.refine import STEPS_UP_TO
from omniload_dask.batching.balance.refine import refine as refine_pass
from omniload_dask.batching.balance.routing import (
    Bucket,
    pieces_of,
    route,
    split_documents,
    structural_bound,
)
from omniload_dask.batching.balance.slide import slide
from omniload_dask.plan.choices import BalanceEffort
from omniload_dask.plan.cost import CostFunction

__all__ = [
    "Assignment", "Bucket", "RoutedDocuments", "balance", "balance_steps", "route", "split_documents",
    "structural_bound",
]  # fmt: skip


@dataclass(frozen=True)
class RoutedDocuments:
    """One step's documents as the balancer takes them: their token counts, their bucket
    (:func:`~.routing.route`), whether each was routed by length (so it may spill to a shorter
    bucket; None: all were), each one's extra cost (None: none), and how many of the first
    ones go first where they are packed by length (``head``: a pooled draw's, :mod:`.place`)."""

    lengths: np.ndarray
    bucket: np.ndarray
    by_length: np.ndarray | None = None
    extra: np.ndarray | None = None
    head: int = 1


def balance(
    lengths: np.ndarray,
    doc_bucket: np.ndarray,
    buckets: Sequence[Bucket],
    groups: int,
    cost: CostFunction,
    *,
    by_length: np.ndarray | None = None,
    cut: bool = True,
    refine: bool = True,
    extra: np.ndarray | None = None,
    effort: BalanceEffort = "full",
) -> Assignment:
    """Split documents of ``lengths`` (bucket ``doc_bucket``) among ``groups`` (package doc).

    Every micro-batch holds at most its bucket's ``seq_len`` tokens; a step gets more than a
    bucket's ``micro_batches`` only when its tokens need them, or (``cut=False``) when its
    pieces cannot be packed whole. ``refine=False`` skips passes 3 to 5 (for measurements).
    ``extra`` is a cost per document on top of ``cost`` of its pieces (image encoder terms);
    ``effort`` ``"fast"`` skips passes 3 and 4 (module doc).
    """
    step = RoutedDocuments(lengths, doc_bucket, by_length, extra)
    return balance_steps([step], buckets, groups, cost, cut=cut, refine=refine, effort=effort)[0]


def balance_steps(
    steps: Sequence[RoutedDocuments],
    buckets: Sequence[Bucket],
    groups: int,
    cost: CostFunction,
    *,
    cut: bool = True,
    refine: bool = True,
    effort: BalanceEffort = "full",
) -> list[Assignment]:
    """:func:`balance` of several steps: the same splits, bit for bit, made side by side
    where they can be (module doc)."""
    if len(buckets) == 1:  # (every step's pieces in one table: .firstpass)
        docs = [(s.lengths, s.extra, s.head) for s in steps]
        routed = pieces_of_steps(docs, buckets[0], groups, cost, cut)
    else:
        routed = [
            pieces_of(s.lengths, s.bucket, buckets, groups, cost, s.by_length, cut, s.extra, s.head)
            for s in steps
        ]
    together = len(buckets) == 1 and 2 <= groups <= STEPS_UP_TO
    placed = place_steps(routed, buckets, groups, cost, cut, together)
    if refine:
        kinds: dict[int, list[Placed]] = {}  # steps side by side: those of as many bins
        for i, one in enumerate(placed):
            if len(one.pieces):
                kinds.setdefault(len(one.bins.room) if together else -1 - i, []).append(one)
        for kind in kinds.values():
            _even(kind, groups, cost, cut, effort == "full")
    return [one.assignment(buckets, groups) for one in placed]


def _even(kind: list[Placed], groups: int, cost: CostFunction, cut: bool, full: bool) -> None:
    """Passes 3 to 5 (not ``full``: 5 only) of steps of as many bins, side by side (one step:
    its own tables)."""
    if len(kind) == 1:
        p, bins = kind[0].pieces, kind[0].bins
    else:
        p, bins = side_by_side([(o.pieces, o.bins) for o in kind], groups)
    n = len(kind)
    if full:
        refine_pass(p, bins, n, groups, cost, cut)
        polish(p, bins, n, groups)
    if cut:
        slide(p, bins, n, groups, cost)
    if n > 1:
        for one, (pieces, b) in zip(
            kind, apart(p, bins, [(o.pieces, o.bins) for o in kind], groups), strict=True
        ):
            one.pieces, one.bins = pieces, b

"""Pass 1 of several steps of one bucket at once: their pieces in one table, cut in one go.

:func:`~.routing.pieces_of` makes one step's pieces at a time: a dozen numpy calls to cut its
documents into pieces of at most ``seq_len`` tokens, and as many again each time it cuts the
pieces that cost more than a group's fair share (:func:`~.routing.pieces_of`'s ``_cut_costly``,
about three times a step). With one bucket nothing spills and every step's pieces are made the
same way, so :func:`pieces_of_steps` makes the pieces of all steps in one table (step s's
documents numbered after those of the steps before it) and cuts the costly pieces of every step
in the same calls, each step with its own fair share and its own reason to stop::

    steps a (documents 9, 2), b (documents 4, 4), 2 groups, cost = L^2
    table   a:9 a:2 b:4 b:4       fair shares a: 42.5, b: 16
    round 1 a:9 (81) is over 42.5: cut into 2 parts (5, 4); b: none over 16, b is done
    round 2 a: fair (25 + 16 + 4) / 2 = 22.5: a:5 (25) cut into 3, 2; ...
    apart   a: 9 -> 3 + 2 + 4 (its parts appended in the order it cuts them), b: 4, 4

A step's pieces keep the order they get alone (its own pieces first, then the parts cut off,
in the order they were cut: the table appends the parts of all steps in piece order, and a
step's pieces keep their order within it), and every cost, share and sum is the step's own
(each step's share is the sum of its own costs, in its order: the same pairwise sum), so each
step's pieces are those :func:`~.routing.pieces_of` makes, to the last bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from omniload_dask.batching.balance.pieces import Pieces
from omniload_dask.batching.balance.routing import Bucket, StepPieces, cut_even, split_documents
from omniload_dask.plan.cost import CostFunction

__all__ = ["pieces_of_steps"]

COSTLY_ROUNDS = 8  # as routing's: rounds of cutting the pieces over a fair share, at most


def pieces_of_steps(
    steps: Sequence[tuple[np.ndarray, np.ndarray | None, int]], bucket: Bucket, groups: int,
    cost: CostFunction, cut: bool,
) -> list[StepPieces]:  # fmt: skip
    """:func:`~.routing.pieces_of` of steps ``(lengths, extra, head)`` of the one ``bucket``
    (module doc): each step's pieces, micro-batches per group, spilled documents (none:
    one bucket) and structural bound, as it makes them alone."""
    seq = int(bucket.seq_len)
    lengths = [np.asarray(n, dtype=np.int64) for n, _, _ in steps]
    counts = np.asarray([len(n) for n in lengths], np.int64)
    all_lengths = np.concatenate(lengths) if len(lengths) else np.zeros(0, np.int64)
    doc, start = split_documents(all_lengths, seq)
    length = np.minimum(all_lengths[doc] - start, seq)
    if len(steps) == 1:  # (one step: its documents are the table's)
        step_of, own_doc = np.zeros(0, np.int64), doc
        piece_first = np.asarray([0, len(doc)], np.int64)
    else:
        step_of = np.arange(len(steps)).repeat(counts)[doc]
        own_doc = doc - np.concatenate([[0], counts.cumsum()]).astype(np.int64)[step_of]
        piece_first = np.concatenate([[0], np.bincount(step_of, minlength=len(steps)).cumsum()])
    extra = np.zeros(len(doc))
    if any(x is not None for _, x, _ in steps):
        per_doc = np.concatenate(
            [np.zeros(len(n)) if x is None else np.asarray(x, np.float64)
             for n, (_, x, _) in zip(lengths, steps, strict=True)]
        )  # fmt: skip
        extra = np.where(start == 0, per_doc[doc], 0.0)
    p = Pieces.new(own_doc, start, length, np.zeros(len(doc), np.int64), extra, cost)
    bounds, need = [], []
    for s in range(len(steps)):
        a, b = int(piece_first[s]), int(piece_first[s + 1])
        costs = p.cost[a:b]
        peak = float(costs.max()) if b > a else 0.0  # (routing.structural_bound, on a view)
        bounds.append(min(1.0, float(costs.sum()) / groups / peak) if peak > 0 else 1.0)
        need.append(int(length[a:b].sum()))
    cuts = np.zeros(len(steps), np.int64)
    if cut:
        live = np.asarray([bound < 1.0 for bound in bounds], dtype=bool)
        if live.any():
            if len(steps) == 1:
                step_of = np.zeros(len(p), np.int64)
            step_of = _cut_costly(p, step_of, live, groups, cost, cuts)
    micro = int(bucket.micro_batches)
    if len(steps) == 1:  # (the table is the step's: no copies)
        p.cuts, p.head = int(cuts[0]), steps[0][2]
        shape = np.asarray([max(micro, -(-need[0] // (seq * groups)))], np.int64)
        return [StepPieces(p, shape, 0, bounds[0])]
    order = step_of.argsort(kind="stable")  # (a step's pieces in their order: its own, cut)
    ends = np.bincount(step_of, minlength=len(steps)).cumsum()
    out = []
    for s, (_, _, head) in enumerate(steps):
        mine = order[(int(ends[s - 1]) if s else 0) : int(ends[s])]
        one = Pieces(
            p.doc[mine], p.start[mine], p.length[mine], p.cost[mine], p.bucket[mine],
            p.extra[mine], p.bin[mine], int(cuts[s]), head,
        )  # fmt: skip
        shape = np.asarray([max(micro, -(-need[s] // (seq * groups)))], np.int64)
        out.append(StepPieces(one, shape, 0, bounds[s]))
    return out


def _cut_costly(
    p: Pieces, step_of: np.ndarray, live: np.ndarray, groups: int, cost: CostFunction,
    cuts: np.ndarray,
) -> np.ndarray:  # fmt: skip
    """Routing's ``_cut_costly`` of the ``live`` steps at once, each against its own fair
    share (the sum of its own costs, in its order); counts each step's cuts in ``cuts``.
    Returns the step of every piece (the parts cut off appended)."""
    for _ in range(COSTLY_ROUNDS):
        if not live.any():
            break
        fair = np.zeros(len(live))
        if len(live) == 1:  # (one step: its costs are the table's)
            fair[0] = float(p.cost.sum()) / groups
        else:
            order = step_of.argsort(kind="stable")
            ends = np.bincount(step_of, minlength=len(live)).cumsum()
            for s in live.nonzero()[0].tolist():
                mine = order[(int(ends[s - 1]) if s else 0) : int(ends[s])]
                fair[s] = float(p.cost[mine].sum()) / groups
        live &= fair > 0
        costly = ((p.cost > fair[step_of]) & (p.length > 1) & live[step_of]).nonzero()[0]
        has = np.bincount(step_of[costly], minlength=len(live))
        live &= has > 0
        if not len(costly):
            break
        k = np.minimum(np.ceil(p.cost[costly] / fair[step_of[costly]]).astype(np.int64),
                       p.length[costly])  # fmt: skip
        parts = np.maximum(k, 2)
        cut_even(p, costly, parts, cost)
        step_of = np.concatenate([step_of, step_of[costly].repeat(parts - 1)])
        cuts += has
    return step_of

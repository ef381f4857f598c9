"""No empty micro-batches: every micro-batch of every DP group gets some tokens of the step.

Every DP group of a step has the same micro-batches (ranks run the same number of micro-steps),
but the balance gives each group the documents that even out the cost, so one group may have no
document left for some of its micro-batches; a context bucket sized for short documents runs
empty in a step of long ones. An empty micro-batch (zero tokens) is a step a trainer cannot
normalise a loss over, and a zero-length forward that some kernels refuse. After the balance,
:func:`fill_empty` moves tokens into every empty micro-batch from the first donor that can give
them: the group's pieces of the same bucket, then of its other buckets without sources (the
group's cost and tokens stay the same up to the cost of a cut), then the same of the other
groups, costliest first (which evens their costs too). A donor gives::

    1 move   a whole piece from its costliest micro-batch that holds two or more, the largest
             that fits
    2 cut    (long_documents: split) the tail of the largest piece of its fullest micro-batch:
             half of it, at most the empty micro-batch's capacity

    group 1, 4 micro-batches of 2048:  [1500 + 400] [1800] [ ] [ ]
    move     the 1500 to micro-batch 2: [400] [1800] [1500] [ ]
    cut      the last 900 of the 1800:  [400] [900] [1500] [900]

A micro-batch of a bucket without sources takes pieces of buckets without sources (its own
first); one of a bucket with pinned sources takes its sources' pieces, from any group, and only
when there are none (a step without those sources' documents) pieces of buckets without sources:
pinned sources' documents never leave their bucket. A micro-batch stays empty only when no
group has anything it may give: fewer pieces than micro-batches with ``long_documents:
truncate`` (which never cuts), or fewer tokens than micro-batches (the last step of a finite
stream). Feeders then hand it out with ``num_tokens == 0`` (docs/getting-started.md says how a
trainer treats it: run the micro-step, add nothing to the loss).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace

import numpy as np

from omniload_dask.batching.assignment import Assignment
from omniload_dask.batching.balance.routing import Bucket
from omniload_dask.plan.cost import CostFunction

__all__ = ["fill_empty"]


def fill_empty(
    plan: Assignment, buckets: Sequence[Bucket], cost: CostFunction, cut: bool
) -> Assignment:
    """``plan`` with tokens moved within each group into its empty micro-batches (module doc);
    ``plan`` itself when none is empty. ``cut``: pieces may be cut (``long_documents: split``)."""
    tokens = plan.micro_tokens
    if plan.groups == 0 or tokens.size == 0 or (tokens > 0).all():
        return plan
    doc, start, length = plan.doc.tolist(), plan.start.tolist(), plan.length.tolist()
    costs, group, micro = plan.cost.tolist(), plan.group.tolist(), plan.micro.tolist()
    capacity = plan.micro_capacity.tolist()
    bucket_of = plan.micro_bucket.tolist()
    pinned = [b.pinned for b in buckets]
    cuts = 0
    load = np.bincount(plan.group, plan.cost, plan.groups).tolist()
    for g in range(plan.groups):
        for m in np.flatnonzero(tokens[g] == 0).tolist():
            # its own group first, then the others, costliest first (that evens them too)
            others = sorted((h for h in range(plan.groups) if h != g), key=lambda h: (-load[h], h))
            for h, pool in _donors(m, [g, *others], group, micro, bucket_of, pinned):
                i = _movable(m, pool, micro, length, costs, capacity)
                if i is not None:  # 1 move a whole piece
                    tokens[h, micro[i]] -= length[i]
                    load[h] -= costs[i]
                    group[i], micro[i] = g, m
                    tokens[g, m] += length[i]
                    load[g] += costs[i]
                    break
                i = _cut(pool, micro, length) if cut else None
                if i is None:
                    continue
                take = min(capacity[m], length[i] // 2)  # 2 cut: its tail moves
                head = length[i] - take
                before, after, tail = np.asarray(cost(np.asarray([length[i], head, take])), float)
                costs[i] += float(after - before)  # (an image's cost stays with the head)
                load[h] += float(after - before)
                length[i] = head
                tokens[h, micro[i]] -= take
                doc.append(doc[i])
                start.append(start[i] + head)
                length.append(take)
                costs.append(float(tail))
                group.append(g)
                micro.append(m)
                tokens[g, m] += take
                load[g] += float(tail)
                cuts += 1
                break
            # (nothing anywhere to give: it stays empty, see the module doc)
    return replace(
        plan,
        doc=np.asarray(doc, dtype=np.int64),
        start=np.asarray(start, dtype=np.int64),
        length=np.asarray(length, dtype=np.int64),
        cost=np.asarray(costs, dtype=np.float64),
        group=np.asarray(group, dtype=np.int64),
        micro=np.asarray(micro, dtype=np.int64),
        cuts=plan.cuts + cuts,
        _order=None,
    )


def _donors(
    m: int,
    groups: list[int],
    group: list[int],
    micro: list[int],
    bucket_of: list[int],
    pinned: list[bool],
) -> Iterator[tuple[int, list[int]]]:
    """``(group, pieces)`` that micro-batch m may take from, by preference (module doc)."""
    own = bucket_of[m]

    def pool(h: int, same: bool) -> list[int]:
        return [
            i
            for i in range(len(group))
            if group[i] == h
            and (
                bucket_of[micro[i]] == own
                if same
                else bucket_of[micro[i]] != own and not pinned[bucket_of[micro[i]]]
            )
        ]

    if pinned[own]:  # its own sources anywhere, before others' documents
        order = [(h, True) for h in groups] + [(h, False) for h in groups]
    else:
        order = [(h, same) for h in groups for same in (True, False)]
    for h, same in order:
        yield h, pool(h, same)


def _movable(
    m: int,
    pool: list[int],
    micro: list[int],
    length: list[int],
    costs: list[float],
    capacity: list[int],
) -> int | None:
    """A whole piece to move: from the costliest micro-batch holding two or more, the largest
    piece that fits micro-batch m (ties: the lower index)."""
    held: dict[int, list[int]] = {}
    for i in pool:
        held.setdefault(micro[i], []).append(i)
    full = [k for k, pieces in held.items() if len(pieces) > 1]
    for k in sorted(full, key=lambda k: (-sum(costs[i] for i in held[k]), k)):
        fits = [i for i in held[k] if length[i] <= capacity[m]]
        if fits:
            return min(fits, key=lambda i: (-length[i], i))
    return None


def _cut(pool: list[int], micro: list[int], length: list[int]) -> int | None:
    """The piece to cut: the largest of the fullest micro-batch (at least 2 tokens)."""
    held: dict[int, int] = {}
    for i in pool:
        held[micro[i]] = held.get(micro[i], 0) + length[i]
    for k in sorted(held, key=lambda k: (-held[k], k)):
        pieces = [i for i in pool if micro[i] == k and length[i] >= 2]
        if pieces:
            return min(pieces, key=lambda i: (-length[i], i))
    return None

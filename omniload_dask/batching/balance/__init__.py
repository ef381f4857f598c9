"""The balancer: split one global batch among the DP groups and pack each share into micro-batches.

The documents of a step are fixed by the mix, whatever the DP size. The balancer cuts them into
pieces of at most a bucket's ``seq_len`` tokens and gives every piece to a micro-batch of a DP
group, so that the costliest group (every rank waits for it) costs as little as it can, under
hard token limits: a micro-batch never holds more than its ``seq_len``. Five passes, in numpy,
deterministic (ties go to the lower index), run by split.py, each in a module of its own with
one more per idea it is made of::

    1 route    each document to a context bucket, an over-full bucket handing its shortest
               documents down; documents cut into pieces; pieces that cost more than a
               group's fair share cut again (routing.py)
    2 place    pieces by decreasing cost (LPT) in rounds over the groups (rounds.py: each
               step's queue, queues.py; where a round ends, lpt.py), each into its group's
               cheapest micro-batch with room (slots.py); what no round placed fills the
               room left (best fit), cut where nothing fits whole; with many micro-batches
               per group, micro-batches are packed first, then dealt (place.py)
    3 refine   the heavy groups against the light ones, many pairs at once (refine.py, the
               pairs: pairs.py): a move, a swap, or the exchange of a piece for a run of short
               ones (whole.py); cuts where whole pieces cannot even a step (cuts.py)
    4 polish   up to 64 groups: exchanges of up to two pieces for up to two (polish.py; what
               a side gives, halves.py; which exchanges a round makes, exchanges.py)
    5 slide    up to 64 groups, cuts allowed: move a cut by a short piece's length (slide.py)

Worked example: 2 groups, 1 micro-batch of 8 tokens each, cost = tokens, documents 6, 5, 3, 2::

    1 route    one bucket of 8: pieces 6, 5, 3, 2 (none over 8; fair share 16 / 2 = 8)
    2 place    round 1: 6 -> g0, 5 -> g1      (the least loaded groups first)
               round 2: 3 -> g1 (load 5), 2 -> g0 (load 6)
                 g0 [6 2]  cost 8          g1 [5 3]  cost 8
    3-5        loads 8, 8: nothing to even (efficiency mean/max = 1.0)

Steps side by side. The dealing thread balances several steps at once
(:func:`balance_steps`): their pieces and micro-batches go into one set of tables, step s's
groups numbered from ``s * groups`` (:func:`~.pieces.side_by_side`), and passes 2 to 5 run once
for all of them, each step keeping its own queue, rounds, pairs and reasons to stop. There is
one code path: :func:`balance` is :func:`balance_steps` of one step, and a step balanced with
others gets the split it gets alone, to the last bit (the stream digests prove it).

Tables (:mod:`.pieces`): ``Pieces`` (document, token range, cost, micro-batch) and ``Bins`` (a
micro-batch's group, slot, room and cost); :mod:`.tables` holds what a round of pass 3 weighs on.
The result is an :class:`~omniload_dask.batching.assignment.Assignment`.
"""

from omniload_dask.batching.balance.split import (
    Assignment,
    Bucket,
    RoutedDocuments,
    balance,
    balance_steps,
    route,
    split_documents,
    structural_bound,
)

__all__ = [
    "Assignment", "Bucket", "RoutedDocuments", "balance", "balance_steps", "route", "split_documents",
    "structural_bound",
]  # fmt: skip

"""A step's count of loss tokens, from the documents' metadata alone (no tokens).

Every micro-batch carries ``global_loss_tokens``: the labels that are not -100 over every DP
group and micro-batch of its step, so that a trainer normalises its loss by the same count on
every rank. A step's construction may be split over several blocks, so no constructor sees
the whole step; the dealer counts it from the pieces it cuts and what each read unit reported
(its records' :class:`~omniload_dask.batching.labels.Holes`, none for plain text)::

    piece (doc 0, tokens [0, 512))   plain text          511 loss tokens
    piece (doc 1, tokens [0, 300))   chat, holes [(0, 40), (120, 150)]
                                     targets among 1..299, less 39 + 30 -> 230
    the step's recipes carry 741; construction writes it into each micro-batch

Pure: no I/O and no Dask.
"""

from __future__ import annotations

import numpy as np

from omniload_dask.batching.labels import count_loss_tokens
from omniload_dask.core.draw import Documents

__all__ = ["step_loss_tokens"]


def step_loss_tokens(docs: Documents, doc: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> int:
    """Loss tokens of a step's pieces: piece i holds tokens ``[lo[i], hi[i])`` of document
    ``doc[i]`` of ``docs``. The sum of ``num_loss_tokens`` over the micro-batches built from
    them (every piece is counted on its own: its last token's label lies outside it)."""
    lo, hi = np.asarray(lo, dtype=np.int64), np.asarray(hi, dtype=np.int64)
    slot = docs.slot[doc]
    with_holes = [k for k, (unit, _) in enumerate(docs.slots) if unit.holes is not None]
    if not with_holes:
        return count_loss_tokens(lo, hi)
    masked = np.isin(slot, with_holes)
    total = count_loss_tokens(lo[~masked], hi[~masked])
    pieces = np.flatnonzero(masked)
    pieces = pieces[np.argsort(slot[pieces], kind="stable")]  # runs of one slot each
    keys = slot[pieces]
    edges = np.flatnonzero(np.diff(keys)) + 1
    for here in np.split(pieces, edges) if len(pieces) else []:
        unit, portion = docs.slots[int(slot[here[0]])]
        first = int(unit.bounds[portion]) if unit.bounds is not None else 0
        rows = first + docs.rows[doc[here]]
        total += count_loss_tokens(lo[here], hi[here], unit.holes, rows)
    return total

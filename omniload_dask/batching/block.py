"""What one construction task holds: a block's parts, their buffers in one array.

A block is the batches of ``groups_per_task`` DP groups for ``steps_per_task`` steps
(:mod:`omniload_dask.core.blocks`); part p is what one fetcher asks for (a group's batch, or
its context-parallel slice). Each part is packed as the workers serve it
(:func:`~omniload_dask.batching.wire.packed`), and :func:`shared_block` writes every part of a
block that packs straight into one array, once (:func:`~omniload_dask.batching.wire.
pack_together`), each part's buffer a view of it::

    parts {0: {step, group, micro, buffer -> shared[0:33112]},
           1: {step, group, micro, buffer -> shared[33112:66224]}, ...}

Why one array: a block moves between workers whole (its standby copy, a spill), pickled by
Dask, and Dask's comms put every out-of-band buffer in a frame of its own, at tens of
microseconds a frame on each side. A block at DP 8 dealt 16 steps at a time has 128 parts;
pickled part by part it went as 128 frames (3.4 ms to serialize in a probe, against 1.0 ms as
one). :meth:`BatchBlock.__reduce__` sends the shared array once, out of band, and each part's
span of it; the copy's parts view the received array. A part that does not pack (a
:class:`~omniload_dask.batching.formats.GroupBatch`) travels as itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from omniload_dask.batching.wire import is_packed, pack_together, split_parts

__all__ = ["BatchBlock", "shared_block"]


@dataclass
class BatchBlock:
    """The parts of one block (module doc) by part number: the block's i-th step's parts are
    numbered from ``i * stride``, and part ``i * stride + p`` is group ``p // cp``'s batch or
    its context-parallel slice ``p % cp`` (see :mod:`omniload_dask.core.keys`).

    ``nbytes`` is what Dask's ``sizeof`` reports of the block, worked out once by the task
    that built it (-1: not worked out, so ``sizeof`` walks the parts). Dask sizes a block on
    every holder several times (when it lands, when it is weighed for spilling, when its
    standby copy is sent), and walking a block of 128 packed parts costs about a millisecond.
    ``shared``: the array the packed parts' buffers view (None: each has its own).
    """

    parts: dict[int, Any]
    nbytes: int = -1
    shared: np.ndarray | None = None

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        spans = _spans(self)
        if spans is None:
            return (BatchBlock, (self.parts, self.nbytes, None))
        described = {
            p: {**{k: v for k, v in value.items() if k != "buffer"}, "span": spans[p]}
            if p in spans
            else value
            for p, value in self.parts.items()
        }
        return (_restore, (described, self.shared, self.nbytes))


def shared_block(parts: dict[int, Any]) -> BatchBlock:
    """A block of ``parts`` (batches, packed or not) with every part that packs written once
    into one read-only array, its buffer a view of it (module doc; :func:`~omniload_dask.
    batching.wire.pack_together`)."""
    numbers = list(parts)
    items, shared = pack_together([parts[p] for p in numbers])
    return BatchBlock(dict(zip(numbers, items, strict=True)), shared=shared)


def _spans(block: BatchBlock) -> dict[int, list[int]] | None:
    """Each packed part's span of the block's shared array; None where it has none or a
    packed part's buffer is not a view of it (the block then pickles part by part)."""
    shared = block.shared
    if shared is None:
        return None
    base = shared.__array_interface__["data"][0]
    spans: dict[int, list[int]] = {}
    for p, value in block.parts.items():
        if not is_packed(value):
            continue
        buffer = value["buffer"]
        if not isinstance(buffer, np.ndarray):
            return None
        lo = buffer.__array_interface__["data"][0] - base
        if lo < 0 or lo + buffer.nbytes > shared.nbytes:
            return None
        spans[p] = [lo, lo + buffer.nbytes]
    return spans


def _restore(described: dict[int, Any], shared: np.ndarray, nbytes: int) -> BatchBlock:
    """The block :meth:`BatchBlock.__reduce__` described: its packed parts view ``shared``."""
    shared = np.asarray(shared, dtype=np.uint8)
    shared.flags.writeable = False
    numbers = list(described)
    parts = split_parts([described[p] for p in numbers], shared)
    return BatchBlock(dict(zip(numbers, parts, strict=True)), nbytes, shared)

"""Sizes of shards and batches for Dask's memory accounting (``dask.sizeof``).

Read tasks return :class:`~omniload_dask.batching.formats.Shard` and construct tasks a
:class:`~omniload_dask.batching.block.BatchBlock` of
:class:`~omniload_dask.batching.formats.GroupBatch`: without these registrations Dask would
count each as a small Python object, and workers would hold far more memory than they report.
Importing this module registers them; :mod:`.tasks` (what workers import) and :mod:`.plugin`
import it.
"""

from __future__ import annotations

from dask.sizeof import sizeof

from omniload_dask.batching.block import BatchBlock
from omniload_dask.batching.formats import GroupBatch, Shard
from omniload_dask.batching.wire import batch_bytes

__all__ = ["block_bytes", "sizeof_batch", "sizeof_block", "sizeof_shard"]


@sizeof.register(Shard)
def sizeof_shard(shard: Shard) -> int:
    """Bytes of a shard's arrays (tokens, offsets, ids, images) plus a small overhead."""
    images = shard.images.nbytes if shard.images is not None else 0
    images += shard.target.nbytes if shard.target is not None else 0
    return int(shard.tokens.nbytes + shard.offsets.nbytes + shard.sample_ids.nbytes) + images + 256


@sizeof.register(GroupBatch)
def sizeof_batch(batch: GroupBatch) -> int:
    """Bytes of every array of every micro-batch, plus a small overhead per micro-batch
    (:func:`~omniload_dask.batching.wire.batch_bytes`, which decides what packs)."""
    return batch_bytes(batch)


@sizeof.register(BatchBlock)
def sizeof_block(block: BatchBlock) -> int:
    """Bytes of every part of a block (a :class:`GroupBatch`, or packed as workers serve it:
    Dask sizes its dict of a byte string, a buffer and two numbers); the block's own
    ``nbytes`` where its task worked it out (:func:`block_bytes`)."""
    return block.nbytes if block.nbytes >= 0 else block_bytes(block)


def block_bytes(block: BatchBlock) -> int:
    """What :func:`sizeof_block` reports of ``block``, walking every part."""
    return sum(sizeof(b) for b in block.parts.values()) + 64 * len(block.parts)

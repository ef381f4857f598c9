"""The functions that run on Dask workers: discover, read (+ tokenize), construct, slice.

They keep nothing between calls: a read task gets one unit, returns a :class:`Shard` that stays
in worker memory, and attaches the shard's sample lengths for the data plane to the task's
finished message. A construct task gets a :class:`Recipe` and the shards it names.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from . import _dask
from .batches import GroupBatch, Recipe, Shard, build
from .context_parallel import slice_batch
from .errors import RecordError
from .plan import SourceSpec, TokenizerSpec
from .preprocess.tokenize import describe, tokenize
from .sources import Catalog, discover_source, encode_sample_ids, read_unit_records

__all__ = ["check_tokenizer", "construct", "cp_slice", "discover", "read_unit"]

MAX_REASONS = 5


def discover(spec: SourceSpec) -> Catalog:
    """List one source's files and read units (start-up)."""
    return discover_source(spec)


def check_tokenizer(spec: TokenizerSpec) -> dict[str, Any]:
    """Load the tokenizer where the work will run; report vocabulary and special ids."""
    return describe(spec)


def read_unit(
    spec: SourceSpec,
    source_index: int,
    tokenizer: TokenizerSpec,
    on_error: str,
    file_index: int,
    file_url: str,
    start: int,
    stop: int,
) -> Shard:
    """Read and tokenize one unit; bad records raise or are skipped and counted (``on_error``)."""
    t0 = time.perf_counter()
    records = read_unit_records(spec, file_url, start, stop)
    t1 = time.perf_counter()
    bad = [
        f"source {spec.name!r}: file {file_url!r}: record at offset {offset}: {reason}"
        for offset, reason in records.bad
    ]
    if bad and on_error == "raise":
        raise RecordError(bad[0] + " (set on_error: skip to skip and count such records)")
    tokens, offsets = tokenize(tokenizer, records.texts)
    t2 = time.perf_counter()
    ids = encode_sample_ids(source_index, file_index, records.offsets)
    lengths = np.diff(offsets)
    empty = lengths == 0
    if empty.any():  # nothing to train on (empty text and no BOS/EOS): skip and count
        bad += [
            f"source {spec.name!r}: file {file_url!r}: record at offset {int(o)}: empty"
            for o in records.offsets[empty][:MAX_REASONS]
        ]
        keep = ~empty
        ids = ids[keep]
        offsets = np.concatenate([[0], np.cumsum(lengths[keep])]).astype(np.int64)
        lengths = lengths[keep]
    skipped = len(records.bad) + int(empty.sum())
    shard = Shard(
        source=source_index,
        tokens=tokens,
        offsets=offsets,
        sample_ids=ids,
        skipped=skipped,
        bad=bad[:MAX_REASONS],
    )
    _dask.set_task_metadata(
        {
            "lengths": lengths.astype(np.int32).tobytes(),
            "skipped": skipped,
            "bad": bad[:MAX_REASONS],
            "tokens": len(tokens),
            "records": len(records.texts) + len(records.bad),
            "read_seconds": t1 - t0,  # for monitoring: read+decode vs tokenize throughput
            "tokenize_seconds": t2 - t1,
        }
    )
    return shard


def construct(recipe: Recipe, *shards: Shard) -> GroupBatch:
    """Build one DP group's micro-batches for one step."""
    return build(recipe, list(shards))


def cp_slice(batch: GroupBatch, cp: int, rank: int) -> GroupBatch:
    """Context-parallel rank ``rank``'s slice of a constructed batch."""
    return slice_batch(batch, cp, rank)

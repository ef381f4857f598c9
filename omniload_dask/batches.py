"""What travels between tasks: shards (tokenized read units) and constructed batches.

A :class:`Shard` is the output of one read task and stays in worker memory until the data plane
releases it. A :class:`Recipe` is the data plane's instruction for one (step, DP group): which
token ranges of which shard rows go into which micro-batch. :func:`build` turns a recipe and its
shards into a :class:`GroupBatch` in the packed ("varlen") layout::

    documents a=[5 6 7], b=[8 9] packed in one micro-batch
    input_ids    [5 6 7 8 9]
    labels       [6 7 -100 9 -100]      next token inside the document, -100 at its end
    position_ids [0 1 2 0 1]
    cu_seqlens   [0 3 5]                 (int32)
    seq_len      the micro-batch's capacity (its context bucket's sequence length)

Both classes register with ``dask.sizeof`` so the cluster's memory accounting is right.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from dask.sizeof import sizeof

__all__ = ["IGNORE_INDEX", "GroupBatch", "Recipe", "Shard", "build"]

IGNORE_INDEX = -100


@dataclass
class Shard:
    """Tokenized records of one read unit, in file order."""

    source: int
    tokens: np.ndarray  # uint32, all documents concatenated
    offsets: np.ndarray  # int64, len(documents) + 1
    sample_ids: np.ndarray  # int64 global sample ids
    skipped: int = 0
    bad: list[str] = field(default_factory=list)  # the first few reasons, for messages

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def __len__(self) -> int:
        return len(self.sample_ids)


@dataclass(frozen=True)
class Recipe:
    """How to build one DP group's batch of one step.

    ``pieces`` rows are ``(micro_step, shard slot, row, token start, token stop)`` in output
    order; the shard slot indexes the shards passed to :func:`build`. Micro-step m holds up to
    ``micro_seq_lens[m]`` tokens (context buckets), or ``seq_len`` when that is empty.
    """

    step: int
    group: int
    num_micro_steps: int
    pieces: np.ndarray
    seq_len: int
    slot_epochs: tuple[int, ...] = ()  # the source epoch each shard slot was drawn in
    pad_to_seq_len: bool = False
    pad_id: int = 0
    micro_seq_lens: tuple[int, ...] = ()

    def capacity(self, micro_step: int) -> int:
        """Token capacity of micro-step ``micro_step``."""
        return self.micro_seq_lens[micro_step] if self.micro_seq_lens else self.seq_len


@dataclass
class GroupBatch:
    """The micro-batches of one DP group for one step (numpy arrays)."""

    step: int
    group: int
    micro_batches: list[dict[str, Any]]

    @property
    def num_tokens(self) -> int:
        return sum(int(mb["num_tokens"]) for mb in self.micro_batches)


@sizeof.register(Shard)
def _sizeof_shard(shard: Shard) -> int:
    return int(shard.tokens.nbytes + shard.offsets.nbytes + shard.sample_ids.nbytes) + 256


@sizeof.register(GroupBatch)
def _sizeof_batch(batch: GroupBatch) -> int:
    return sum(
        int(v.nbytes)
        for mb in batch.micro_batches
        for v in mb.values()
        if isinstance(v, np.ndarray)
    ) + 256 * len(batch.micro_batches)


def build(recipe: Recipe, shards: list[Shard]) -> GroupBatch:
    """Pack the recipe's document pieces into micro-batches (pure numpy, no I/O)."""
    micro_batches = []
    pieces = recipe.pieces
    for m in range(recipe.num_micro_steps):
        rows = pieces[pieces[:, 0] == m]
        micro_batches.append(_micro_batch(recipe, m, rows, shards))
    return GroupBatch(step=recipe.step, group=recipe.group, micro_batches=micro_batches)


def _micro_batch(recipe: Recipe, m: int, rows: np.ndarray, shards: list[Shard]) -> dict[str, Any]:
    n = len(rows)
    lengths = (rows[:, 4] - rows[:, 3]).astype(np.int64)
    cu = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(lengths, out=cu[1:])
    total = int(cu[-1])
    width = recipe.capacity(m) if recipe.pad_to_seq_len else total
    input_ids = np.full(width, recipe.pad_id, dtype=np.int64)
    doc_source = np.empty(n, dtype=np.int32)
    doc_id = np.empty(n, dtype=np.int64)
    doc_epoch = np.zeros(n, dtype=np.int32)
    for j, (_, slot, row, lo, hi) in enumerate(rows.tolist()):
        shard = shards[slot]
        base = int(shard.offsets[row])
        input_ids[cu[j] : cu[j + 1]] = shard.tokens[base + lo : base + hi]
        doc_source[j] = shard.source
        doc_id[j] = shard.sample_ids[row]
        if recipe.slot_epochs:
            doc_epoch[j] = recipe.slot_epochs[slot]
    starts = np.repeat(cu[:-1].astype(np.int64), lengths)
    position_ids = np.zeros(width, dtype=np.int64)
    position_ids[:total] = np.arange(total, dtype=np.int64) - starts
    labels = np.full(width, IGNORE_INDEX, dtype=np.int64)
    if total:
        labels[: total - 1] = input_ids[1:total]
        labels[cu[1:] - 1] = IGNORE_INDEX
    return {
        "input_ids": input_ids,
        "labels": labels,
        "position_ids": position_ids,
        "cu_seqlens": cu,
        "max_seqlen": int(lengths.max()) if n else 0,
        "num_tokens": total,
        "doc_source": doc_source,
        "doc_id": doc_id,
        "doc_offset": rows[:, 3].astype(np.int64),
        "doc_epoch": doc_epoch,
        "seq_len": recipe.capacity(m),
        "step": recipe.step,
        "micro_step": m,
        "num_micro_steps": recipe.num_micro_steps,
        "dp_rank": recipe.group,
    }

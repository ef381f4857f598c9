"""Megatron-Core / Transformer Engine: a micro-batch in TE's packed "THD" layout.

TE's fused attention over packed sequences takes the tokens of one rank concatenated, the
documents' boundaries ``cu_seqlens`` and, where documents were padded, ``cu_seqlens_padded``.
With context parallelism (cp > 1) every document must be padded to a multiple of ``2*cp`` and
cut the way TE cuts it: each padded document in ``2*cp`` equal chunks, cp rank ``r`` taking
chunks ``r`` and ``2*cp-1-r`` (so causal work is even), all documents' pieces concatenated.
Worked example, cp = 2, documents of 5 and 3 tokens::

    padded to 8 and 4      cu_seqlens [0, 5, 8]    cu_seqlens_padded [0, 8, 12]
    doc 0: a0..a4 p p p    chunks [a0 a1] [a2 a3] [a4 p] [p p]
    doc 1: b0 b1 b2 p      chunks [b0] [b1] [b2] [p]
    cp rank 0: a0 a1 p p b0 p          cp rank 1: a2 a3 a4 p b1 b2

Boundaries stay global (the whole micro-batch's), as TE expects. Padding is never a target
(``labels`` -100, ``loss_mask`` 0) and its count is returned (``num_padding``). For CUDA graphs,
which need fixed shapes, ``fixed_tokens`` pads the micro-batch to a fixed token count (the tail
joins the last document's padding) and ``fixed_docs`` repeats the last boundary to a fixed
number of documents. The feeder must give whole micro-batches (the job's ``cp`` = 1; its own cp
slices are unpadded zigzag pieces): give each cp rank of a Megatron group its own feeder rank
by starting the job with ``tp`` = tp * cp, so they all read the same micro-batch.

Only torch is needed; ``megatron-core`` is not imported (``packed_seq_params`` makes its
``PackedSeqParams`` where it is installed).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from omniload_dask.errors import JobError

__all__ = ["packed_seq_params", "thd_batch", "thd_partition_index"]


def thd_partition_index(
    cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int
) -> torch.Tensor:
    """The token indices cp rank ``cp_rank`` holds of a padded packed batch (TE's partition)."""
    pieces = []
    bounds = [int(x) for x in cu_seqlens_padded]
    for start, end in itertools.pairwise(bounds):
        chunk = (end - start) // (2 * cp_size)
        for c in (cp_rank, 2 * cp_size - 1 - cp_rank):
            pieces.append(torch.arange(start + c * chunk, start + (c + 1) * chunk))
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)


def thd_batch(
    mb: dict[str, Any],
    *,
    cp_size: int = 1,
    cp_rank: int = 0,
    pad_multiple: int | None = None,
    capacity: int | None = None,
    fixed_tokens: int | None = None,
    fixed_docs: int | None = None,
    pad_id: int = 0,
) -> dict[str, Any]:
    """``mb`` (a whole feeder micro-batch, torch) in TE's THD layout for cp rank ``cp_rank``.

    Each document is padded to a multiple of ``pad_multiple`` (default ``2*cp_size`` when
    ``cp_size > 1``, else none). ``capacity`` (default: the micro-batch's ``seq_len``) bounds
    the padded token count: a micro-batch whose padding does not fit is an error naming both.
    Returns ``tokens``, ``labels``, ``loss_mask``, ``position_ids`` (this rank's slice, one
    row), ``cu_seqlens``, ``cu_seqlens_padded`` (int32), ``max_seqlen`` and ``num_padding``.
    """
    if int(mb.get("cp_size", 1)) > 1:
        raise JobError(
            "thd_batch: this micro-batch is already the feeder's cp slice (unpadded zigzag "
            "pieces); start the job with cp=1 (tp = tp*cp) and let thd_batch cut TE's slices"
        )
    if not 0 <= cp_rank < cp_size:
        raise JobError(f"thd_batch: cp_rank must be in 0..{cp_size - 1}, got {cp_rank}")
    multiple = pad_multiple or (2 * cp_size if cp_size > 1 else 1)
    if cp_size > 1 and multiple % (2 * cp_size):
        raise JobError(
            f"thd_batch: pad_multiple {multiple} is not a multiple of 2*cp = {2 * cp_size}"
        )
    cu = mb["cu_seqlens"].long()
    lengths = cu[1:] - cu[:-1]
    padded = (lengths + multiple - 1) // multiple * multiple
    total = int(padded.sum())
    limit = fixed_tokens if fixed_tokens is not None else capacity or int(mb.get("seq_len", total))
    if total > limit:
        raise JobError(
            f"thd_batch: step {mb.get('step')} micro-batch {mb.get('micro_step')}: padding "
            f"{len(lengths)} documents to multiples of {multiple} gives {total} tokens, more than "
            f"{'fixed_tokens' if fixed_tokens is not None else 'the capacity'} {limit}; plan a "
            "smaller seq_len for the loader than the model's, or fewer documents per micro-batch"
        )
    if fixed_tokens is not None:
        if fixed_tokens % multiple:
            raise JobError(
                f"thd_batch: fixed_tokens {fixed_tokens} is not a multiple of {multiple}"
            )
        if len(padded):
            padded[-1] += fixed_tokens - total  # the tail is the last document's padding
            total = fixed_tokens
    cu_padded = torch.cat([torch.zeros(1, dtype=torch.long), padded.cumsum(0)])
    tokens = torch.full((total,), pad_id, dtype=mb["input_ids"].dtype)
    labels = torch.full((total,), -100, dtype=mb["labels"].dtype)
    positions = torch.zeros(total, dtype=mb["position_ids"].dtype)
    loss_mask = torch.zeros(total, dtype=torch.float32)
    for i in range(len(lengths)):
        src = slice(int(cu[i]), int(cu[i + 1]))
        dst = slice(int(cu_padded[i]), int(cu_padded[i]) + int(lengths[i]))
        tokens[dst], labels[dst] = mb["input_ids"][src], mb["labels"][src]
        positions[int(cu_padded[i]) : int(cu_padded[i + 1])] = torch.arange(
            int(mb["position_ids"][src][0]) if lengths[i] else 0,
            (int(mb["position_ids"][src][0]) if lengths[i] else 0) + int(padded[i]),
        )
        loss_mask[dst] = (mb["labels"][src] != -100).float()
    if cp_size > 1:
        index = thd_partition_index(cu_padded, cp_size, cp_rank)
        tokens, labels, positions, loss_mask = (
            t[index] for t in (tokens, labels, positions, loss_mask)
        )
    cu_out, cu_pad_out = cu, cu_padded
    if fixed_docs is not None:
        if len(lengths) > fixed_docs:
            raise JobError(
                f"thd_batch: {len(lengths)} documents, more than fixed_docs {fixed_docs}"
            )
        grow = fixed_docs - len(lengths)
        cu_out = torch.cat([cu, cu[-1:].repeat(grow)])
        cu_pad_out = torch.cat([cu_padded, cu_padded[-1:].repeat(grow)])
    return {
        "tokens": tokens[None],
        "labels": labels[None],
        "loss_mask": loss_mask[None],
        "position_ids": positions[None],
        "cu_seqlens": cu_out.to(torch.int32),
        "cu_seqlens_padded": cu_pad_out.to(torch.int32),
        "max_seqlen": int(padded.max()) if len(padded) else 0,
        "num_padding": int(total - int(lengths.sum())),
    }


def packed_seq_params(batch: dict[str, Any]) -> Any:
    """Megatron-Core's ``PackedSeqParams`` for a :func:`thd_batch` result (imports megatron)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=batch["cu_seqlens"],
        cu_seqlens_kv=batch["cu_seqlens"],
        cu_seqlens_q_padded=batch["cu_seqlens_padded"],
        cu_seqlens_kv_padded=batch["cu_seqlens_padded"],
        max_seqlen_q=batch["max_seqlen"],
        max_seqlen_kv=batch["max_seqlen"],
    )

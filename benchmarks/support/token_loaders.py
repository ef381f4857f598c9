"""The baselines of ``tokens.py``, each as its users run it in every trainer rank.

``make_loader(spec, plan, go)`` (called by ``head_to_head.role_rank`` in a rank process) returns
an iterable of packed micro-batches (``cu_seqlens``, ``num_tokens``, ``step``, ``micro_step``)
and a ``close()``:

- ``megatron``: Megatron-Core's ``GPTDataset`` per source and ``BlendedDataset`` over them (built
  by ``BlendedMegatronDatasetBuilder``, its compiled helpers; indices cached by ``tokens.py``
  before the timed runs), read through a ``DataLoader`` with W workers, rank r taking samples
  r, r + R, ... as Megatron's pretraining sampler does with one sample per micro-batch. A
  sample is ``seq_len`` tokens across document boundaries; its pieces are cut at the EOS id.
- ``litdata``: LitData's ``CombinedStreamingDataset`` of one ``StreamingDataset`` per source
  over ``TokensLoader`` chunks (blocks of ``seq_len + 1`` tokens, as litgpt pretrains), weighted
  as the plan, ``StreamingDataLoader`` with W workers; torch.distributed (gloo) tells it the rank.
- ``mosaic_tokens``: MosaicML Streaming over the MDS token copy (a ``Stream`` per source with the
  plan's proportions), documents packed in the rank into ``seq_len`` blocks (concat and chunk).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np

__all__ = ["make_loader"]


def _steps(blocks: Iterator[dict[str, Any]], micro: int) -> Iterator[dict[str, Any]]:
    for count, block in enumerate(blocks):
        step, m = divmod(count, micro)
        yield {**block, "step": step, "micro_step": m, "num_micro_steps": micro}


def _cut_at(tokens: np.ndarray, eos: int) -> dict[str, Any]:
    """A fixed-length sample as pieces: each ends at an EOS (or the sample's end)."""
    ends = np.flatnonzero(tokens == eos) + 1
    cuts = np.unique(np.concatenate([[0], ends, [len(tokens)]]))
    return {"cu_seqlens": cuts.astype(np.int32), "num_tokens": len(tokens)}


class _Loader:
    def __init__(self, loader: Any, blocks: Any, micro: int) -> None:
        self.loader, self.blocks, self.micro = loader, blocks, micro
        self._it: Any = None

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return _steps(self.blocks(self), self.micro)

    def close(self) -> None:
        shutdown = getattr(self._it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()


def megatron_dataset(extra: dict[str, Any], seed: int, seq_len: int, samples: int) -> Any:
    """The BlendedDataset of the token corpus (``extra``: prefixes, weights, cache, eos)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    class Tok:  # what GPTDataset asks of a tokenizer
        def __init__(self, eod: int, vocab: int) -> None:
            self.eod, self.pad, self.vocab_size = eod, -1, vocab
            self.unique_identifiers = {"class": "benchmark", "eod": eod, "vocab": vocab}

    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_len,
        blend=(list(extra["prefixes"]), list(extra["weights"])),
        split="100,0,0",
        path_to_cache=extra["cache"],
        tokenizer=Tok(extra["eos"], extra["vocab"]),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        # No dense [1, L, L] mask per sample: users with flash / TE attention build the causal
        # mask on the device (Megatron-LM's --no-create-attention-mask-in-dataloader, which
        # training scripts with those kernels commonly pass). With it, every sample carries L*L bytes (64 MiB at
        # L = 8192) through the DataLoader's shared memory, which is a set-up artefact, not
        # its reading path.
        create_attention_mask=False,
    )
    built = BlendedMegatronDatasetBuilder(GPTDataset, [samples, 0, 0], lambda: True, config)
    return built.build()[0]


def warm_up(system: str) -> None:
    """The imports a training script makes at its top, before it asks for data (so that the
    first batch counts the loader's start, not Python importing Megatron-Core)."""
    import torch
    import torch.utils.data  # noqa: F401

    if system == "megatron":
        import megatron.core.datasets.blended_megatron_dataset_builder
        import megatron.core.datasets.gpt_dataset  # noqa: F401
    elif system == "litdata":
        import litdata  # noqa: F401
    elif system == "mosaic_tokens":
        from support.baselines import import_streaming

        import_streaming()


def make_loader(spec: dict[str, Any], plan: Any, go: dict[str, Any]) -> Any:
    import torch
    from torch.utils.data import DataLoader

    system, rank, world = spec["system"], spec["rank"], plan.layout.dp
    workers, seq_len, micro = spec["workers"], plan.batch.seq_len, plan.batch.micro_batches
    extra = spec["tokens"]
    pool: dict[str, Any] = {"prefetch_factor": 2, "multiprocessing_context": "fork"}
    if system in ("megatron", "litdata") and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    if system == "megatron":
        dataset = megatron_dataset(extra, plan.seed, seq_len, extra["samples"])
        indices = list(range(rank, len(dataset), world))
        loader = DataLoader(dataset, batch_size=None, sampler=indices, num_workers=workers, **pool)

        def megatron_blocks(self: _Loader) -> Iterator[dict[str, Any]]:
            while True:  # (the next pass over its samples: a new epoch of the blend)
                self._it = iter(loader)
                for sample in self._it:
                    yield _cut_at(np.asarray(sample["tokens"]), extra["eos"])

        return _Loader(loader, megatron_blocks, micro)
    if system == "litdata":
        import litdata

        total = sum(extra["weights"])
        parts = [
            litdata.StreamingDataset(
                d,
                item_loader=litdata.TokensLoader(block_size=seq_len + 1),
                shuffle=True,
                seed=plan.seed,
            )
            for d in extra["litdata"]
        ]
        combined = litdata.CombinedStreamingDataset(
            parts, seed=plan.seed, weights=[w / total for w in extra["weights"]],
            iterate_over_all=False,
        )  # fmt: skip
        loader = litdata.StreamingDataLoader(combined, batch_size=1, num_workers=workers)

        def litdata_blocks(self: _Loader) -> Iterator[dict[str, Any]]:
            while True:
                self._it = iter(loader)
                for batch in self._it:
                    yield _cut_at(np.asarray(batch[0][:seq_len]), extra["eos"])

        return _Loader(loader, litdata_blocks, micro)
    if system == "mosaic_tokens":
        from support.baselines import ChunkPacker, import_streaming

        streaming, _ = import_streaming()
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()
        total = sum(extra["weights"])
        streams = [streaming.Stream(local=d, proportion=w / total)
                   for d, w in zip(extra["mds"], extra["weights"], strict=True)]  # fmt: skip
        dataset = streaming.StreamingDataset(streams=streams, shuffle=True,
                                             shuffle_seed=plan.seed, batch_size=16)  # fmt: skip
        loader = DataLoader(dataset, batch_size=16, num_workers=workers, collate_fn=list, **pool)

        def mosaic_blocks(self: _Loader) -> Iterator[dict[str, Any]]:
            packer = ChunkPacker(seq_len)
            while True:
                self._it = iter(loader)
                for docs in self._it:
                    for doc in docs:
                        yield from packer.add(np.asarray(doc["tokens"]))

        return _Loader(loader, mosaic_blocks, micro)
    raise ValueError(f"unknown system {system!r}")


def world_env(rank: int, world: int, port: int) -> dict[str, str]:
    """What torchrun sets for a rank (Streaming and LitData's torch.distributed read it)."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}  # fmt: skip

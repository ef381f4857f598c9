"""Baselines (a) and (c) of the head-to-head benchmark, set up the way their users run them.

(a) ``PerRankLoader``: one torch DataLoader per rank over a mixing IterableDataset::

    rank r of R: DataLoader(MixingDataset, num_workers=W, fork); the tokenizer is loaded in the
    rank before the workers fork (they share its pages)
      worker w: for every source, files[r::R][w::W] read and tokenized in chunks (the reader of
        rank_local.SourceShard); documents drawn from the sources by the plan's weights
        (weighted fair, by documents or tokens as the plan says), concatenated and cut into
        seq_len blocks ("concat and chunk": a document may continue in the next block); each
        block is a packed micro-batch (input_ids, labels, position_ids, cu_seqlens)

(c) ``MosaicLoader``: MosaicML Streaming over the corpus converted to MDS (``write_mds``, in the
preparation phase), one Stream per source with the plan's weights as proportions (documents),
a ``StreamingDataset`` whose ``__getitem__`` tokenizes the sample (tokenizer loaded in the rank
before the workers fork), a torch DataLoader with W workers, and the same concat-and-chunk
packing in the rank. Rank and world come from the RANK / WORLD_SIZE / LOCAL_* and MASTER_*
variables, as under torchrun (Streaming joins the ranks through torch.distributed, gloo here). ``import_streaming`` stubs what the package imports but this benchmark cannot
load (the vision and text dataset zoos need torchvision and transformers; the DataLoader module
imports two transformers batch classes for isinstance checks) and says which it stubbed.

Both yield micro-batches as dicts with ``cu_seqlens``, ``num_tokens``, ``step``, ``micro_step``,
``num_micro_steps`` (torch tensors where the DataLoader converts them).
"""

from __future__ import annotations

import itertools
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import DataLoader, IterableDataset

from omniload_dask.plan import Plan
from omniload_dask.preprocess.tokenize import load_tokenizer, tokenize
from support.rank_local import SourceShard, shard_files

__all__ = ["ChunkPacker", "MixingDataset", "MosaicLoader", "PerRankLoader", "import_streaming",
           "write_mds"]  # fmt: skip

IGNORE_INDEX = -100


class ChunkPacker:
    """Concat and chunk: documents appended to a buffer, cut into ``seq_len`` blocks."""

    def __init__(self, seq_len: int) -> None:
        self.seq_len = seq_len
        self.parts: list[np.ndarray] = []
        self.size = 0

    def add(self, tokens: np.ndarray) -> Iterator[dict[str, Any]]:
        """Add one document; yield every block it completes."""
        while len(tokens):
            take = tokens[: self.seq_len - self.size]
            self.parts.append(take)
            self.size += len(take)
            tokens = tokens[len(take) :]
            if self.size == self.seq_len:
                yield self._block()

    def _block(self) -> dict[str, Any]:
        lengths = np.fromiter(map(len, self.parts), dtype=np.int64, count=len(self.parts))
        cu = np.zeros(len(lengths) + 1, dtype=np.int32)
        np.cumsum(lengths, out=cu[1:])
        ids = np.concatenate(self.parts).astype(np.int64)
        position_ids = np.arange(len(ids), dtype=np.int64) - np.repeat(cu[:-1], lengths)
        labels = np.full(len(ids), IGNORE_INDEX, dtype=np.int64)
        labels[:-1] = ids[1:]
        labels[cu[1:] - 1] = IGNORE_INDEX
        self.parts, self.size = [], 0
        return {"input_ids": ids, "labels": labels, "position_ids": position_ids,
                "cu_seqlens": cu, "num_tokens": len(ids)}  # fmt: skip


class _Fair:
    """Weighted-fair choice of the next source: the one furthest behind its share."""

    def __init__(self, weights: list[float], by: str) -> None:
        self.weights = np.asarray(weights, dtype=np.float64)
        self.taken = np.zeros(len(weights))
        self.by = by

    def next(self) -> int:
        live = self.weights > 0
        lag = np.where(live, self.taken / np.where(live, self.weights, 1), np.inf)
        return int(np.argmin(lag))

    def took(self, source: int, tokens: int) -> None:
        self.taken[source] += tokens if self.by == "tokens" else 1


class MixingDataset(IterableDataset):
    """Baseline (a)'s dataset: every worker reads all sources, mixes and packs (module doc)."""

    def __init__(self, plan: Plan, rank: int, world: int) -> None:
        super().__init__()
        self.plan = plan
        self.shards = [
            SourceShard(i, s, shard_files(s, rank, world), plan.tokenizer, plan.seed, rank)
            for i, s in enumerate(plan.sources)
        ]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        chunks = [iter(shard) for shard in self.shards]  # each shards its files by worker
        pending: list[list[np.ndarray]] = [[] for _ in self.shards]
        fair = _Fair([s.weight for s in self.plan.sources], self.plan.mixing_by)
        packer = ChunkPacker(self.plan.batch.seq_len)
        while True:
            s = fair.next()
            if not pending[s]:
                chunk = next(chunks[s])
                tokens, offsets = chunk["tokens"], chunk["offsets"]
                pending[s] = [tokens[a:b] for a, b in itertools.pairwise(offsets)]
                pending[s].reverse()
            doc = pending[s].pop()
            fair.took(s, len(doc))
            yield from packer.add(doc)


class _Steps:
    """Numbers a stream of micro-batches into steps of ``micro`` micro-batches."""

    def __init__(self, blocks: Iterator[dict[str, Any]], micro: int, rank: int) -> None:
        self.blocks, self.micro, self.rank = blocks, micro, rank
        self.count = 0

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for block in self.blocks:
            step, m = divmod(self.count, self.micro)
            self.count += 1
            yield {**block, "step": step, "micro_step": m, "num_micro_steps": self.micro,
                   "dp_rank": self.rank}  # fmt: skip


class PerRankLoader:
    """Baseline (a): ``for mb in PerRankLoader(plan, rank, world, workers=2): ...``."""

    def __init__(self, plan: Plan, rank: int, world: int, workers: int = 2) -> None:
        load_tokenizer(plan.tokenizer)  # once, in the rank, before the workers fork
        self.plan, self.rank = plan, rank
        pool = {"prefetch_factor": 2, "multiprocessing_context": "fork"} if workers else {}
        self.loader = DataLoader(MixingDataset(plan, rank, world), batch_size=None,
                                 num_workers=workers, **pool)  # fmt: skip
        self._it: Any = None

    def __iter__(self) -> Iterator[dict[str, Any]]:
        self._it = iter(self.loader)
        return iter(_Steps(self._it, self.plan.batch.micro_batches, self.rank))

    def close(self) -> None:
        shutdown = getattr(self._it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()


# ------------------------------------------------------------------ MosaicML Streaming
def import_streaming() -> tuple[Any, list[str]]:
    """``streaming``, and what had to be stubbed for it to import here (see module doc)."""
    stubbed: list[str] = []
    for name, needs in (("streaming.vision", "torchvision"), ("streaming.text", "transformers"),
                        ("streaming.multimodal", "torchvision")):  # fmt: skip
        try:
            __import__(needs)
        except ImportError:
            sys.modules[name] = types.ModuleType(name)
            stubbed.append(f"{name} (its import needs {needs}, not installed)")
    try:
        import transformers  # noqa: F401
    except ImportError:
        root = types.ModuleType("transformers")
        root.__path__ = []  # a package, so that submodules resolve
        sys.modules["transformers"] = root
        for sub, cls in (("feature_extraction_utils", "BatchFeature"),
                         ("tokenization_utils_base", "BatchEncoding")):  # fmt: skip
            mod = types.ModuleType(f"transformers.{sub}")
            setattr(mod, cls, type(cls, (dict,), {}))
            sys.modules[mod.__name__] = mod
            setattr(root, sub, mod)
        stubbed.append("transformers.BatchFeature/BatchEncoding (StreamingDataLoader's "
                       "isinstance checks; transformers not installed)")  # fmt: skip
    import streaming

    return streaming, stubbed


def write_mds(texts: Iterator[str], out: Path, shard_bytes: int = 1 << 23) -> int:
    """Write ``texts`` as an MDS dataset (one ``text`` column) under ``out``; returns count."""
    streaming, _ = import_streaming()
    n = 0
    with streaming.MDSWriter(out=str(out), columns={"text": "str"}, compression=None,
                             size_limit=shard_bytes) as writer:  # fmt: skip
        for text in texts:
            writer.write({"text": text})
            n += 1
    return n


class MosaicLoader:
    """Baseline (c): ``for mb in MosaicLoader(plan, mds_dirs, workers=2): ...`` (module doc)."""

    def __init__(self, plan: Plan, mds: list[str], workers: int = 2, batch_docs: int = 16,
                 rank: int = 0) -> None:  # fmt: skip
        streaming, self.stubbed = import_streaming()
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()  # every rank: it synchronises them (torch.distributed)
        spec = plan.tokenizer
        load_tokenizer(spec)  # once, in the rank, before the workers fork
        total = sum(s.weight for s in plan.sources)

        class Tokenized(streaming.StreamingDataset):
            def __getitem__(self, idx: int) -> np.ndarray:
                text = super().__getitem__(idx)["text"]
                return tokenize(spec, [text])[0]

        streams = [streaming.Stream(local=d, proportion=s.weight / total)
                   for d, s in zip(mds, plan.sources, strict=True)]  # fmt: skip
        self.dataset = Tokenized(streams=streams, shuffle=True, shuffle_seed=plan.seed,
                                 batch_size=batch_docs)  # fmt: skip
        self.loader = DataLoader(self.dataset, batch_size=batch_docs, num_workers=workers,
                                 prefetch_factor=2, collate_fn=list,
                                 multiprocessing_context="fork")  # fmt: skip
        self.plan, self.rank = plan, rank
        self._it: Any = None

    def _blocks(self) -> Iterator[dict[str, Any]]:
        packer = ChunkPacker(self.plan.batch.seq_len)
        while True:
            self._it = iter(self.loader)
            for docs in self._it:
                for doc in docs:
                    yield from packer.add(np.asarray(doc))

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(_Steps(self._blocks(), self.plan.batch.micro_batches, self.rank))

    def close(self) -> None:
        shutdown = getattr(self._it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()

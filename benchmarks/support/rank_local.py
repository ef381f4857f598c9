"""The per-rank DataLoader baseline: every trainer rank loads, mixes and packs its own stream.

This is the rank-local design that omniload-dask replaces, written as a competent team would
ship it, from the same plan (sources, weights, tokenizer, seq_len, micro-batches)::

    rank r of R (its own process)
      source 0: sorted files, rank r's shard = files[r::R]
        DataLoader, W worker processes (fork): worker w streams files[r::R][w::W] with the
        file kept open, tokenizes ~chunk_tokens at a time, yields numpy chunks
      source 1 ... S-1: the same, one DataLoader each (S * W worker processes per rank)
      rank process: documents cut into pieces of at most seq_len, drawn with the data plane's
        weighted-fair rule (omniload_dask.batching.mixing.Mixer, by the plan's mixing.by) up to the rank's share of
        the plan's token budget (by default micro * seq_len) per step, packed first fit in stream order (a piece that fits nowhere is cut
        to fill), built into the packed layout: input_ids, labels, position_ids, cu_seqlens

Every epoch a worker reshuffles the order of its files (seeded); records come in file order.
Tokens come from the same tokenizer code as the loader's read tasks
(``omniload_dask.preprocess.tokenize``), so both systems deliver the same kind of tokens. Each
worker loads the tokenizer when it first tokenizes (``tokenizer_in="worker"``, a copy per
worker), or the rank loads it before its workers fork (``"rank"``: the workers share its pages
until they write to them).

File-access state (:func:`RankLocalLoader.state_bytes`) is what the loader keeps between reads
to know which files to read and where it is in them, summed over the rank and its workers:
file lists, the epoch's file order and the cursor (Python object sizes, recursive), open
handles with their read buffers (the buffer size they were opened with), zstd decompression
contexts (``ZstdDecompressor.memory_size()``) and Parquet footers held open
(``FileMetaData.serialized_size``, a lower bound of their parsed size). Token buffers and the
tokenizer are not in it (they show in the memory figures).
"""

from __future__ import annotations

import glob
import io
import json
import multiprocessing
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from omniload_dask.batching.mixing import Mixer, NeedMore
from omniload_dask.plan import Plan, SourceSpec, TokenizerSpec
from omniload_dask.plan.cost import CostModel
from omniload_dask.preprocess.tokenize import load_tokenizer, tokenize
from support.accounting import deep_sizeof

__all__ = ["RankLocalLoader", "SourceShard", "shard_files", "step_cost"]

IGNORE_INDEX = -100
READ_BUFFER = io.DEFAULT_BUFFER_SIZE  # what open() gives a streaming reader by default
ZSTD_READ_SIZE = 1 << 17  # zstandard's recommended input chunk for stream_reader


def shard_files(spec: SourceSpec, rank: int, world: int) -> list[str]:
    """Rank ``rank``'s own files of a source: every ``world``-th of the sorted list."""
    files = sorted({f for pattern in spec.paths for f in glob.glob(pattern)})
    if len(files) < world:
        raise ValueError(
            f"source {spec.name!r}: {len(files)} files for {world} ranks; a rank-local "
            "loader needs at least one file per rank"
        )
    return files[rank::world]


def step_cost(cost: CostModel, micro_batches: list[dict[str, Any]]) -> float:
    """Modelled cost of one rank's step: every packed piece of every micro-batch."""
    total = 0.0
    for mb in micro_batches:
        cu = np.asarray(mb["cu_seqlens"], dtype=np.int64)
        total += float(cost(np.diff(cu)).sum())
    return total


# ------------------------------------------------------------------ worker side
class _Cursor:
    """Where one DataLoader worker is: its files, this epoch's order, and the open handle."""

    def __init__(self, files: list[str]) -> None:
        self.files = files
        self.epoch = 0
        self.order = np.arange(len(files))
        self.position = 0  # index into order
        self.records = 0  # records read from the open file
        self.handle_bytes = 0  # buffers and contexts of the open handle (see module docstring)
        self.open_files = 0

    def state_bytes(self) -> int:
        return deep_sizeof(self) + self.handle_bytes


class SourceShard(IterableDataset):
    """The iterable a source's DataLoader runs in each of its workers (``torch`` Dataset API).

    Yields dicts of numpy arrays: ``tokens`` (uint32, documents concatenated, with BOS/EOS),
    ``offsets`` (int64, documents + 1), plus ``source``, ``worker`` and the worker's
    ``state_bytes`` and ``open_files`` at that moment. Endless: epochs follow one another.
    """

    def __init__(
        self,
        source: int,
        spec: SourceSpec,
        files: list[str],
        tokenizer: TokenizerSpec,
        seed: int,
        rank: int,
        chunk_tokens: int = 8192,
    ) -> None:
        super().__init__()
        self.source = source
        self.spec = spec
        self.files = files
        self.tokenizer = tokenizer
        self.seed = seed
        self.rank = rank
        self.chunk_tokens = chunk_tokens
        self.produced: Any = None  # shared counters (set by the rank before its workers fork)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        cursor = _Cursor(self.files[wid::nw])
        if not cursor.files:
            return
        # ~6 bytes of text per token here; tokenize in batches of about chunk_tokens
        chunk_chars = 6 * self.chunk_tokens
        while True:
            rng = np.random.default_rng([self.seed, self.source, self.rank, wid, cursor.epoch])
            cursor.order = rng.permutation(len(cursor.files))
            for position in range(len(cursor.files)):
                cursor.position = position
                path = cursor.files[int(cursor.order[position])]
                texts: list[str] = []
                chars = 0
                for text in self._records(path, cursor):
                    texts.append(text)
                    chars += len(text)
                    if chars >= chunk_chars:
                        yield self._chunk(texts, wid, cursor)
                        texts, chars = [], 0
                if texts:
                    yield self._chunk(texts, wid, cursor)
            cursor.epoch += 1

    def _chunk(self, texts: list[str], wid: int, cursor: _Cursor) -> dict[str, Any]:
        tokens, offsets = tokenize(self.tokenizer, texts)
        if self.produced is not None:
            self.produced[wid] += len(tokens)
        return {
            "source": self.source,
            "worker": wid,
            "tokens": tokens,
            "offsets": offsets,
            "state_bytes": cursor.state_bytes(),
            "open_files": cursor.open_files,
        }

    def _records(self, path: str, cursor: _Cursor) -> Iterator[str]:
        cursor.records = 0
        if self.spec.format == "parquet":
            yield from self._parquet(path, cursor)
        else:
            yield from self._jsonl(path, cursor)

    def _jsonl(self, path: str, cursor: _Cursor) -> Iterator[str]:
        field = self.spec.text
        with open(path, "rb", buffering=READ_BUFFER) as raw:
            cursor.open_files = 1
            cursor.handle_bytes = READ_BUFFER + sys.getsizeof(raw)
            if path.endswith(".zst"):
                import zstandard

                dctx = zstandard.ZstdDecompressor()
                lines: Any = io.BufferedReader(
                    dctx.stream_reader(raw, read_size=ZSTD_READ_SIZE), buffer_size=READ_BUFFER
                )
                first = True
            else:
                lines, first = raw, False
            try:
                for line in lines:
                    if first:  # the context has its window now
                        cursor.handle_bytes += dctx.memory_size() + ZSTD_READ_SIZE + READ_BUFFER
                        first = False
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except ValueError:
                        continue  # a bad record is skipped (the plan's on_error: skip)
                    text = record.get(field) if isinstance(record, dict) else None
                    if isinstance(text, str):
                        cursor.records += 1
                        yield text
            finally:
                cursor.open_files, cursor.handle_bytes = 0, 0

    def _parquet(self, path: str, cursor: _Cursor) -> Iterator[str]:
        import pyarrow.parquet as pq

        with pq.ParquetFile(path) as pf:
            cursor.open_files = 1
            cursor.handle_bytes = int(pf.metadata.serialized_size)
            try:
                for group in range(pf.num_row_groups):
                    column = pf.read_row_group(group, columns=[self.spec.text]).column(0)
                    for text in column.to_pylist():
                        if isinstance(text, str):
                            cursor.records += 1
                            yield text
            finally:
                cursor.open_files, cursor.handle_bytes = 0, 0


def _identity(item: Any) -> Any:  # keep numpy arrays as they are (no tensor conversion)
    return item


# ------------------------------------------------------------------ rank side
class _Pending:
    """One source's upcoming pieces (at most seq_len tokens each) and the chunks they are in."""

    def __init__(self) -> None:
        self.lengths = np.zeros(0, np.int64)
        self.chunk = np.zeros(0, np.int64)
        self.start = np.zeros(0, np.int64)
        self.chunks: dict[int, np.ndarray] = {}
        self.next_chunk = 0

    def add(self, tokens: np.ndarray, offsets: np.ndarray, seq_len: int) -> None:
        doc_len = np.diff(offsets)
        count = (doc_len + seq_len - 1) // seq_len
        doc = np.repeat(np.arange(len(doc_len)), count)
        first = np.repeat(np.cumsum(count) - count, count)
        within = (np.arange(len(doc)) - first) * seq_len
        starts = offsets[:-1][doc] + within
        lengths = np.minimum(doc_len[doc] - within, seq_len)
        cid = self.next_chunk
        self.next_chunk += 1
        self.chunks[cid] = tokens
        self.lengths = np.concatenate([self.lengths, lengths])
        self.start = np.concatenate([self.start, starts])
        self.chunk = np.concatenate([self.chunk, np.full(len(lengths), cid, np.int64)])

    def take(self, count: int) -> None:
        self.lengths = self.lengths[count:]
        self.chunk = self.chunk[count:]
        self.start = self.start[count:]
        oldest = int(self.chunk[0]) if len(self.chunk) else self.next_chunk
        for cid in [c for c in self.chunks if c < oldest]:
            del self.chunks[cid]


class RankLocalLoader:
    """One rank's loader: a DataLoader per source, the mix and the packing, all in this rank.

    Iterate it for micro-batches (dicts of torch tensors, or numpy with ``output="numpy"``)::

        loader = RankLocalLoader(plan, rank=0, world=8, workers=2)
        for mb in loader:
            ...
        loader.close()
    """

    def __init__(
        self,
        plan: Plan,
        rank: int,
        world: int,
        workers: int = 2,
        *,
        prefetch_factor: int = 2,
        chunk_tokens: int = 8192,
        output: str = "torch",
        tokenizer_in: str = "worker",
    ) -> None:
        if tokenizer_in not in ("worker", "rank"):
            raise ValueError(f"tokenizer_in must be 'worker' or 'rank', got {tokenizer_in!r}")
        if tokenizer_in == "rank":  # loaded once here: the forked workers share its pages
            load_tokenizer(plan.tokenizer)
        self.plan = plan
        self.rank = rank
        self.world = world
        self.workers = workers
        self.seq_len = plan.batch.seq_len
        self.micro = plan.batch.micro_batches
        # this rank's share of the plan's global budget (by default its full capacity)
        self.budget = (plan.batch.global_tokens or world * self.micro * self.seq_len) // world
        self.output = output
        self.weights = np.asarray([s.weight for s in plan.sources], dtype=np.float64)
        self.files = [shard_files(s, rank, world) for s in plan.sources]
        self.datasets = [
            SourceShard(i, s, self.files[i], plan.tokenizer, plan.seed, rank, chunk_tokens)
            for i, s in enumerate(plan.sources)
        ]
        self.prefetch_factor = prefetch_factor
        # tokens each worker has read and tokenized, in shared memory the workers inherit
        ctx = multiprocessing.get_context("fork")
        for ds in self.datasets:
            ds.produced = ctx.RawArray("q", max(1, workers))
        self.mixer = Mixer(len(plan.sources), plan.mixing_by)
        self.pending = [_Pending() for _ in plan.sources]
        self._iters: list[Iterator[dict[str, Any]]] | None = None
        self._loaders: list[Any] = []
        self._worker_state: dict[tuple[int, int], tuple[int, int]] = {}
        self._tokens: dict[tuple[int, int], np.ndarray] = {}  # chunks of the step being built
        self.step = 0

    # -- the DataLoaders -------------------------------------------------------------------
    def _start(self) -> list[Iterator[dict[str, Any]]]:
        for ds in self.datasets:
            kwargs: dict[str, Any] = {}
            if self.workers > 0:
                kwargs = {
                    "prefetch_factor": self.prefetch_factor,
                    "multiprocessing_context": "fork",  # workers share the rank's pages
                }
            self._loaders.append(
                DataLoader(
                    ds, batch_size=None, num_workers=self.workers, collate_fn=_identity, **kwargs
                )
            )
        return [iter(dl) for dl in self._loaders]

    def _pull(self, source: int) -> None:
        assert self._iters is not None
        chunk = next(self._iters[source])
        self._worker_state[(source, chunk["worker"])] = (chunk["state_bytes"], chunk["open_files"])
        self.pending[source].add(chunk["tokens"], chunk["offsets"], self.seq_len)

    def state_bytes(self) -> int:
        """File-access state of this rank: its file lists plus what its workers last reported."""
        return deep_sizeof(self.files) + sum(b for b, _ in self._worker_state.values())

    def produced_tokens(self) -> int:
        """Tokens all workers of this rank have read and tokenized so far."""
        return sum(sum(ds.produced) for ds in self.datasets)

    def open_files(self) -> int:
        return sum(n for _, n in self._worker_state.values())

    # -- one step --------------------------------------------------------------------------
    def _draw(self) -> list[tuple[int, int, int, int]]:
        """Pieces (source, chunk, start, length) of this rank's next step, in stream order."""
        budget = self.budget
        n = len(self.pending)
        while True:
            cands = [p.lengths for p in self.pending]
            sel = self.mixer.select(self.weights, cands, [True] * n, budget_tokens=budget)
            if isinstance(sel, NeedMore):
                for s in sel.sources:
                    self._pull(s)
                continue
            break
        self.mixer.commit(sel)
        pieces = []
        for s, i in sel.order.tolist():
            p = self.pending[s]
            pieces.append((s, int(p.chunk[i]), int(p.start[i]), int(p.lengths[i])))
        # keep the step's chunks alive past take(), which drops chunks no longer pending
        self._tokens = {(s, c): self.pending[s].chunks[c] for s, c, _, _ in pieces}
        for s, count in enumerate(sel.counts.tolist()):
            if count:
                self.pending[s].take(count)
        return pieces

    def _pack(self, pieces: list[tuple[int, int, int, int]]) -> list[list[tuple[int, ...]]]:
        """First fit in stream order; a piece that fits no micro-batch is cut to fill."""
        room = [self.seq_len] * self.micro
        bins: list[list[tuple[int, ...]]] = [[] for _ in range(self.micro)]
        for s, c, start, n in pieces:
            for m in range(self.micro):
                if room[m] >= n:
                    room[m] -= n
                    bins[m].append((s, c, start, n))
                    break
            else:
                for m in sorted(range(self.micro), key=lambda k: -room[k]):
                    take = min(n, room[m])
                    if take:
                        room[m] -= take
                        bins[m].append((s, c, start, take))
                        start, n = start + take, n - take
                    if not n:
                        break
        return bins

    def _micro_batch(self, step: int, m: int, pieces: list[tuple[int, ...]]) -> dict[str, Any]:
        lengths = np.asarray([p[3] for p in pieces], dtype=np.int64)
        cu = np.zeros(len(pieces) + 1, dtype=np.int32)
        np.cumsum(lengths, out=cu[1:])
        total = int(cu[-1])
        parts = [self._tokens[(s, c)][a : a + n] for s, c, a, n in pieces]
        input_ids = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
        starts = np.repeat(cu[:-1].astype(np.int64), lengths)
        position_ids = np.arange(total, dtype=np.int64) - starts
        labels = np.full(total, IGNORE_INDEX, dtype=np.int64)
        if total:
            labels[:-1] = input_ids[1:]
            labels[cu[1:] - 1] = IGNORE_INDEX
        mb: dict[str, Any] = {
            "input_ids": input_ids,
            "labels": labels,
            "position_ids": position_ids,
            "cu_seqlens": cu,
            "doc_source": np.asarray([p[0] for p in pieces], dtype=np.int32),
            "max_seqlen": int(lengths.max()) if len(lengths) else 0,
            "num_tokens": total,
            "seq_len": self.seq_len,
            "step": step,
            "micro_step": m,
            "num_micro_steps": self.micro,
            "dp_rank": self.rank,
        }
        if self.output == "torch":
            import torch

            for key in ("input_ids", "labels", "position_ids", "cu_seqlens", "doc_source"):
                mb[key] = torch.from_numpy(mb[key])
        return mb

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if self._iters is None:
            self._iters = self._start()
        while True:
            bins = self._pack(self._draw())
            for m, pieces in enumerate(bins):
                yield self._micro_batch(self.step, m, pieces)
            self.step += 1

    def close(self) -> None:
        """Stop the DataLoader workers."""
        for it in self._iters or []:
            shutdown = getattr(it, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
        self._iters = None
        self._loaders.clear()

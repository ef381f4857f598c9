"""The frozen specs of a plan's sections: what a plan says, validated and immutable.

Each class is one section (or one entry of a list section) of the YAML plan; the parsers in
``parse*.py`` build them and :class:`~omniload_dask.plan.plan.Plan` holds them together. The
specs know nothing about parsing: defaults live here, checks live in the parsers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import omniload_dask.plan.choices as choices
from omniload_dask.errors import PlanError
from omniload_dask.plan.chat import ChatSpec
from omniload_dask.plan.credentials import StorageOptions

__all__ = [
    "BYTE_IMAGE_TOKEN",
    "NO_CAP",
    "READ_SLOTS_PER_THREAD",
    "TOKEN_FORMATS",
    "BatchSpec",
    "BucketSpec",
    "CheckpointSpec",
    "CostSpec",
    "ImageSpec",
    "LayoutSpec",
    "LoaderSpec",
    "MixingSpec",
    "SchedulePoint",
    "SourceSpec",
    "StageSpec",
    "TokenMaskSpec",
    "TokenizerSpec",
]

BYTE_IMAGE_TOKEN = 258  # the byte tokenizer's image placeholder (after BOS 256, EOS 257)
NO_CAP = 2**62  # the document cap of a plan that sets none (split): longer than any document
# Read slots (``omniload-read`` resources) a worker has for each tokenizing thread: it runs
# that many reads at once per thread, so that while one read tokenizes,
# the next reads and decodes its records, and the tokenizer never waits for a read to start
# (with one read a thread, the tokenizer idles while each next read opens its file and
# decodes; a second one in flight hides that).
READ_SLOTS_PER_THREAD = 2
TOKEN_FORMATS = ("megatron", "flat")  # formats whose records are always token ids


@dataclass(frozen=True)
class TokenMaskSpec:
    """A token source's per-token mask column (``sources[].mask``), beside its ids.

    ``kind: loss_mask``: 1/true where the token is a target, 0/false where not. ``kind:
    labels``: Hugging Face labels, unshifted: the token's own id where it is a target,
    ``ignore_index`` where it is not (:mod:`omniload_dask.sources.token_masks`).
    """

    column: str
    kind: str = "loss_mask"
    ignore_index: int = -100


@dataclass(frozen=True)
class SourceSpec:
    """One data source: where its files are, how to read them and its mixing weight."""

    name: str
    format: choices.SourceFormat
    paths: tuple[str, ...]
    weight: float
    text: str = "text"
    unit_bytes: int = 4 * 2**20
    # small whole files are read several to a unit up to min(unit_bytes, merge_bytes); 0: never
    merge_bytes: int = 2**20
    storage_options: Mapping[str, Any] = field(default_factory=StorageOptions)
    epochs: int | None = None  # stop after this many passes; None: a new epoch, reshuffled
    # Image-text sources: the image column (Parquet) or file extensions (WebDataset); () = text.
    image: tuple[str, ...] = ()
    unit_records: int | None = None  # records per read unit (Parquet: cuts row groups; tar)
    # Token sources (plan.parse_tokens): the token-id column, the vocabulary the tokens were
    # written with, a flat array's dtype and end-of-document id.
    tokens: str | None = None
    vocab_size: int | None = None
    bos_id: int | None = None
    eos_id: int | None = None
    dtype: choices.TokenDtype | None = None
    eod: int | None = None
    # User code run on the workers: ``package.module:function`` (preprocess.transforms).
    transform: str | None = None
    filter: str | None = None
    mask: TokenMaskSpec | None = None  # a token source's target mask column; None: every token
    chat: ChatSpec | None = None  # conversations and their targets; None: plain text

    @property
    def has_images(self) -> bool:
        """Whether the source's records carry images (an image column or image files)."""
        return bool(self.image)

    @property
    def has_tokens(self) -> bool:
        """Whether the source's records are token ids already (no tokenizer runs on them)."""
        return self.format in TOKEN_FORMATS or self.tokens is not None


@dataclass(frozen=True)
class TokenizerSpec:
    """``byte`` (built in: UTF-8 bytes, BOS 256, EOS 257), ``huggingface`` (a tokenizer.json) or
    ``tiktoken`` (a byte-level BPE file of base64 token / rank lines, as Llama 3 ships).

    A ``tiktoken`` tokenizer also needs its pre-tokenizer regex (``pattern``); its special tokens
    (``special_tokens``: token -> id) are not in the file, and ``bos``/``eos`` name two of them.
    """

    kind: choices.TokenizerKind = "byte"
    path: str | None = None
    bos: str | None = None
    eos: str | None = None
    add_bos: bool = True
    add_eos: bool = True
    storage_options: Mapping[str, Any] = field(default_factory=StorageOptions)
    pattern: str | None = None  # tiktoken only
    special_tokens: Mapping[str, int] = field(default_factory=dict)  # tiktoken only


@dataclass(frozen=True)
class ImageSpec:
    """How images become patches and placeholder tokens (NaViT-style variable resolution).

    An image of h x w pixels is resized, keeping its aspect ratio as closely as the grid allows,
    to H x W with both sides multiples of ``patch_size * merge`` and ``min_pixels <= H * W <=
    max_pixels``; it is cut into ``(H / patch_size) * (W / patch_size)`` patches of
    ``patch_size`` squared RGB pixels (uint8), and takes ``patches / merge**2`` tokens in its
    document (``merge`` x ``merge`` neighbouring patches become one token after the encoder).
    Images of more than ``max_input_pixels`` before resizing are bad records. ``placeholder`` is
    the token that stands for image tokens: a token string or id of a Hugging Face tokenizer
    (required there), or 258 for the byte tokenizer.
    """

    patch_size: int = 14
    merge: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    max_input_pixels: int = 64 * 2**20
    placeholder: str | int = BYTE_IMAGE_TOKEN

    @property
    def factor(self) -> int:
        """Image sides are multiples of this many pixels."""
        return self.patch_size * self.merge


@dataclass(frozen=True)
class BucketSpec:
    """One context bucket: micro-batches of up to ``seq_len`` tokens, ``micro_batches`` per rank.

    ``share`` (when the plan gives it instead of ``micro_batches``) is the part of
    ``global_tokens`` the bucket is sized for: ``micro_batches = ceil(share * global_tokens /
    (dp * seq_len))``. ``sources`` pins those sources' documents to this bucket; documents of the
    other sources go, by length, to the shortest bucket without ``sources`` that holds them whole
    (longer ones to the longest such bucket, split into ``seq_len`` pieces).
    """

    seq_len: int
    micro_batches: int
    share: float | None = None
    sources: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """The bucket as the plan gave it: ``share`` or ``micro_batches``, and its sources."""
        out: dict[str, Any] = {"seq_len": self.seq_len}
        if self.share is not None:
            out["share"] = self.share
        else:
            out["micro_batches"] = self.micro_batches
        if self.sources:
            out["sources"] = list(self.sources)
        return out


@dataclass(frozen=True)
class BatchSpec:
    """How global batches are cut.

    ``seq_len`` is the token capacity of one packed micro-batch; each rank gets ``micro_batches``
    of them per step. The global batch is a token budget (``global_tokens``, by default
    ``dp * micro_batches * seq_len``: full micro-batches) or a document count
    (``global_documents``); it does not depend on the DP size, so elastic resume keeps the stream.

    ``long_documents: split`` lets documents be cut and drops nothing: those longer than
    ``seq_len`` into ``seq_len`` pieces; when a step's pieces cannot all be packed whole, a piece
    into the micro-batches that still have room (so a step never needs more micro-batches than
    its tokens do); and with a token budget the document that does not fit in a global batch
    continues in the next one (a document longer than a global batch spans several).
    ``max_document_tokens`` caps a document (the rest is dropped and counted as truncated);
    without it nothing is. ``truncate`` never cuts a document: longer ones are truncated to
    ``seq_len``, and a step whose documents do not pack into ``micro_batches`` gets one more
    micro-batch on every rank. ``pack_pool`` (N > 0, whole documents and a token budget only)
    lets a step's draw leave up to N documents of the mix for a later step (:mod:`.core.pool`).

    Whole documents (:attr:`whole_documents`): under ``truncate``, and under ``split`` when
    ``max_document_tokens`` is at or under the ``seq_len`` of every micro-batch a document may
    go to. Every document then fits a micro-batch, so the only reason left to cut one would
    be to fill a step exactly; a plan that caps documents that low asks for them whole (SFT
    conversations), and gets them packed as under ``truncate``, never cut between
    micro-batches or steps.

    With ``buckets`` (context buckets, see :class:`BucketSpec`) each rank's step has micro-batches
    of several sizes, the buckets' in the order declared; ``seq_len`` is then the longest
    bucket's and ``micro_batches`` their total.
    """

    seq_len: int
    micro_batches: int
    global_tokens: int | None
    global_documents: int | None
    long_documents: choices.LongDocuments = "split"
    max_document_tokens: int | None = None
    pad_to_seq_len: bool = False
    buckets: tuple[BucketSpec, ...] = ()
    pack_pool: int = 0  # documents the draw may hold back for later steps (0: none)
    stages: tuple[StageSpec, ...] = ()  # later budgets and shapes, by step (see StageSpec)

    def at(self, step: int) -> BatchSpec:
        """The batch that rules step ``step``: the last stage begun by then, else this one."""
        for stage in reversed(self.stages):
            if stage.at_step <= step:
                return stage.batch
        return self

    def stage_index(self, step: int) -> int:
        """0 before the first stage, else 1 + the index of the last stage begun by ``step``."""
        return sum(1 for stage in self.stages if stage.at_step <= step)

    @property
    def every_stage(self) -> tuple[BatchSpec, ...]:
        """This batch and each stage's, in order."""
        return (self, *(stage.batch for stage in self.stages))

    @property
    def context_buckets(self) -> tuple[BucketSpec, ...]:
        """The declared buckets, or the single one that ``seq_len``/``micro_batches`` make."""
        return self.buckets or (BucketSpec(self.seq_len, self.micro_batches),)

    @property
    def whole_documents(self) -> bool:
        """Documents are never cut (class doc): ``truncate``, or ``max_document_tokens`` at or
        under the ``seq_len`` of every bucket a document may go to (its source's pinned one,
        else the longest bucket without sources)."""
        if self.long_documents == "truncate":
            return True
        cap = self.max_document_tokens
        return cap is not None and cap <= self.whole_limit

    @property
    def whole_limit(self) -> int:
        """The longest document that fits whole in any micro-batch it may be routed to."""
        pinned = [b.seq_len for b in self.context_buckets if b.sources]
        free = [b.seq_len for b in self.context_buckets if not b.sources]
        return min([*pinned, max(free)] if free else pinned)

    @property
    def document_cap(self) -> int:
        """Tokens kept of one document: ``seq_len`` when truncating, else
        ``max_document_tokens`` (:data:`NO_CAP` when the plan sets none: nothing is dropped)."""
        if self.long_documents == "truncate":
            return self.seq_len
        return self.max_document_tokens or NO_CAP

    def document_cap_for(self, source: str) -> int:
        """:attr:`document_cap` for one source: when truncating, its bucket's ``seq_len``."""
        if self.long_documents != "truncate":
            return self.document_cap
        pinned = [b.seq_len for b in self.context_buckets if source in b.sources]
        if pinned:
            return pinned[0]
        return max(b.seq_len for b in self.context_buckets if not b.sources)


@dataclass(frozen=True)
class StageSpec:
    """A training stage: from step ``at_step`` on, global batches are cut as ``batch`` says
    (its budget, ``seq_len`` and micro-batches or buckets; the rest as the plan's batch).

    ``at_tokens``, when the plan gave the stage's start in tokens, is kept as given; the parser
    turns it into ``at_step``, the first step that starts with at least that many tokens drawn
    (a token budget with ``long_documents: split`` fills every step exactly, so that step
    follows from the plan alone).
    """

    at_step: int
    batch: BatchSpec
    at_tokens: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """The stage as the plan gives it: its start and the batch fields it may change."""
        out: dict[str, Any] = (
            {"at_tokens": self.at_tokens}
            if self.at_tokens is not None
            else {"at_step": self.at_step}
        )
        batch = self.batch
        out["global_tokens"] = batch.global_tokens
        out["global_documents"] = batch.global_documents
        if batch.buckets:
            out["buckets"] = [b.to_dict() for b in batch.buckets]
        else:
            out["seq_len"], out["micro_batches"] = batch.seq_len, batch.micro_batches
        return out


@dataclass(frozen=True)
class LayoutSpec:
    """The trainer's parallel layout: dp x tp x pp x cp ranks.

    Global rank r maps to coordinates by ``order`` (the first axis varies fastest; default
    ``tp-cp-dp-pp``), or by an explicit ``rank_map``: entry r is ``[dp, tp, pp, cp]`` of rank r.
    One DP group (fixed dp, every tp/pp/cp) shares one constructed batch; its tp and pp ranks get
    the same batch, its cp ranks each their own slice of it. ``balance`` (``full`` or ``fast``,
    :mod:`~omniload_dask.batching.balance`) only changes how a global batch is split.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    order: tuple[str, ...] = ("tp", "cp", "dp", "pp")
    rank_map: tuple[tuple[int, int, int, int], ...] = ()
    balance: choices.BalanceEffort = "full"

    @cached_property
    def _ranks_by_coords(self) -> dict[tuple[int, int, int, int], int]:
        return {coords: r for r, coords in enumerate(self.rank_map)}

    @property
    def world_size(self) -> int:
        """All trainer ranks: ``dp * tp * pp * cp``."""
        return self.dp * self.tp * self.pp * self.cp

    def coords(self, rank: int) -> dict[str, int]:
        """Global rank -> {dp, tp, pp, cp}; the first axis of ``order`` varies fastest."""
        if not 0 <= rank < self.world_size:
            raise PlanError(f"rank: must be in [0, {self.world_size}), got {rank}")
        if self.rank_map:
            return dict(zip(("dp", "tp", "pp", "cp"), self.rank_map[rank], strict=True))
        out = {}
        for axis in self.order:
            size = getattr(self, axis)
            out[axis] = rank % size
            rank //= size
        return out

    def rank(self, dp: int, tp: int = 0, pp: int = 0, cp: int = 0) -> int:
        """Coordinates -> global rank (the inverse of :meth:`coords`)."""
        coords = {"dp": dp, "tp": tp, "pp": pp, "cp": cp}
        for axis, value in coords.items():
            if not 0 <= value < getattr(self, axis):
                raise PlanError(f"{axis}_rank: must be in [0, {getattr(self, axis)}), got {value}")
        if self.rank_map:
            return self._ranks_by_coords[(dp, tp, pp, cp)]
        rank, stride = 0, 1
        for axis in self.order:
            rank += coords[axis] * stride
            stride *= getattr(self, axis)
        return rank

    def group_ranks(self, dp: int) -> list[int]:
        """All global ranks of DP group ``dp`` (they share its batch)."""
        return sorted(
            self.rank(dp, tp, pp, cp)
            for tp in range(self.tp)
            for pp in range(self.pp)
            for cp in range(self.cp)
        )


@dataclass(frozen=True)
class SchedulePoint:
    """Weights from ``at`` on (steps or tokens, per the schedule's ``over``)."""

    at: int
    weights: Mapping[str, float]


@dataclass(frozen=True)
class MixingSpec:
    """How sources are mixed: share by ``tokens`` or ``documents``, optionally on a schedule.

    A schedule is a list of points ``{at, weights}`` over ``steps`` or consumed ``tokens``;
    between points weights hold (``constant``) or move linearly (``linear``). Before the first
    point, and for sources a point does not name, the sources' own ``weight`` applies.
    """

    by: choices.MixingBy = "tokens"
    over: choices.MixingOver = "steps"
    interpolate: choices.Interpolation = "constant"
    schedule: tuple[SchedulePoint, ...] = ()


@dataclass(frozen=True)
class CostSpec:
    """Cost of one document piece of L tokens, to balance ranks by (see :mod:`omniload_dask.plan.cost`).

    ``piece + linear * L + quadratic * L**2`` (dense layers plus attention), with the
    coefficients given, or derived from ``model`` (a transformer description: hidden, layers,
    heads, kv_heads, ffn, vocab, gated, causal), or ``function``: ``package.module:function``
    taking an array of lengths and returning their costs, imported (and tried once) wherever the
    plan is loaded: the data plane on the scheduler and every feeder, so it must be importable
    there.

    ``encoder`` adds the vision encoder's cost of each image of P patches,
    ``encoder_linear * P + encoder_quadratic * P**2``: give ``{linear, quadratic}`` or a
    ``model`` description of the encoder (bidirectional unless it says ``causal: true``).

    ``piece`` is a constant per piece (0 unless given with the coefficients); ``calibration``
    names a file of measured coefficients (``omniload calibrate``) that resolves to them.
    """

    linear: float = 1.0
    quadratic: float = 1.0 / (6 * 4096)
    model: Mapping[str, Any] | None = None
    function: str | None = None
    encoder_linear: float = 0.0
    encoder_quadratic: float = 0.0
    encoder_model: Mapping[str, Any] | None = None
    piece: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """The form the plan gave (coefficients derived from a model are not repeated; a
        calibration file's are given instead of its name)."""
        out: dict[str, Any]
        if self.function is not None:
            out = {"function": self.function}
        elif self.model is not None:
            out = {"model": dict(self.model)}
        else:
            out = {"linear": self.linear, "quadratic": self.quadratic}
            if self.piece:
                out["piece"] = self.piece
        if self.encoder_model is not None:
            out["encoder"] = {"model": dict(self.encoder_model)}
        elif self.encoder_linear or self.encoder_quadratic:
            out["encoder"] = {"linear": self.encoder_linear, "quadratic": self.encoder_quadratic}
        return out


@dataclass(frozen=True)
class LoaderSpec:
    """Tuning that changes speed and memory, never which samples are delivered."""

    workers: int = 2
    # tokenizing threads per worker of the embedded cluster; each has READ_SLOTS_PER_THREAD read
    # slots (reads at once) (one decodes its records while another tokenizes)
    threads_per_worker: int = 1
    read_ahead: int = 2
    prefetch: int = 2
    lookahead: int = 2
    retain_steps: int = 64
    read_retries: int = 2
    standby: bool = True  # a second copy of upcoming batches and shards on another worker
    # Auto-partitioning (see :mod:`omniload_dask.core.autoscale`): read tasks last about
    # ``task_seconds`` (0: never split a unit); with ``quotas``, sources share
    # ``reads_per_slot`` in-flight reads per read slot by weight x measured cost (plans may
    # still name it ``reads_per_thread``, its former name: a deprecated alias).
    task_seconds: float = 0.5
    quotas: bool = True
    reads_per_slot: int = 2
    # Scale (docs/guides/scale.md): DP groups whose batches one construction task
    # builds (0: enough for about 8 tasks a step); how ranks share a fetch: "none" (each rank
    # fetches), "broadcast" (one rank of each DP group fetches and broadcasts over
    # torch.distributed) or "node" (a node-local agent fetches for the node's ranks and hands
    # batches over shared memory). ``steps_per_task``: consecutive steps one construction task
    # builds when one block holds every group of a step (0: enough steps for about 1 M
    # tokens a task, at most 16).
    groups_per_task: int = 0
    steps_per_task: int = 0
    # A job that expects live changes: draw at most ``live_lead`` steps past the slowest rank
    # (0: no bound), so that a change takes effect that soon (see core.rewind).
    live_lead: int = 0
    fanout: choices.Fanout = "none"
    # The embedded cluster on TLS, with temporary certificates (Job.start(security=True)).
    tls: bool = False


@dataclass(frozen=True)
class CheckpointSpec:
    """Where and how often the data plane writes its differential checkpoint.

    ``url`` is any fsspec URL (a folder). Deltas are flushed every ``flush_seconds`` (off the
    data plane's loop); a new base snapshot is written every ``compact_every`` steps, and the
    newest ``keep_bases`` bases (with their deltas) are kept, so any step since the oldest
    kept base can be restored exactly.
    """

    url: str
    flush_seconds: float = 2.0
    compact_every: int = 1000
    keep_bases: int = 3
    storage_options: Mapping[str, Any] = field(default_factory=StorageOptions)

"""Data plans: YAML in, validated and frozen plan objects out.

A plan says what to read (sources, with formats, paths and weights), how to turn it into tokens
(the tokenizer), how to cut global batches (sequence length, micro-batches, budget), the trainer's
parallel layout, and what to do with bad records. Example::

    version: 1
    name: demo
    seed: 7
    tokenizer: {kind: byte}
    batch: {seq_len: 1024, micro_batches: 2}
    layout: {dp: 2}
    sources:
      - {name: web, format: jsonl, path: data/web/*.jsonl.zst, weight: 3}
      - {name: books, format: parquet, path: data/books/*.parquet, text: body, weight: 1}

Optional sections, each described on its spec class below::

    batch:                      # context buckets instead of one seq_len (BatchSpec, BucketSpec)
      global_tokens: 1048576
      buckets:                  # each: share of global_tokens (or micro_batches per rank)
        - {seq_len: 4096, share: 0.6}                      # short documents, by length
        - {seq_len: 32768, share: 0.2}                     # documents over 4096 tokens
        - {seq_len: 32768, share: 0.2, sources: [books]}   # books, whatever their length
    layout: {dp: 4, tp: 2, cp: 2}           # or an explicit rank_map (LayoutSpec)
    cost: {model: {hidden: 4096, layers: 32, heads: 32, kv_heads: 8, ffn: 14336, gated: true}}

Mixing can follow a schedule (piecewise constant or linear, over steps or consumed tokens)::

    mixing:
      by: tokens                 # shares of tokens (or: documents)
      over: steps                # schedule positions are steps (or: tokens)
      interpolate: linear        # or constant
      schedule:
        - {at: 0, weights: {web: 3, books: 1}}
        - {at: 10000, weights: {web: 1, books: 1}}

Image-text sources (Parquet with an image column, or WebDataset-style tar shards) name their
images with ``image``; the ``images`` section says how images become patches and tokens::

    images: {patch_size: 14, merge: 2, min_pixels: 3136, max_pixels: 1003520}
    sources:
      - {name: captions, format: parquet, path: data/cap/*.parquet, image: jpeg, text: caption}
      - {name: laion, format: webdataset, path: data/laion/*.tar, image: [jpg, png], text: txt}

A source with ``epochs: N`` stops after N passes; without it, it starts a new epoch with a fresh
shuffle. Every error names the field path and the value (``sources[1].weight: must be >= 0, got -1``).
Relative local paths are resolved against the plan file's folder; ``${VAR}`` and
``${VAR:-default}`` are expanded from the environment in paths.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import yaml

from omniload_dask.batching.cost import check_function, load_function, transformer_coefficients
from omniload_dask.errors import PlanError
from omniload_dask.plan.fields import Fields, check_number, fail

__all__ = [
    "BatchSpec",
    "BucketSpec",
    "CheckpointSpec",
    "CostSpec",
    "ImageSpec",
    "LayoutSpec",
    "LoaderSpec",
    "MixingSpec",
    "Plan",
    "SchedulePoint",
    "SourceSpec",
    "TokenizerSpec",
    "check_weights",
    "load_plan",
    "parse_plan",
    "parse_source",
    "source_dict",
]

PLAN_VERSION = 1
FORMATS = ("jsonl", "parquet", "webdataset")
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")
BYTE_IMAGE_TOKEN = 258  # the byte tokenizer's image placeholder (after BOS 256, EOS 257)
NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}"
_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


@dataclass(frozen=True)
class SourceSpec:
    """One data source: where its files are, how to read them and its mixing weight."""

    name: str
    format: str
    paths: tuple[str, ...]
    weight: float
    text: str = "text"
    unit_bytes: int = 4 * 2**20
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    epochs: int | None = None  # stop after this many passes; None: a new epoch, reshuffled
    # Image-text sources: the image column (Parquet) or file extensions (WebDataset); () = text.
    image: tuple[str, ...] = ()
    unit_records: int | None = None  # records per read unit (Parquet: cuts row groups; tar)

    @property
    def has_images(self) -> bool:
        return bool(self.image)


@dataclass(frozen=True)
class TokenizerSpec:
    """``byte`` (built in: UTF-8 bytes, BOS 256, EOS 257) or ``huggingface`` (a tokenizer.json)."""

    kind: str = "byte"
    path: str | None = None
    bos: str | None = None
    eos: str | None = None
    add_bos: bool = True
    add_eos: bool = True
    storage_options: Mapping[str, Any] = field(default_factory=dict)


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


@dataclass(frozen=True)
class BatchSpec:
    """How global batches are cut.

    ``seq_len`` is the token capacity of one packed micro-batch; each rank gets ``micro_batches``
    of them per step. The global batch is a token budget (``global_tokens``, by default
    ``dp * micro_batches * seq_len``: full micro-batches) or a document count
    (``global_documents``); it does not depend on the DP size, so elastic resume keeps the stream.

    ``long_documents: split`` lets documents be cut: those longer than ``seq_len`` into
    ``seq_len`` pieces, and, when a step's pieces cannot all be packed whole, a piece into the
    micro-batches that still have room (so a step never needs more micro-batches than its tokens
    do). ``truncate`` never cuts a document: longer ones are truncated to ``seq_len``, and a step
    whose documents do not pack into ``micro_batches`` gets one more micro-batch on every rank.

    With ``buckets`` (context buckets, see :class:`BucketSpec`) each rank's step has micro-batches
    of several sizes, the buckets' in the order declared; ``seq_len`` is then the longest
    bucket's and ``micro_batches`` their total.
    """

    seq_len: int
    micro_batches: int
    global_tokens: int | None
    global_documents: int | None
    long_documents: str = "split"
    max_document_tokens: int | None = None
    pad_to_seq_len: bool = False
    buckets: tuple[BucketSpec, ...] = ()

    @property
    def context_buckets(self) -> tuple[BucketSpec, ...]:
        """The declared buckets, or the single one that ``seq_len``/``micro_batches`` make."""
        return self.buckets or (BucketSpec(self.seq_len, self.micro_batches),)

    @property
    def document_cap(self) -> int:
        """Tokens kept of one document: ``seq_len`` when truncating, else ``max_document_tokens``."""
        if self.long_documents == "truncate":
            return self.seq_len
        return self.max_document_tokens or (self.global_tokens or 64 * self.seq_len)

    def document_cap_for(self, source: str) -> int:
        """:attr:`document_cap` for one source: when truncating, its bucket's ``seq_len``."""
        if self.long_documents != "truncate":
            return self.document_cap
        pinned = [b.seq_len for b in self.context_buckets if source in b.sources]
        if pinned:
            return pinned[0]
        return max(b.seq_len for b in self.context_buckets if not b.sources)


@dataclass(frozen=True)
class LayoutSpec:
    """The trainer's parallel layout: dp x tp x pp x cp ranks.

    Global rank r maps to coordinates by ``order`` (the first axis varies fastest; default
    ``tp-cp-dp-pp``), or by an explicit ``rank_map``: entry r is ``[dp, tp, pp, cp]`` of rank r.
    One DP group (fixed dp, every tp/pp/cp) shares one constructed batch; its tp and pp ranks get
    the same batch, its cp ranks each their own slice of it.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    order: tuple[str, ...] = ("tp", "cp", "dp", "pp")
    rank_map: tuple[tuple[int, int, int, int], ...] = ()

    @cached_property
    def _ranks_by_coords(self) -> dict[tuple[int, int, int, int], int]:
        return {coords: r for r, coords in enumerate(self.rank_map)}

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def group_size(self) -> int:
        """Ranks that share one constructed batch (one DP group)."""
        return self.tp * self.pp * self.cp

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

    by: str = "tokens"
    over: str = "steps"
    interpolate: str = "constant"
    schedule: tuple[SchedulePoint, ...] = ()


@dataclass(frozen=True)
class CostSpec:
    """Cost of one document piece of L tokens, to balance ranks by (see :mod:`.cost`).

    ``linear * L + quadratic * L**2`` (dense layers plus attention), with the coefficients given,
    or derived from ``model`` (a transformer description: hidden, layers, heads, kv_heads, ffn,
    vocab, gated, causal), or ``function``: ``package.module:function`` taking an array of
    lengths and returning their costs, imported (and tried once) wherever the plan is loaded:
    the data plane on the scheduler and every feeder, so it must be importable there.

    ``encoder`` adds the vision encoder's cost of each image of P patches,
    ``encoder_linear * P + encoder_quadratic * P**2``: give ``{linear, quadratic}`` or a
    ``model`` description of the encoder (bidirectional unless it says ``causal: true``).
    """

    linear: float = 1.0
    quadratic: float = 1.0 / (6 * 4096)
    model: Mapping[str, Any] | None = None
    function: str | None = None
    encoder_linear: float = 0.0
    encoder_quadratic: float = 0.0
    encoder_model: Mapping[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The form the plan gave (coefficients derived from a model are not repeated)."""
        out: dict[str, Any]
        if self.function is not None:
            out = {"function": self.function}
        elif self.model is not None:
            out = {"model": dict(self.model)}
        else:
            out = {"linear": self.linear, "quadratic": self.quadratic}
        if self.encoder_model is not None:
            out["encoder"] = {"model": dict(self.encoder_model)}
        elif self.encoder_linear or self.encoder_quadratic:
            out["encoder"] = {"linear": self.encoder_linear, "quadratic": self.encoder_quadratic}
        return out


@dataclass(frozen=True)
class LoaderSpec:
    """Tuning that changes speed and memory, never which samples are delivered."""

    workers: int = 2
    threads_per_worker: int = 1
    read_ahead: int = 2
    prefetch: int = 2
    lookahead: int = 2
    retain_steps: int = 64
    read_retries: int = 2
    standby: bool = True  # a second copy of upcoming batches and shards on another worker
    # Auto-partitioning (see :mod:`omniload_dask.core.autoscale`): read tasks last about
    # ``task_seconds`` (0: never split a unit); with ``quotas``, sources share
    # ``reads_per_thread`` in-flight reads per worker thread by weight x measured cost.
    task_seconds: float = 0.5
    quotas: bool = True
    reads_per_thread: int = 2


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
    storage_options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Plan:
    """A validated data plan. Build with :func:`load_plan` or :func:`parse_plan`."""

    name: str
    seed: int
    sources: tuple[SourceSpec, ...]
    tokenizer: TokenizerSpec
    batch: BatchSpec
    layout: LayoutSpec
    cost: CostSpec = field(default_factory=CostSpec)
    loader: LoaderSpec = field(default_factory=LoaderSpec)
    mixing: MixingSpec = field(default_factory=MixingSpec)
    on_error: str = "raise"
    checkpoint: CheckpointSpec | None = None
    version: int = PLAN_VERSION
    images: ImageSpec | None = None  # set when a source has images

    @property
    def mixing_by(self) -> str:
        return self.mixing.by

    @property
    def source_names(self) -> list[str]:
        return [s.name for s in self.sources]

    def source(self, name: str) -> SourceSpec:
        for spec in self.sources:
            if spec.name == name:
                return spec
        raise PlanError(f"sources: no source named {name!r} (have {', '.join(self.source_names)})")

    def to_dict(self) -> dict[str, Any]:
        """The resolved plan as plain data (what ``omniload validate`` prints)."""
        data = asdict(self)
        layout = data["layout"]
        if self.layout.rank_map:
            layout.pop("order")
            layout["rank_map"] = [list(c) for c in self.layout.rank_map]
        else:
            layout.pop("rank_map")
            layout["order"] = "-".join(self.layout.order)
        batch = data["batch"]
        if self.batch.buckets:
            del batch["seq_len"], batch["micro_batches"]
            batch["buckets"] = [_bucket_dict(b) for b in self.batch.buckets]
        else:
            batch.pop("buckets")
        data["cost"] = self.cost.to_dict()
        if data["images"] is None:
            del data["images"]
        data["mixing"]["schedule"] = [
            {"at": p.at, "weights": dict(p.weights)} for p in self.mixing.schedule
        ]
        data["sources"] = [source_dict(s) for s in self.sources]
        if self.checkpoint is None:
            data.pop("checkpoint")
        return data

    def resume_key(self) -> dict[str, Any]:
        """What must match between a checkpoint's plan and the plan resuming from it.

        Weights, schedules, layout, loader tuning and the set of sources may change; the seed,
        tokenizer, batch budget, document handling and image settings may not, nor may a source
        that both plans name change its files, format, text or image field, or unit size.
        """
        batch = self.batch
        return {
            "seed": self.seed,
            "tokenizer": source_free(asdict(self.tokenizer)),
            "mixing.by": self.mixing.by,
            "batch.global_tokens": batch.global_tokens,
            "batch.global_documents": batch.global_documents,
            "batch.long_documents": batch.long_documents,
            "batch.max_document_tokens": batch.max_document_tokens,
            "batch.seq_len": batch.seq_len,
            "on_error": self.on_error,
            "sources": {s.name: source_identity(s) for s in self.sources},
            "images": asdict(self.images) if self.images is not None else None,
        }

    def stream_fingerprint(self) -> str:
        """Hash of everything that decides the global sample stream (not loader tuning/layout)."""
        data = self.to_dict()
        for key in ("loader", "layout", "cost", "name", "checkpoint"):
            data.pop(key, None)
        blob = json.dumps(data, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def source_dict(spec: SourceSpec) -> dict[str, Any]:
    """A source spec as plan data (``parse_source`` reads it back)."""
    data = asdict(spec)
    data["path"] = list(data.pop("paths"))
    data["storage_options"] = dict(spec.storage_options)
    if spec.format != "jsonl":
        data.pop("unit_bytes")
    if spec.epochs is None:
        data.pop("epochs")
    if not spec.image:
        data.pop("image")
    elif spec.format == "parquet":
        data["image"] = spec.image[0]
    else:
        data["image"] = list(spec.image)
    if spec.unit_records is None:
        data.pop("unit_records")
    return data


def parse_source(data: Any, path: str = "source") -> SourceSpec:
    """Validate one source mapping (paths must already be absolute or URLs)."""
    return _source(Fields(data, path), None)


def source_identity(spec: SourceSpec) -> dict[str, Any]:
    """What a source may not change across a resume: where and how its records are read."""
    return {
        "paths": list(spec.paths),
        "format": spec.format,
        "text": spec.text,
        "unit_bytes": spec.unit_bytes if spec.format == "jsonl" else None,
        "epochs": spec.epochs,
        "image": list(spec.image),
        "unit_records": spec.unit_records,
    }


def source_free(data: dict[str, Any]) -> dict[str, Any]:
    """Drop credentials-like options from a dict before it is compared or stored."""
    return {k: v for k, v in data.items() if k != "storage_options"}


def load_plan(path: str | os.PathLike[str]) -> Plan:
    """Read and validate a YAML plan file; relative paths are taken from its folder."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise PlanError(f"plan file {str(path)!r}: cannot read it ({exc.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise PlanError(f"plan file {str(path)!r}: not valid YAML ({exc})") from None
    return parse_plan(data, base_dir=path.resolve().parent)


def parse_plan(data: Any, base_dir: str | os.PathLike[str] | None = None) -> Plan:
    """Validate plan data (as loaded from YAML or JSON) into a :class:`Plan`."""
    if isinstance(data, Plan):
        return data
    top = Fields(data, "")
    version = top.integer("version", PLAN_VERSION)
    if version != PLAN_VERSION:
        fail("version", f"this omniload-dask reads plan version {PLAN_VERSION}", version)
    name = top.text("name", "omniload", pattern=NAME_PATTERN)
    seed = top.integer("seed", 0, min=0, max=2**63 - 1)
    on_error = top.text("on_error", "raise", choices=("raise", "skip"))
    layout = _layout(top.mapping("layout"))
    batch = _batch(top.mapping("batch"), layout)
    tokenizer = _tokenizer(top.mapping("tokenizer"), base_dir)
    cost = _cost(top.mapping("cost"))
    loader = _loader(top.mapping("loader"))
    checkpoint = _checkpoint(top, base_dir)
    mixing_fields = top.mapping("mixing")
    sources = tuple(
        _source(Fields(raw, f"sources[{i}]"), base_dir)
        for i, raw in enumerate(top.sequence("sources"))
    )
    seen: dict[str, int] = {}
    for i, src in enumerate(sources):
        if src.name in seen:
            fail(f"sources[{i}].name", f"duplicates sources[{seen[src.name]}].name", src.name)
        seen[src.name] = i
    mixing = _mixing(mixing_fields, [s.name for s in sources])
    if len(sources) > 1024:
        fail("sources", "at most 1024 sources are supported", len(sources))
    if sum(s.weight for s in sources) <= 0:
        fail("sources", "at least one source needs a weight > 0", [s.weight for s in sources])
    _check_bucket_sources(batch, [s.name for s in sources])
    images = None
    if top.has("images") or any(s.has_images for s in sources):
        images = _images(top.mapping("images"), tokenizer)
    top.done()
    return Plan(
        name=name,
        seed=seed,
        sources=sources,
        tokenizer=tokenizer,
        batch=batch,
        layout=layout,
        cost=cost,
        loader=loader,
        checkpoint=checkpoint,
        mixing=mixing,
        on_error=on_error,
        version=version,
        images=images,
    )


def _images(f: Fields, tokenizer: TokenizerSpec) -> ImageSpec:
    d = ImageSpec()
    patch = f.integer("patch_size", d.patch_size, min=1, max=1024)
    merge = f.integer("merge", d.merge, min=1, max=16)
    factor = patch * merge
    min_pixels = f.integer("min_pixels", max(d.min_pixels, factor * factor), min=factor * factor)
    max_pixels = f.integer("max_pixels", max(d.max_pixels, min_pixels), min=min_pixels)
    max_input = f.integer("max_input_pixels", d.max_input_pixels, min=1)
    raw = f.raw("placeholder")
    if tokenizer.kind == "byte":
        if raw is not None and raw != BYTE_IMAGE_TOKEN:
            fail(
                f.at("placeholder"), f"the byte tokenizer's image token is {BYTE_IMAGE_TOKEN}", raw
            )
        placeholder: str | int = BYTE_IMAGE_TOKEN
    elif raw is None:
        fail(
            f.at("placeholder"),
            "is required with a huggingface tokenizer (the image token, e.g. '<|image_pad|>')",
        )
    elif (
        isinstance(raw, bool)
        or not isinstance(raw, (str, int))
        or raw == ""
        or (isinstance(raw, int) and raw < 0)
    ):
        fail(f.at("placeholder"), "must be a token string or a token id >= 0", raw)
    else:
        placeholder = raw
    f.done()
    return ImageSpec(
        patch_size=patch,
        merge=merge,
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        max_input_pixels=max_input,
        placeholder=placeholder,
    )


def _layout(f: Fields) -> LayoutSpec:
    axes = {axis: f.integer(axis, 1, min=1, max=65536) for axis in ("dp", "tp", "pp", "cp")}
    if f.has("rank_map") and f.has("order"):
        fail(f.at("order"), "give order or rank_map, not both", f.raw("order"))
    order_raw = f.text("order", "tp-cp-dp-pp")
    order = tuple(order_raw.split("-"))
    if sorted(order) != ["cp", "dp", "pp", "tp"]:
        fail(f.at("order"), "must name dp, tp, pp and cp once each, joined by '-'", order_raw)
    rank_map = _rank_map(f, axes) if f.has("rank_map") else ()
    f.done()
    return LayoutSpec(order=order, rank_map=rank_map, **axes)


def _rank_map(f: Fields, axes: dict[str, int]) -> tuple[tuple[int, int, int, int], ...]:
    raw = f.raw("rank_map")
    world = axes["dp"] * axes["tp"] * axes["pp"] * axes["cp"]
    if not isinstance(raw, (list, tuple)) or len(raw) != world:
        fail(
            f.at("rank_map"),
            f"must list [dp, tp, pp, cp] for each of the {world} ranks (dp*tp*pp*cp)",
            raw if not isinstance(raw, (list, tuple)) else f"{len(raw)} entries",
        )
    seen: dict[tuple[int, ...], int] = {}
    out = []
    for r, entry in enumerate(raw):
        where = f"{f.at('rank_map')}[{r}]"
        if (
            not isinstance(entry, (list, tuple))
            or len(entry) != 4
            or any(isinstance(v, bool) or not isinstance(v, int) for v in entry)
        ):
            fail(where, "must be [dp, tp, pp, cp], four integers", entry)
        for value, axis in zip(entry, ("dp", "tp", "pp", "cp"), strict=True):
            if not 0 <= value < axes[axis]:
                fail(where, f"{axis} must be in [0, {axes[axis]})", list(entry))
        coords = tuple(entry)
        if coords in seen:
            fail(where, f"duplicates rank_map[{seen[coords]}]", list(entry))
        seen[coords] = r
        out.append((coords[0], coords[1], coords[2], coords[3]))
    return tuple(out)


def _batch(f: Fields, layout: LayoutSpec) -> BatchSpec:
    tokens = f.optional_int("global_tokens", min=1)
    docs = f.optional_int("global_documents", min=1)
    if tokens is not None and docs is not None:
        fail(f.at("global_documents"), "give global_tokens or global_documents, not both", docs)
    if f.has("buckets"):
        for key in ("seq_len", "micro_batches"):
            if f.has(key):
                fail(f.at(key), "give it in each of batch.buckets instead (not both)", f.raw(key))
        buckets = _buckets(f, layout, tokens)
        seq_len = max(b.seq_len for b in buckets)
        micro = sum(b.micro_batches for b in buckets)
        capacity = layout.dp * sum(b.micro_batches * b.seq_len for b in buckets)
    else:
        buckets = ()
        seq_len = f.integer("seq_len", min=8)
        micro = f.integer("micro_batches", 1, min=1)
        capacity = layout.dp * micro * seq_len
    if tokens is None and docs is None:
        tokens = capacity
    long_docs = f.text("long_documents", "split", choices=("split", "truncate"))
    max_doc = f.optional_int("max_document_tokens", min=1)
    if max_doc is not None and long_docs == "truncate":
        fail(f.at("max_document_tokens"), "only applies with long_documents: split", max_doc)
    if tokens is not None and max_doc is not None and max_doc > tokens:
        fail(f.at("max_document_tokens"), f"must be <= global_tokens ({tokens})", max_doc)
    if tokens is not None and tokens < seq_len and long_docs == "truncate":
        fail(f.at("global_tokens"), f"must be >= seq_len ({seq_len}) so any document fits", tokens)
    pad = f.flag("pad_to_seq_len", False)
    f.done()
    return BatchSpec(
        seq_len=seq_len,
        micro_batches=micro,
        global_tokens=tokens,
        global_documents=docs,
        long_documents=long_docs,
        max_document_tokens=max_doc,
        pad_to_seq_len=pad,
        buckets=buckets,
    )


def _buckets(f: Fields, layout: LayoutSpec, tokens: int | None) -> tuple[BucketSpec, ...]:
    """``batch.buckets``: each gives seq_len and either share (of global_tokens) or micro_batches."""
    entries = [
        Fields(raw, f"{f.at('buckets')}[{i}]") for i, raw in enumerate(f.sequence("buckets"))
    ]
    by_share = entries[0].has("share")
    out = []
    for e in entries:
        seq_len = e.integer("seq_len", min=8)
        if e.has("share") and e.has("micro_batches"):
            fail(
                e.at("micro_batches"),
                "give share or micro_batches, not both",
                e.raw("micro_batches"),
            )
        if e.has("share") != by_share:
            fail(
                e.at("micro_batches" if by_share else "share"),
                "give share in every bucket or micro_batches in every bucket",
                e.raw("micro_batches" if by_share else "share"),
            )
        share = None
        if by_share:
            share = e.number("share", exclusive_min=True, min=0)
            if share > 1:
                fail(e.at("share"), "must be <= 1", share)
            if tokens is None:
                fail(e.at("share"), "needs batch.global_tokens (or give micro_batches)", share)
            micro = max(1, math.ceil(share * tokens / (layout.dp * seq_len) - 1e-9))
        else:
            micro = e.integer("micro_batches", 1, min=1)
        raw_sources = e.raw("sources", [])
        if not isinstance(raw_sources, (list, tuple)) or not all(
            isinstance(x, str) and x for x in raw_sources
        ):
            fail(e.at("sources"), "must be a list of source names", raw_sources)
        e.done()
        out.append(BucketSpec(seq_len, micro, share, tuple(raw_sources)))
    if by_share:
        total = sum(b.share or 0.0 for b in out)
        if abs(total - 1.0) > 1e-6:
            fail(f.at("buckets"), "shares must add up to 1", [b.share for b in out])
    free = [b.seq_len for b in out if not b.sources]
    for i, b in enumerate(out):
        if not b.sources and free.count(b.seq_len) > 1:
            fail(
                f"{f.at('buckets')}[{i}].seq_len",
                "two buckets without sources have this seq_len (which one gets a document?)",
                b.seq_len,
            )
    return tuple(out)


def _check_bucket_sources(batch: BatchSpec, names: list[str]) -> None:
    pinned: dict[str, str] = {}
    for i, bucket in enumerate(batch.buckets):
        for j, name in enumerate(bucket.sources):
            where = f"batch.buckets[{i}].sources[{j}]"
            if name not in names:
                fail(where, f"no source named {name!r} (have {', '.join(names)})", name)
            if name in pinned:
                fail(where, f"source already in {pinned[name]}", name)
            pinned[name] = f"batch.buckets[{i}]"
    if batch.buckets and all(b.sources for b in batch.buckets):
        loose = [n for n in names if n not in pinned]
        if loose:
            fail(
                "batch.buckets",
                "every bucket lists its sources, so these sources have none "
                "(list them or add a bucket without sources)",
                loose,
            )


def _bucket_dict(bucket: BucketSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"seq_len": bucket.seq_len}
    if bucket.share is not None:
        out["share"] = bucket.share
    else:
        out["micro_batches"] = bucket.micro_batches
    if bucket.sources:
        out["sources"] = list(bucket.sources)
    return out


def _tokenizer(f: Fields, base_dir: str | os.PathLike[str] | None) -> TokenizerSpec:
    kind = f.text("kind", "byte", choices=("byte", "huggingface"))
    path = None
    if kind == "huggingface":
        path = resolve_path(f.text("path"), base_dir)
    elif f.has("path"):
        fail(f.at("path"), "only applies to kind: huggingface", f.raw("path"))
    bos = f.raw("bos")
    eos = f.raw("eos")
    for key, value in (("bos", bos), ("eos", eos)):
        if value is not None and not isinstance(value, str):
            fail(f.at(key), "must be a token string such as '<s>'", value)
        if value is not None and kind == "byte":
            fail(f.at(key), "the byte tokenizer has fixed BOS (256) and EOS (257)", value)
    add_bos = f.flag("add_bos", kind == "byte" or bos is not None)
    add_eos = f.flag("add_eos", kind == "byte" or eos is not None)
    if kind == "huggingface" and add_bos and bos is None:
        fail(f.at("bos"), "is required when add_bos is true (name the BOS token, e.g. '<s>')")
    if kind == "huggingface" and add_eos and eos is None:
        fail(f.at("eos"), "is required when add_eos is true (name the EOS token, e.g. '</s>')")
    opts = f.plain_mapping("storage_options")
    f.done()
    return TokenizerSpec(
        kind=kind,
        path=path,
        bos=bos,
        eos=eos,
        add_bos=add_bos,
        add_eos=add_eos,
        storage_options=opts,
    )


def _mixing(f: Fields, names: list[str]) -> MixingSpec:
    by = f.text("by", "tokens", choices=("tokens", "documents"))
    over = f.text("over", "steps", choices=("steps", "tokens"))
    interpolate = f.text("interpolate", "constant", choices=("constant", "linear"))
    points: list[SchedulePoint] = []
    raw = f.raw("schedule", [])
    if not isinstance(raw, (list, tuple)):
        fail(f.at("schedule"), "must be a list of {at, weights}", raw)
    for i, item in enumerate(raw):
        p = Fields(item, f"{f.at('schedule')}[{i}]")
        at = p.integer("at", min=0)
        if points and at <= points[-1].at:
            fail(p.at("at"), f"must be > the previous point's at ({points[-1].at})", at)
        weights = check_weights(p.at("weights"), p.plain_mapping("weights"), names)
        p.done()
        points.append(SchedulePoint(at=at, weights=weights))
    f.done()
    return MixingSpec(by=by, over=over, interpolate=interpolate, schedule=tuple(points))


def check_weights(
    path: str,
    weights: Mapping[str, Any],
    names: list[str],
) -> dict[str, float]:
    """Validate a {source: weight} mapping (known names, finite, >= 0, not all zero)."""
    if not weights:
        fail(path, "must name at least one source", dict(weights))
    out = {}
    for name, value in weights.items():
        if name not in names:
            fail(f"{path}.{name}", f"unknown source (sources: {', '.join(names)})", value)
        out[str(name)] = check_number(f"{path}.{name}", value, min=0)
    if not any(v > 0 for v in out.values()):
        fail(path, "at least one weight must be > 0", dict(weights))
    return out


def _cost(f: Fields) -> CostSpec:
    forms = [k for k in ("model", "function") if f.has(k)]
    if f.has("linear") or f.has("quadratic"):
        forms.insert(0, "linear" if f.has("linear") else "quadratic")
    if len(forms) > 1:
        fail(
            f.at(forms[1]), f"give one of linear/quadratic, model or function (also got {forms[0]})"
        )
    encoder = _encoder(f.mapping("encoder")) if f.has("encoder") else {}
    f.raw("encoder")
    default = CostSpec()
    if f.has("model"):
        model = _model(f.mapping("model"))
        linear, quadratic = transformer_coefficients(**model)
        f.done()
        return CostSpec(linear=linear, quadratic=quadratic, model=model, **encoder)
    if f.has("function"):
        ref = f.text("function")
        try:
            check_function(load_function(ref))
        except ValueError as exc:
            fail(f.at("function"), str(exc), ref)
        f.done()
        return CostSpec(function=ref, **encoder)
    linear = f.number("linear", default.linear, min=0)
    quadratic = f.number("quadratic", default.quadratic, min=0)
    if linear == 0 and quadratic == 0:
        fail(f.at("linear"), "linear and quadratic cannot both be 0", 0)
    f.done()
    return CostSpec(linear=linear, quadratic=quadratic, **encoder)


def _encoder(f: Fields) -> dict[str, Any]:
    """``cost.encoder``: coefficients per patch and patch squared, or an encoder model."""
    if f.has("model"):
        for key in ("linear", "quadratic"):
            if f.has(key):
                fail(f.at(key), "give linear/quadratic or model, not both", f.raw(key))
        model = _model(f.mapping("model"))
        model.setdefault("causal", False)  # vision encoders attend both ways
        linear, quadratic = transformer_coefficients(**model)
        f.done()
        return {"encoder_linear": linear, "encoder_quadratic": quadratic, "encoder_model": model}
    linear = f.number("linear", 0.0, min=0)
    quadratic = f.number("quadratic", 0.0, min=0)
    f.done()
    return {"encoder_linear": linear, "encoder_quadratic": quadratic}


def _model(f: Fields) -> dict[str, Any]:
    """A transformer description for the cost formula; keeps only the keys given."""
    out: dict[str, Any] = {
        "hidden": f.integer("hidden", min=1),
        "layers": f.integer("layers", min=1),
    }
    for key in ("heads", "kv_heads", "ffn"):
        value = f.optional_int(key, min=1)
        if value is not None:
            out[key] = value
    if f.has("vocab"):
        out["vocab"] = f.integer("vocab", min=0)
    for key in ("gated", "causal"):
        if f.has(key):
            out[key] = f.flag(key, False)
    if "kv_heads" in out:
        heads = out.get("heads")
        if heads is None:
            fail(f.at("heads"), "is required with kv_heads")
        if heads % out["kv_heads"]:
            fail(f.at("kv_heads"), f"must divide heads ({heads})", out["kv_heads"])
    f.done()
    return out


def _checkpoint(top: Fields, base_dir: str | os.PathLike[str] | None) -> CheckpointSpec | None:
    if not top.has("checkpoint"):
        top.raw("checkpoint")
        return None
    f = top.mapping("checkpoint")
    d = CheckpointSpec(url="")
    spec = CheckpointSpec(
        url=resolve_path(f.text("url"), base_dir, field=f.at("url")),
        flush_seconds=f.number("flush_seconds", d.flush_seconds, min=0, exclusive_min=True),
        compact_every=f.integer("compact_every", d.compact_every, min=1),
        keep_bases=f.integer("keep_bases", d.keep_bases, min=1),
        storage_options=f.plain_mapping("storage_options"),
    )
    f.done()
    return spec


def _loader(f: Fields) -> LoaderSpec:
    d = LoaderSpec()
    spec = LoaderSpec(
        workers=f.integer("workers", d.workers, min=1, max=1024),
        threads_per_worker=f.integer("threads_per_worker", d.threads_per_worker, min=1, max=256),
        read_ahead=f.integer("read_ahead", d.read_ahead, min=1, max=1024),
        prefetch=f.integer("prefetch", d.prefetch, min=1, max=1024),
        lookahead=f.integer("lookahead", d.lookahead, min=0, max=1024),
        retain_steps=f.integer("retain_steps", d.retain_steps, min=1),
        read_retries=f.integer("read_retries", d.read_retries, min=0, max=100),
        standby=f.flag("standby", d.standby),
        task_seconds=_task_seconds(f, d.task_seconds),
        quotas=f.flag("quotas", d.quotas),
        reads_per_thread=f.integer("reads_per_thread", d.reads_per_thread, min=1, max=1024),
    )
    f.done()
    return spec


def _task_seconds(f: Fields, default: float) -> float:
    value = f.number("task_seconds", default, min=0)
    if 0 < value < 0.01 or value > 600:
        fail(f.at("task_seconds"), "must be 0 (never split) or between 0.01 and 600", value)
    return value


def _source(f: Fields, base_dir: str | os.PathLike[str] | None) -> SourceSpec:
    name = f.text("name", pattern=NAME_PATTERN)
    fmt = f.text("format", choices=FORMATS)
    raw_path = f.required("path")
    if isinstance(raw_path, str):
        raw_paths = [raw_path]
    elif (
        isinstance(raw_path, (list, tuple))
        and raw_path
        and all(isinstance(p, str) and p for p in raw_path)
    ):
        raw_paths = list(raw_path)
    else:
        fail(
            f.at("path"), "must be a path/URL (globs allowed) or a non-empty list of them", raw_path
        )
    paths = tuple(resolve_path(p, base_dir, field=f.at("path")) for p in raw_paths)
    weight = f.number("weight", 1.0, min=0)
    text = f.text("text", "txt" if fmt == "webdataset" else "text")
    image = _image_field(f, fmt)
    if fmt == "parquet" and image and image[0] == text:
        fail(f.at("image"), "must be another column than sources[].text", image[0])
    unit_records = f.optional_int("unit_records", min=1)
    if unit_records is not None and fmt == "jsonl":
        fail(f.at("unit_records"), "only applies to parquet and webdataset", unit_records)
    if fmt == "webdataset" and unit_records is None:
        unit_records = 64
    unit_bytes = f.size("unit_bytes", 4 * 2**20)
    if f.has("unit_bytes") and fmt != "jsonl":
        fail(
            f.at("unit_bytes"),
            "only applies to format: jsonl (parquet reads row groups)",
            f.raw("unit_bytes"),
        )
    opts = f.plain_mapping("storage_options")
    epochs = f.optional_int("epochs", min=1)
    f.done()
    return SourceSpec(
        name=name,
        epochs=epochs,
        format=fmt,
        paths=paths,
        weight=weight,
        text=text,
        unit_bytes=unit_bytes,
        storage_options=opts,
        image=image,
        unit_records=unit_records,
    )


def _image_field(f: Fields, fmt: str) -> tuple[str, ...]:
    """``sources[].image``: a column (parquet) or the image files' extensions (webdataset)."""
    raw = f.raw("image")
    if raw is None:
        return IMAGE_EXTENSIONS if fmt == "webdataset" else ()
    if fmt == "jsonl":
        fail(f.at("image"), "images come from parquet or webdataset sources", raw)
    if fmt == "parquet":
        if isinstance(raw, (list, tuple)) and len(raw) == 1:
            raw = raw[0]
        if not isinstance(raw, str) or not raw:
            fail(f.at("image"), "must be the name of the image column", raw)
        return (raw,)
    items = raw.split(";") if isinstance(raw, str) else raw
    if (
        not isinstance(items, (list, tuple))
        or not items
        or not all(isinstance(x, str) and re.fullmatch(r"[A-Za-z0-9_.-]+", x) for x in items)
    ):
        fail(f.at("image"), "must be file extensions, e.g. [jpg, png] or 'jpg;png'", raw)
    return tuple(x.lower().lstrip(".") for x in items)


def resolve_path(path: str, base_dir: str | os.PathLike[str] | None, field: str = "path") -> str:
    """Expand ``${VAR}`` / ``${VAR:-default}``; make relative local paths absolute."""

    def expand(m: re.Match[str]) -> str:
        value = os.environ.get(m.group(1))
        if value is None:
            if m.group(2) is None:
                fail(field, f"environment variable {m.group(1)} is not set", path)
            value = m.group(2)
        return value

    out = _ENV.sub(expand, path)
    if "://" in out or os.path.isabs(out) or base_dir is None:
        return out
    return str(Path(base_dir) / out)

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

Mixing can follow a schedule (piecewise constant or linear, over steps or consumed tokens)::

    mixing:
      by: tokens                 # shares of tokens (or: documents)
      over: steps                # schedule positions are steps (or: tokens)
      interpolate: linear        # or constant
      schedule:
        - {at: 0, weights: {web: 3, books: 1}}
        - {at: 10000, weights: {web: 1, books: 1}}

A source with ``epochs: N`` stops after N passes; without it, it starts a new epoch with a fresh
shuffle. Every error names the field path and the value (``sources[1].weight: must be >= 0, got -1``).
Relative local paths are resolved against the plan file's folder; ``${VAR}`` and
``${VAR:-default}`` are expanded from the environment in paths.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ._validate import Fields, check_number, fail
from .errors import PlanError

__all__ = [
    "BatchSpec",
    "CostSpec",
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
]

PLAN_VERSION = 1
FORMATS = ("jsonl", "parquet")
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
class BatchSpec:
    """How global batches are cut.

    ``seq_len`` is the token capacity of one packed micro-batch; each rank gets ``micro_batches``
    of them per step (more in the rare step whose documents cannot be packed into that many).
    The global batch is a token budget (``global_tokens``) or a document count
    (``global_documents``); it does not depend on the DP size, so elastic resume keeps the stream.
    """

    seq_len: int
    micro_batches: int
    global_tokens: int | None
    global_documents: int | None
    long_documents: str = "split"
    max_document_tokens: int | None = None
    pad_to_seq_len: bool = False

    @property
    def document_cap(self) -> int:
        """Tokens kept of one document: ``seq_len`` when truncating, else ``max_document_tokens``."""
        if self.long_documents == "truncate":
            return self.seq_len
        return self.max_document_tokens or (self.global_tokens or 64 * self.seq_len)


@dataclass(frozen=True)
class LayoutSpec:
    """The trainer's parallel layout: dp x tp x pp x cp ranks, global rank order from ``order``."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    order: tuple[str, ...] = ("tp", "cp", "dp", "pp")

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
    """Cost of one document of L tokens: ``linear * L + quadratic * L**2`` (attention)."""

    linear: float = 1.0
    quadratic: float = 1.0 / (6 * 4096)


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
    version: int = PLAN_VERSION

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
        data["layout"]["order"] = "-".join(self.layout.order)
        data["mixing"]["schedule"] = [
            {"at": p.at, "weights": dict(p.weights)} for p in self.mixing.schedule
        ]
        for src in data["sources"]:
            src["path"] = list(src.pop("paths"))
            if src["format"] != "jsonl":
                src.pop("unit_bytes")
        return data

    def stream_fingerprint(self) -> str:
        """Hash of everything that decides the global sample stream (not loader tuning/layout)."""
        data = self.to_dict()
        for key in ("loader", "layout", "cost", "name"):
            data.pop(key)
        blob = json.dumps(data, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


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
        mixing=mixing,
        on_error=on_error,
        version=version,
    )


def _layout(f: Fields) -> LayoutSpec:
    axes = {axis: f.integer(axis, 1, min=1, max=65536) for axis in ("dp", "tp", "pp", "cp")}
    order_raw = f.text("order", "tp-cp-dp-pp")
    order = tuple(order_raw.split("-"))
    if sorted(order) != ["cp", "dp", "pp", "tp"]:
        fail(f.at("order"), "must name dp, tp, pp and cp once each, joined by '-'", order_raw)
    f.done()
    return LayoutSpec(order=order, **axes)


def _batch(f: Fields, layout: LayoutSpec) -> BatchSpec:
    seq_len = f.integer("seq_len", min=8)
    micro = f.integer("micro_batches", 1, min=1)
    tokens = f.optional_int("global_tokens", min=1)
    docs = f.optional_int("global_documents", min=1)
    if tokens is not None and docs is not None:
        fail(f.at("global_documents"), "give global_tokens or global_documents, not both", docs)
    if tokens is None and docs is None:
        tokens = layout.dp * micro * seq_len
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
    )


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
    default = CostSpec()
    linear = f.number("linear", default.linear, min=0)
    quadratic = f.number("quadratic", default.quadratic, min=0)
    if linear == 0 and quadratic == 0:
        fail(f.at("linear"), "linear and quadratic cannot both be 0", 0)
    f.done()
    return CostSpec(linear=linear, quadratic=quadratic)


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
    )
    f.done()
    return spec


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
    text = f.text("text", "text")
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
    )


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

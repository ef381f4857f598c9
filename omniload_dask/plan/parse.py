"""Plan files and plan data in, a validated :class:`~omniload_dask.plan.plan.Plan` out.

:func:`parse_plan` reads the top level and hands each section to its parser (``parse_*.py``),
then checks what spans sections (duplicate source names, buckets naming sources, images against
the tokenizer). The small run-time sections, ``loader`` and ``checkpoint``, are read here.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from omniload_dask.errors import PlanError
from omniload_dask.plan.choices import FANOUTS, ON_ERROR
from omniload_dask.plan.fields import Fields, fail, resolve_path
from omniload_dask.plan.parse_batch import check_bucket_sources, read_batch, read_layout
from omniload_dask.plan.parse_cost import read_cost
from omniload_dask.plan.parse_mixing import read_mixing
from omniload_dask.plan.parse_sources import (
    NAME_PATTERN,
    check_chat_placeholder,
    read_images,
    read_source,
    read_tokenizer,
)
from omniload_dask.plan.parse_stages import read_stages
from omniload_dask.plan.plan import PLAN_VERSION, Plan
from omniload_dask.plan.specs import NO_CAP, BatchSpec, CheckpointSpec, LoaderSpec, SourceSpec
from omniload_dask.plan.streams import read_streams

__all__ = ["load_plan", "parse_plan"]


def load_plan(path: str | os.PathLike[str]) -> Plan:
    """Read and validate a YAML plan file; relative paths are taken from its folder."""
    path = Path(path)
    try:
        blob = path.read_bytes()
    except OSError as exc:
        raise PlanError(f"plan file {str(path)!r}: cannot read it ({exc.strerror})") from None
    try:
        text = blob.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PlanError(
            f"plan file {str(path)!r}: not UTF-8 text (byte {blob[exc.start]:#04x} at offset "
            f"{exc.start}); save it as UTF-8"
        ) from None
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
    on_error = top.choice("on_error", "raise", ON_ERROR)
    layout = read_layout(top.mapping("layout"))
    batch_fields = top.mapping("batch")
    batch = read_stages(batch_fields, read_batch(batch_fields, layout), layout)
    tokenizer = read_tokenizer(top.mapping("tokenizer"), base_dir)
    cost = read_cost(top.mapping("cost"), base_dir)
    loader = _loader(top.mapping("loader"))
    checkpoint = _checkpoint(top, base_dir)
    mixing_fields = top.mapping("mixing")
    sources = tuple(
        read_source(Fields(raw, f"sources[{i}]"), base_dir)
        for i, raw in enumerate(top.sequence("sources"))
    )
    seen: dict[str, int] = {}
    for i, src in enumerate(sources):
        if src.name in seen:
            fail(f"sources[{i}].name", f"duplicates sources[{seen[src.name]}].name", src.name)
        seen[src.name] = i
    mixing = read_mixing(mixing_fields, [s.name for s in sources])
    if len(sources) > 1024:
        fail("sources", "at most 1024 sources are supported", len(sources))
    if sum(s.weight for s in sources) <= 0:
        fail("sources", "at least one source needs a weight > 0", [s.weight for s in sources])
    check_bucket_sources(batch, [s.name for s in sources])
    sources = tuple(_chat_cap(s, batch) for s in sources)
    streams = tuple(
        replace(s, sources=tuple(_chat_cap(x, s.batch) for x in s.sources))
        for s in read_streams(top.mapping("streams"), name, layout, batch, base_dir)
    )
    images = None
    every = [*sources, *(x for s in streams for x in s.sources)]
    if top.has("images") or any(s.has_images for s in every):
        images = read_images(top.mapping("images"), tokenizer)
    chat_images = [s.name for s in every if s.chat is not None and s.has_images]
    if images is not None and chat_images:
        check_chat_placeholder(images, tokenizer, chat_images[0])
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
        streams=streams,
    )


def _chat_cap(source: SourceSpec, batch: BatchSpec) -> SourceSpec:
    """A chat source's ``max_tokens``, where the plan leaves it unset: the batch's cap of its
    documents (conversations are skipped or refused, never cut)."""
    if source.chat is None or source.chat.max_tokens is not None:
        return source
    cap = batch.document_cap_for(source.name)
    if cap >= NO_CAP:
        return source
    return replace(source, chat=replace(source.chat, max_tokens=cap))


def _checkpoint(top: Fields, base_dir: str | os.PathLike[str] | None) -> CheckpointSpec | None:
    """The optional ``checkpoint`` section (None without it)."""
    if not top.has("checkpoint"):
        top.raw("checkpoint")
        return None
    f = top.mapping("checkpoint")
    d = CheckpointSpec(url="")
    spec = CheckpointSpec(
        url=resolve_path(f.text("url"), base_dir, field=f.at("url")),
        flush_seconds=f.number(
            "flush_seconds", d.flush_seconds, min=0, exclusive_min=True, max=86400
        ),
        compact_every=f.integer("compact_every", d.compact_every, min=1, max=2**30),
        keep_bases=f.integer("keep_bases", d.keep_bases, min=1, max=1000),
        storage_options=f.storage_options(),
    )
    f.done()
    return spec


def _loader(f: Fields) -> LoaderSpec:
    """The ``loader`` section (tuning only)."""
    d = LoaderSpec()
    f.renamed("reads_per_thread", "reads_per_slot")  # the reads are per read slot
    spec = LoaderSpec(
        workers=f.integer("workers", d.workers, min=1, max=1024),
        threads_per_worker=f.integer("threads_per_worker", d.threads_per_worker, min=1, max=256),
        read_ahead=f.integer("read_ahead", d.read_ahead, min=1, max=1024),
        prefetch=f.integer("prefetch", d.prefetch, min=1, max=1024),
        lookahead=f.integer("lookahead", d.lookahead, min=0, max=1024),
        retain_steps=f.integer("retain_steps", d.retain_steps, min=1, max=2**20),
        read_retries=f.integer("read_retries", d.read_retries, min=0, max=100),
        standby=f.flag("standby", d.standby),
        task_seconds=_task_seconds(f, d.task_seconds),
        quotas=f.flag("quotas", d.quotas),
        reads_per_slot=f.integer("reads_per_slot", d.reads_per_slot, min=1, max=1024),
        groups_per_task=f.integer("groups_per_task", d.groups_per_task, min=0, max=1 << 20),
        steps_per_task=f.integer("steps_per_task", d.steps_per_task, min=0, max=64),
        live_lead=f.integer("live_lead", d.live_lead, min=0, max=1 << 20),
        fanout=f.choice("fanout", d.fanout, FANOUTS),
        tls=f.flag("tls", d.tls),
    )
    f.done()
    return spec


def _task_seconds(f: Fields, default: float) -> float:
    """``loader.task_seconds``: 0, or a read task's target duration in seconds."""
    value = f.number("task_seconds", default, min=0)
    if 0 < value < 0.01 or value > 600:
        fail(f.at("task_seconds"), "must be 0 (never split) or between 0.01 and 600", value)
    return value

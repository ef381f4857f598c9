"""The whole validated plan: its sections, its plain-data form, and what decides its stream.

:meth:`Plan.to_dict` gives the plan back as data (``parse_plan`` reads it again to the same
plan); :meth:`Plan.resume_key` is what a checkpoint and the plan resuming from it must share;
:meth:`Plan.stream_fingerprint` hashes what decides the global sample stream;
:meth:`Plan.redacted` is the form every output shows (no credentials).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from omniload_dask.errors import PlanError
from omniload_dask.plan.choices import MixingBy, OnError
from omniload_dask.plan.credentials import (
    redact,
    redact_url,
    secret_values,
    without_credentials,
)
from omniload_dask.plan.spec_data import source_dict, tokenizer_dict
from omniload_dask.plan.specs import (
    BatchSpec,
    CheckpointSpec,
    CostSpec,
    ImageSpec,
    LayoutSpec,
    LoaderSpec,
    MixingSpec,
    SourceSpec,
    TokenizerSpec,
)
from omniload_dask.plan.streams import StreamSpec

__all__ = ["PLAN_VERSION", "Plan", "source_free", "source_identity"]

PLAN_VERSION = 1


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
    on_error: OnError = "raise"
    checkpoint: CheckpointSpec | None = None
    version: int = PLAN_VERSION
    images: ImageSpec | None = None  # set when a source has images
    streams: tuple[StreamSpec, ...] = ()  # named streams besides training (validation)

    @property
    def mixing_by(self) -> MixingBy:
        """What the mixing weights share out: ``tokens`` or ``documents``."""
        return self.mixing.by

    @property
    def source_names(self) -> list[str]:
        """The sources' names, in plan order."""
        return [s.name for s in self.sources]

    def source(self, name: str) -> SourceSpec:
        """The source called ``name``; a :class:`PlanError` naming the known ones otherwise."""
        for spec in self.sources:
            if spec.name == name:
                return spec
        raise PlanError(f"sources: no source named {name!r} (have {', '.join(self.source_names)})")

    @property
    def stream_names(self) -> list[str]:
        """The names of the streams besides training (``streams``), sorted."""
        return [s.name for s in self.streams]

    def stream(self, name: str) -> StreamSpec:
        """The stream called ``name``; a :class:`PlanError` naming the known ones otherwise."""
        for spec in self.streams:
            if spec.name == name:
                return spec
        have = ", ".join(self.stream_names) or "none"
        raise PlanError(f"streams: the plan has no stream named {name!r} (have: {have})")

    def to_dict(self) -> dict[str, Any]:
        """The resolved plan as plain data (what ``omniload validate`` prints)."""
        data = asdict(self)
        data.pop("streams")
        if self.streams:
            data["streams"] = {s.name: s.to_dict() for s in self.streams}
        layout = data["layout"]
        if layout["balance"] == "full":
            del layout["balance"]  # (the default: plans written before the choice read the same)
        if self.layout.rank_map:
            layout.pop("order")
            layout["rank_map"] = [list(c) for c in self.layout.rank_map]
        else:
            layout.pop("rank_map")
            layout["order"] = "-".join(self.layout.order)
        batch = data["batch"]
        if self.batch.buckets:
            del batch["seq_len"], batch["micro_batches"]
            batch["buckets"] = [b.to_dict() for b in self.batch.buckets]
        else:
            batch.pop("buckets")
        batch.pop("stages")
        if self.batch.stages:
            batch["stages"] = [stage.to_dict() for stage in self.batch.stages]
        data["cost"] = self.cost.to_dict()
        if data["images"] is None:
            del data["images"]
        data["mixing"]["schedule"] = [
            {"at": p.at, "weights": dict(p.weights)} for p in self.mixing.schedule
        ]
        data["sources"] = [source_dict(s) for s in self.sources]
        data["tokenizer"] = tokenizer_dict(self.tokenizer)
        if self.checkpoint is None:
            data.pop("checkpoint")
        else:
            data["checkpoint"]["storage_options"] = dict(self.checkpoint.storage_options)
        return data

    def redacted(self) -> dict[str, Any]:
        """:meth:`to_dict` fit to show or store: credentials ``***``, ``${env:...}`` references
        as written (see :mod:`omniload_dask.plan.credentials`). What ``omniload validate``
        prints, feeders get and checkpoints hold; it parses back to a plan."""
        return dict(redact(self.to_dict()))

    def secrets(self) -> set[str]:
        """The credential values this process knows of the plan (literal ones, references set
        here, URL passwords): what :func:`~omniload_dask.plan.credentials.scrub` takes out of
        error texts before they are shown."""
        options = [s.storage_options for s in self.sources] + [self.tokenizer.storage_options]
        urls = [p for s in self.sources for p in s.paths] + [self.tokenizer.path or ""]
        if self.checkpoint is not None:
            options.append(self.checkpoint.storage_options)
            urls.append(self.checkpoint.url)
        return secret_values([*options, {"urls": urls}])

    def resume_key(self) -> dict[str, Any]:
        """What must match between a checkpoint's plan and the plan resuming from it.

        Weights, schedules, layout, loader tuning and the set of sources may change; the seed,
        tokenizer, batch budget, document handling and image settings may not, nor may a source
        that both plans name change its files, format, text or image field, or unit size.
        """
        batch = self.batch
        return {
            "seed": self.seed,
            "tokenizer": source_free(tokenizer_dict(self.tokenizer)),
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
        """Hash of everything that decides the global sample stream (not loader tuning/layout,
        nor credentials: a new key, or one moved to the environment, keeps the stream)."""
        data = without_credentials(self.to_dict())
        for key in ("loader", "layout", "cost", "name", "checkpoint", "streams"):
            data.pop(key, None)
        blob = json.dumps(data, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def source_identity(spec: SourceSpec) -> dict[str, Any]:
    """What a source may not change across a resume: where and how its records are read."""
    return {
        "paths": [redact_url(p) for p in spec.paths],
        "format": spec.format,
        "text": spec.text,
        "unit_bytes": spec.unit_bytes if spec.format == "jsonl" else None,
        "epochs": spec.epochs,
        "image": list(spec.image),
        "unit_records": spec.unit_records,
        # token sources only (absent elsewhere: identities stored before them still match)
        **{
            key: getattr(spec, key)
            for key in ("tokens", "dtype", "eod")
            if getattr(spec, key) is not None
        },
        **({"mask": asdict(spec.mask)} if spec.mask is not None else {}),
    }


def source_free(data: dict[str, Any]) -> dict[str, Any]:
    """Drop credentials-like options from a dict before it is compared or stored."""
    return {k: v for k, v in data.items() if k != "storage_options"}

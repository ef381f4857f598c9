"""Further named streams of a plan (``streams``): validation sets served beside training.

A plan's top-level sources make its training stream. ``streams`` names further streams, each
with its own sources and, optionally, its own batch budget; the job serves them from the same
cluster without touching the training stream (each stream runs its own data plane)::

    streams:
      validation:
        sources:                        # as the top-level sources; at least one
          - {name: held_out, format: jsonl, path: data/val/*.jsonl, epochs: 1}
        batch: {seq_len: 1024, micro_batches: 1}   # default: the plan's batch
        steps: 8                        # steps a pass; default: until every source ends
        rotation: 1                     # passes before the batches repeat (see below)

A *pass* over a stream starts it from step 0 with the plan's seed, so every pass gives the same
batches, split among the DP ranks by cost as training batches are. With ``rotation: R`` (and
``steps: S``) pass ``k`` gives steps ``[(k mod R) * S, (k mod R + 1) * S)`` of the stream
instead: R different slices in turn, each the same whenever it comes round.

:func:`omniload_dask.cluster.streams.stream_plan` makes the plan one pass runs.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass
from typing import Any

from omniload_dask.errors import PlanError
from omniload_dask.plan.fields import Fields, fail
from omniload_dask.plan.parse_batch import check_bucket_sources, read_batch
from omniload_dask.plan.parse_sources import read_source
from omniload_dask.plan.spec_data import source_dict
from omniload_dask.plan.specs import BatchSpec, LayoutSpec, SourceSpec

__all__ = [
    "MAX_PASS_DIGITS",
    "TRAIN",
    "StreamSpec",
    "batch_dict",
    "pass_job_name",
    "read_streams",
]

TRAIN = "train"  # the name of the plan's own (training) stream
STREAM_PATTERN = r"[A-Za-z][A-Za-z0-9_]{0,31}"
MAX_PASS_DIGITS = 10  # a pass's job is named "<plan>.<stream>.p<index>"
MAX_NAME = 64  # plan names (and so a pass's job name) are at most this long
MAX_PASS_STEPS = 2**31


@dataclass(frozen=True)
class StreamSpec:
    """One named stream besides training: its sources, batch and how a pass runs.

    ``steps`` is the number of steps of one pass (None: a pass runs until every source has
    ended, which needs ``epochs`` on each); ``rotation`` the number of passes before they
    repeat (1: every pass gives the same batches).
    """

    name: str
    sources: tuple[SourceSpec, ...]
    batch: BatchSpec
    steps: int | None = None
    rotation: int = 1

    def pass_range(self, index: int) -> tuple[int, int | None]:
        """The steps ``[first, end)`` pass ``index`` fetches (end None: the stream's end)."""
        if self.steps is None:
            return 0, None
        first = (index % self.rotation) * self.steps
        return first, first + self.steps

    def to_dict(self) -> dict[str, Any]:
        """The stream as plan data (:func:`read_streams` reads it back)."""
        out: dict[str, Any] = {
            "sources": [source_dict(s) for s in self.sources],
            "batch": batch_dict(self.batch),
        }
        if self.steps is not None:
            out["steps"] = self.steps
        if self.rotation != 1:
            out["rotation"] = self.rotation
        return out


def batch_dict(batch: BatchSpec) -> dict[str, Any]:
    """A batch spec as plan data: ``seq_len``/``micro_batches`` or ``buckets``."""
    data = asdict(batch)
    if batch.buckets:
        del data["seq_len"], data["micro_batches"]
        data["buckets"] = [b.to_dict() for b in batch.buckets]
    else:
        data.pop("buckets")
    data.pop("stages")  # (a stream's batch has none)
    return data


def read_streams(
    f: Fields,
    plan_name: str,
    layout: LayoutSpec,
    batch: BatchSpec,
    base_dir: str | os.PathLike[str] | None,
) -> tuple[StreamSpec, ...]:
    """The ``streams`` section: a mapping of stream name to ``{sources, batch, steps,
    rotation}``; errors name the field (``streams.validation.sources: ...``)."""
    out = []
    for name in sorted(f.data, key=str):
        if f.data[name] is None:
            continue
        if not isinstance(name, str) or not re.fullmatch(STREAM_PATTERN, name) or name == TRAIN:
            fail(
                f.at(str(name)),
                f"a stream name must match {STREAM_PATTERN} and not be {TRAIN!r} (the plan's "
                "own stream)",
                name,
            )
        longest = len(pass_job_name(plan_name, name, 10**MAX_PASS_DIGITS - 1))
        if longest > MAX_NAME:
            fail(
                f.at(name),
                f"the plan name and stream name are too long together: a pass's job is named "
                f"'<name>.<stream>.p<pass>' and must fit in {MAX_NAME} characters (shorten "
                "either)",
                name,
            )
        out.append(_stream(f.mapping(name), name, layout, batch, base_dir))
    f.done()
    return tuple(out)


def _stream(
    f: Fields,
    name: str,
    layout: LayoutSpec,
    main_batch: BatchSpec,
    base_dir: str | os.PathLike[str] | None,
) -> StreamSpec:
    if not f.has("sources"):
        fail(f.at("sources"), "a stream needs its own sources (a non-empty list)", f.raw("sources"))
    sources = tuple(
        read_source(Fields(raw, f"{f.at('sources')}[{i}]"), base_dir)
        for i, raw in enumerate(f.sequence("sources"))
    )
    seen: dict[str, int] = {}
    for i, src in enumerate(sources):
        if src.name in seen:
            fail(f"{f.at('sources')}[{i}].name", f"duplicates [{seen[src.name]}].name", src.name)
        seen[src.name] = i
    if sum(s.weight for s in sources) <= 0:
        fail(f.at("sources"), "at least one source needs a weight > 0", [s.weight for s in sources])
    given = f.has("batch")
    fields = f.mapping("batch")
    if fields.has("stages"):
        fail(fields.at("stages"), "a stream's batch has no stages", fields.raw("stages"))
    batch = read_batch(fields, layout) if given else main_batch
    if batch is main_batch and batch.buckets:
        try:
            check_bucket_sources(batch, list(seen))
        except PlanError as exc:
            raise PlanError(f"{f.at('batch')} (the plan's batch, taken as is): {exc}") from None
    elif batch.buckets:
        check_bucket_sources(batch, list(seen))
    steps = f.optional_int("steps", min=1, max=MAX_PASS_STEPS)
    rotation = f.integer("rotation", 1, min=1, max=2**20)
    if steps is None:
        endless = [s.name for s in sources if s.epochs is None]
        if endless:
            fail(
                f.at("steps"),
                "a pass needs steps, or epochs on every source of the stream (it then runs "
                "until they end); these sources have no epochs",
                endless,
            )
        if rotation != 1:
            fail(f.at("rotation"), "a rotation needs steps (a pass's length)", rotation)
    f.done()
    return StreamSpec(name, sources, batch, steps, rotation)


def pass_job_name(plan_name: str, stream: str, index: int) -> str:
    """The job name of pass ``index`` of ``stream`` of the job ``plan_name``."""
    return f"{plan_name}.{stream}.p{index}"

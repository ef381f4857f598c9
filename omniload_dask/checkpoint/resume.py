"""Resuming from a checkpoint, possibly with a changed plan.

The data plane (the scheduler plugin, or :class:`~omniload_dask.testing.InlineDataPlane`) resumes
in this order::

    saved, state = load_for_resume(plan, resume)  # read, check the plans agree, pick the step
    sources = registry_plan(plan, state)          # the checkpoint's sources first, then new ones
    catalogs = [discover(spec) for spec in sources.sources]
    catalogs = check_catalogs(state, catalogs)    # the files still hold the same read units
    coord = Coordinator(sources, catalogs, run_id)
    coord.load_state_dict(state)
    if saved.plan.stream_fingerprint() != plan.stream_fingerprint():
        apply_new_plan(coord, plan, catalogs)     # its weights, schedule and sources from here on

What may change between the saved plan and the resuming one is :meth:`Plan.resume_key
<omniload_dask.plan.Plan.resume_key>`'s business; :func:`compare_resume_keys` says what differs.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from omniload_dask.checkpoint.store import Checkpoint
from omniload_dask.core.state import catalog_fingerprint
from omniload_dask.errors import CheckpointError
from omniload_dask.plan import Plan, parse_source, source_dict

if TYPE_CHECKING:
    from omniload_dask.core.coordinator import Coordinator

__all__ = [
    "apply_new_plan",
    "check_catalogs",
    "compare_resume_keys",
    "load_for_resume",
    "registry_plan",
]


def load_for_resume(
    plan: Plan, resume: bool | int, unverified: bool = False
) -> tuple[Checkpoint, dict[str, Any]]:
    """Read and check the plan's checkpoint; the state to resume at (runs in a thread).

    ``unverified``: accept a manifest without its own digest (see :class:`Checkpoint`)."""
    assert plan.checkpoint is not None
    saved = Checkpoint(
        plan.checkpoint.url, dict(plan.checkpoint.storage_options), unverified=unverified
    )
    problems = compare_resume_keys(saved.plan, plan)
    if problems:
        raise CheckpointError(
            f"checkpoint {plan.checkpoint.url!r} belongs to another plan: " + "; ".join(problems)
        )
    if resume is True:
        positions = [int(p) for p in saved.manifest.positions.values()]
        step = min(positions) if positions else saved.latest_step
        step = max(saved.first_step, min(step, saved.latest_step))
    else:
        step = min(int(resume), saved.latest_step)
    return saved, saved.state_at(step)


def registry_plan(plan: Plan, state: dict[str, Any]) -> Plan:
    """The plan with the checkpoint's sources in their order (their indices are kept), then
    the plan's new sources; ``state`` gains empty entries for those (they join on resume)."""
    known = {src["spec"]["name"] for src in state["sources"]}
    for spec in plan.sources:
        if spec.name not in known:
            state["sources"].append({"spec": source_dict(spec), "catalog": None, "state": None})
            state["tags"].append(None)
            state["active"].append(0)
    specs = []
    for i, src in enumerate(state["sources"]):
        spec = parse_source(src["spec"], f"checkpoint.sources[{i}]")
        mine = next((s for s in plan.sources if s.name == spec.name), None)
        if mine is not None:  # credentials and options come from the new plan
            spec = replace(spec, storage_options=mine.storage_options)
        specs.append(spec)
    return replace(plan, sources=tuple(specs))


def check_catalogs(state: dict[str, Any], catalogs: list[Any]) -> list[Any]:
    """Refuse to resume when a source's files or read units differ from the checkpoint's;
    returns the catalogs to resume with.

    A checkpoint saved before small files were read several to a unit matches its source's
    catalog with one file a unit (``groups`` None): that run goes on so, reading the same
    records in the same order.
    """
    out = []
    for src, catalog in zip(state["sources"], catalogs, strict=True):
        saved = src["catalog"]
        if saved is not None and catalog_fingerprint(catalog) != saved:
            single = replace(catalog, groups=None) if catalog.groups is not None else None
            if single is None or catalog_fingerprint(single) != saved:
                raise CheckpointError(
                    f"source {src['spec']['name']!r}: its files or read units changed since "
                    f"the checkpoint ({len(catalog.files)} files now); the saved cursors would "
                    "not point at the same records (a checkpoint saved when small files were "
                    "merged up to unit_bytes resumes with sources[].merge_bytes set to the "
                    "source's unit_bytes, 4MiB by default)"
                )
            catalog = single
        out.append(catalog)
    return out


def apply_new_plan(coord: Coordinator, plan: Plan, catalogs: list[Any]) -> None:
    """Resuming with a changed plan: its weights, schedule and sources rule from here on
    (:meth:`Coordinator.adopt_plan <omniload_dask.core.coordinator.Coordinator.adopt_plan>`)."""
    coord.adopt_plan(plan, catalogs)


def compare_resume_keys(saved: Plan, new: Plan) -> list[str]:
    """Why ``new`` cannot resume a checkpoint of ``saved`` (empty: it can)."""
    a, b = saved.resume_key(), new.resume_key()
    problems = [
        f"{k}: {a[k]!r} in the checkpoint, {b[k]!r} now"
        + (
            " (to change it from a later step on, add a batch.stages entry)"
            if k[:6] == "batch."
            else ""
        )
        for k in a
        if k != "sources" and a[k] != b[k]
    ]
    for name, ident in b["sources"].items():
        old = a["sources"].get(name)
        if old is not None and old != ident:
            diff = [k for k in ident if ident[k] != old[k]]
            problems.append(
                f"sources.{name}: {', '.join(diff)} changed (add it under a new name instead)"
            )
    return problems

"""Parser of the ``mixing`` section and the check of a ``{source: weight}`` mapping.

:func:`check_weights` also validates weights changed live (``Job.set_weights``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omniload_dask.plan.choices import INTERPOLATIONS, MIXING_BY, MIXING_OVER
from omniload_dask.plan.fields import Fields, check_number, fail
from omniload_dask.plan.limits import MAX_SCHEDULE_AT, MAX_WEIGHT
from omniload_dask.plan.specs import MixingSpec, SchedulePoint

__all__ = ["check_weights", "read_mixing"]


def read_mixing(f: Fields, names: list[str]) -> MixingSpec:
    """The ``mixing`` section: what is shared out, and the schedule of weights over ``names``."""
    by = f.choice("by", "tokens", MIXING_BY)
    over = f.choice("over", "steps", MIXING_OVER)
    interpolate = f.choice("interpolate", "constant", INTERPOLATIONS)
    points: list[SchedulePoint] = []
    raw = f.raw("schedule", [])
    if not isinstance(raw, (list, tuple)):
        fail(f.at("schedule"), "must be a list of {at, weights}", raw)
    for i, item in enumerate(raw):
        p = Fields(item, f"{f.at('schedule')}[{i}]")
        at = p.integer("at", min=0, max=MAX_SCHEDULE_AT)
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
        out[str(name)] = check_number(f"{path}.{name}", value, min=0, max=MAX_WEIGHT)
    if not any(v > 0 for v in out.values()):
        fail(path, "at least one weight must be > 0", dict(weights))
    return out

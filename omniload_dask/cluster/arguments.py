"""Checking the arguments of the data plane's RPC handlers: every one has a defined answer.

Anything can arrive over Dask's RPC: a string for a rank, a negative step, ``2**64`` or
``float("inf")``. Each argument is checked where a handler takes it, and a bad one raises
:class:`~omniload_dask.errors.JobError` naming the argument and the value (the caller gets it
re-raised), never a raw ``OverflowError`` from numpy or ``int()`` deeper in, and never an
endless wait (a timeout must be finite)::

    integer("start", 2**64)     JobError: start must be an integer from 0 to 2**63 - 1, ...
    number("timeout", inf)      JobError: timeout must be a finite number >= 0 ..., got inf

Integers go up to ``2**63 - 1``, what the data plane's int64 arrays and a checkpoint hold.
An integer outside 64 bits cannot even be sent (msgpack raises ``OverflowError`` in the caller):
:func:`omniload_dask.internals.comms.check_sendable` turns that into the same typed error before
a call leaves the client.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from omniload_dask.errors import JobError

__all__ = [
    "MAX_INTEGER",
    "MAX_TIMEOUT",
    "flag",
    "integer",
    "number",
    "optional_step",
    "resume_arguments",
    "weights",
]

MAX_INTEGER = 2**63 - 1
MAX_TIMEOUT = 3600.0  # seconds a long-poll may be asked to wait (a feeder asks for ~2)


def integer(name: str, value: Any, minimum: int = 0, maximum: int = MAX_INTEGER) -> int:
    """``value`` as an int in ``[minimum, maximum]`` (bools are not integers here)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise JobError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if value > maximum:
        top = "2**63 - 1" if maximum == MAX_INTEGER else str(maximum)
        raise JobError(f"{name} must be an integer from {minimum} to {top}, got {value!r}")
    return int(value)


def number(name: str, value: Any, minimum: float = 0.0, maximum: float = math.inf) -> float:
    """``value`` as a finite float in ``[minimum, maximum]`` (an int too large for a float is
    refused)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise JobError(f"{name} must be a number >= {minimum:g}, got {value!r}")
    try:
        out = float(value)
    except OverflowError:
        out = math.inf
    if not math.isfinite(out) or not minimum <= out <= maximum:
        top = "" if maximum == math.inf else f" and <= {maximum:g}"
        raise JobError(f"{name} must be a finite number >= {minimum:g}{top}, got {value!r}")
    return out


def flag(name: str, value: Any) -> bool:
    """A true/false argument (not a truthy value of another type)."""
    if not isinstance(value, bool):
        raise JobError(f"{name} must be true or false, got {value!r}")
    return value


def resume_arguments(resume: Any, unverified: Any) -> tuple[bool | int | None, bool]:
    """``start``'s ``resume`` (None, a bool, or a step) and ``resume_unverified`` (a bool)."""
    if resume is not None and not isinstance(resume, bool):
        resume = integer("resume", resume)
    return resume, flag("resume_unverified", unverified)


def optional_step(name: str, value: Any) -> int | None:
    """A step argument that may be left out (None: the handler's default)."""
    return None if value is None else integer(name, value)


def weights(value: Any) -> dict[str, float]:
    """Source weights of ``set_weights``: a mapping of names to finite numbers (their own
    rules, > 0 and known sources, are the data plane's to check)."""
    if not isinstance(value, Mapping):
        raise JobError(f"set_weights: weights must be a mapping of source to weight, got {value!r}")
    out: dict[str, float] = {}
    for source, weight in value.items():
        if not isinstance(source, str):
            raise JobError(f"set_weights: source names must be strings, got {source!r}")
        if isinstance(weight, (int, float)) and not isinstance(weight, bool):
            try:
                if math.isfinite(float(weight)):
                    out[source] = float(weight)
                    continue
            except OverflowError:
                pass
        raise JobError(f"set_weights: weight of {source!r} must be a finite number, got {weight!r}")
    return out

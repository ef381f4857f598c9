"""Pickling a record of small arrays as one byte string (what a recipe table travels as).

Dask pickles a task's arguments with protocol 5 and sends every array buffer as a frame of its
own; each frame costs the sender a few tens of microseconds whatever its size (a compression
check, a metrics context, a length), and a task goes client -> scheduler -> worker. A block's
construction task carries 16 steps' recipe tables of 6 small arrays each: about a hundred
frames. :func:`packed_reduce` makes such a record pickle its arrays in-band, concatenated into
one ``bytes`` value, so the task pickles as one frame::

    RecipeTable(step=3, groups=int64 (8,), pieces=int64 (40, 5), ...)
    -> restore_packed(RecipeTable, b"<all arrays' bytes>", (("groups", "<i8", (8,)), ...),
                      {"step": 3, ...})
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["packed_reduce", "restore_packed"]

Layout = tuple[tuple[str, str, tuple[int, ...]], ...]  # (field, dtype, shape) per array


def packed_reduce(obj: Any, arrays: Sequence[str]) -> tuple[Any, tuple[Any, ...]]:
    """What ``obj.__reduce__`` returns: its fields ``arrays`` as one byte string, the other
    fields as they are."""
    fields = dict(vars(obj))
    parts, layout = [], []
    for name in arrays:
        value = np.ascontiguousarray(fields.pop(name))
        parts.append(value.tobytes())
        layout.append((name, value.dtype.str, value.shape))
    return restore_packed, (type(obj), b"".join(parts), tuple(layout), fields)


def restore_packed(cls: type, blob: bytes, layout: Layout, fields: dict[str, Any]) -> Any:
    """The record :func:`packed_reduce` packed (its arrays writable, in one buffer)."""
    buffer = bytearray(blob)
    obj: Any = object.__new__(cls)
    at = 0
    for name, dtype, shape in layout:
        kind = np.dtype(dtype)
        # (math.prod of a tuple: numpy's prod costs microseconds a call, and the scheduler
        # unpickles every array of every table of every block's task)
        count = math.prod(shape)
        fields[name] = np.frombuffer(buffer, kind, count, at).reshape(shape)
        at += count * kind.itemsize
    vars(obj).update(fields)
    return obj

"""The data plane's state as plain data: full snapshots and per-step deltas (pure, no I/O).

A snapshot holds everything that cannot be re-derived from the files: per source its spec and
cursor (epoch, position, row) and counters, the mixer's finish tags, the log of live changes,
and the job's counters. Read units, shards and recipes are not in it: they follow from the
cursors. A delta holds, for one drawn step, only what that step changed::

    {"step": 41, "src": {"0": [2, 7, 130, 5021, 901833, 0, 0, 0]}, "tag": {"0": 1.8e5},
     "vtime": 180344.2, "cnt": [...]}                            (about 200 bytes)

Applying the deltas of steps B..S-1 to the snapshot at step B gives the state at step S, so a
checkpoint made of one base and its deltas can restore any step in between exactly.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

import numpy as np

from .sources import Catalog

if TYPE_CHECKING:
    from .coordinator import Coordinator

__all__ = ["StateRecorder", "apply_deltas", "catalog_fingerprint", "restore", "snapshot"]

STATE_VERSION = 1
COUNTERS = (
    "documents",
    "tokens",
    "capacity_tokens",
    "extra_micro_steps",
    "cuts",
    "spilled",
    "steps_drawn",
    "efficiency_sum",
    "efficiency_min",
)


def catalog_fingerprint(catalog: Catalog) -> str:
    """A short hash of a source's files and read units: the cursors are only valid for it."""
    h = hashlib.sha256()
    h.update(json.dumps(list(catalog.files)).encode())
    h.update(np.ascontiguousarray(catalog.units, dtype=np.int64).tobytes())
    return h.hexdigest()[:16]


def _vector(coord: Coordinator, i: int) -> list[int]:
    return list(coord.streams[i].state_dict().values())


def snapshot(coord: Coordinator) -> dict[str, Any]:
    """The full state at ``coord.next_step`` (JSON-able)."""
    from .plan import source_dict

    return {
        "version": STATE_VERSION,
        "step": coord.next_step,
        "end_step": coord.end_step,
        "sources": [
            {
                "spec": source_dict(s.spec),
                "catalog": catalog_fingerprint(s.catalog),
                "state": _vector(coord, i),
            }
            for i, s in enumerate(coord.streams)
        ],
        "tags": coord.mixer.tags.tolist(),
        "vtime": coord.mixer.vtime,
        "active": coord._active.astype(int).tolist(),
        "schedule": coord.schedule.state_dict(),
        "log": list(coord.log),
        "counters": [getattr(coord, k) for k in COUNTERS],
    }


def apply_deltas(state: dict[str, Any], deltas: list[dict[str, Any]], until: int) -> dict[str, Any]:
    """The snapshot ``state`` moved forward by the deltas of steps below ``until``."""
    out = json.loads(json.dumps(state))
    for delta in deltas:
        if "log" in delta:
            out["log"].append(delta["log"])
            if delta["log"]["kind"] == "add" and not any(
                s["spec"]["name"] == delta["log"]["spec"]["name"] for s in out["sources"]
            ):
                out["sources"].append(
                    {
                        "spec": delta["log"]["spec"],
                        "catalog": delta["log"]["catalog"],
                        "state": None,
                    }
                )
                out["tags"].append(None)
                out["active"].append(0)
            continue
        if delta["step"] < out["step"]:
            continue  # already in the base
        if delta["step"] >= until:
            continue  # later steps; live changes logged after them still count
        for i, vec in delta["src"].items():
            out["sources"][int(i)]["state"] = vec
        for i, tag in delta["tag"].items():
            out["tags"][int(i)] = tag
        out["vtime"] = delta["vtime"]
        out["active"] = delta.get("active", out["active"])
        out["counters"] = delta["cnt"]
        out["step"] = delta["step"] + 1
        out["end_step"] = delta.get("end")
    return out


def restore(coord: Coordinator, state: dict[str, Any]) -> None:
    """Put ``state`` (a snapshot, possibly moved forward) into a fresh coordinator whose
    streams were built from the snapshot's sources, in the same order."""
    if state.get("version") != STATE_VERSION:
        raise ValueError(f"unknown data-plane state version {state.get('version')!r}")
    coord.next_step = int(state["step"])
    coord.end_step = state.get("end_step")
    for stream, src in zip(coord.streams, state["sources"], strict=True):
        if src["state"] is not None:
            stream.load_state_dict(dict(zip(stream.STATE_KEYS, src["state"], strict=True)))
        else:  # added after this step: not part of the job yet
            stream.retired = True
    tags = [np.nan if t is None else t for t in state["tags"]]
    coord.mixer.tags = np.asarray(tags, dtype=np.float64)
    coord.mixer.tags[np.isnan(coord.mixer.tags)] = state["vtime"]
    coord.mixer.vtime = float(state["vtime"])
    coord._active = np.asarray(state["active"], dtype=bool)
    coord.schedule.load_state_dict(state["schedule"])
    coord.log = list(state["log"])
    for entry in coord.log:
        if entry["kind"] == "weights":
            coord.schedule.change(int(entry["step"]), entry["weights"])
    for key, value in zip(COUNTERS, state["counters"], strict=True):
        setattr(coord, key, value)
    for rank in coord.ranks.values():
        rank.position = rank.requested_end = coord.next_step


class StateRecorder:
    """Collects a delta after every drawn step, and log entries as they happen."""

    def __init__(self, coord: Coordinator) -> None:
        self._vectors = [_vector(coord, i) for i in range(len(coord.streams))]
        self._tags: list[float | None] = list(coord.mixer.tags.tolist())
        self._active = coord._active.astype(int).tolist()
        self.pending: list[dict[str, Any]] = []

    def log(self, entry: dict[str, Any]) -> None:
        self.pending.append({"log": entry})

    def after_step(self, coord: Coordinator, step: int) -> None:
        n = len(coord.streams)
        while len(self._vectors) < n:  # a source joined
            self._vectors.append([])
            self._tags.append(None)
        delta: dict[str, Any] = {"step": step, "src": {}, "tag": {}}
        for i in range(n):
            vec = _vector(coord, i)
            if vec != self._vectors[i]:
                delta["src"][str(i)] = self._vectors[i] = vec
            tag = float(coord.mixer.tags[i])
            if tag != self._tags[i]:
                delta["tag"][str(i)] = self._tags[i] = tag
        active = coord._active.astype(int).tolist()
        if active != self._active:
            delta["active"] = self._active = active
        delta["vtime"] = coord.mixer.vtime
        delta["cnt"] = [getattr(coord, k) for k in COUNTERS]
        if coord.end_step is not None:
            delta["end"] = coord.end_step
        self.pending.append(delta)

    def take(self) -> list[dict[str, Any]]:
        out, self.pending = self.pending, []
        return out

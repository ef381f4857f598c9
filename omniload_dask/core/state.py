"""The data plane's state as plain data: full snapshots and per-step deltas (pure, no I/O).

A snapshot holds everything that cannot be re-derived from the files: per source its spec and
cursor (epoch, position, row) and counters, the mixer's finish tags, the log of live changes,
and the job's counters. Read units, shards and recipes are not in it: they follow from the
cursors. A delta holds, for one drawn step, only what that step changed::

    {"step": 41, "s": [[0, 130, 3, 1711]], "c": [3, 1711, 8192, 0, 0, 0, 1],
     "e": [40.93, 0.97]}                            (about 100 bytes; see StateRecorder)

Applying the deltas of steps B..S-1 to the snapshot at step B gives the state at step S, so a
checkpoint made of one base and its deltas can restore any step in between exactly.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

import numpy as np

from omniload_dask.sources import Catalog

if TYPE_CHECKING:
    from omniload_dask.core.coordinator import Coordinator

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
    from omniload_dask.plan import source_dict

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
        "by": coord.plan.mixing_by,
        "weights": [float(w) for w in coord._step_weights],
        "active": coord._active.astype(int).tolist(),
        "schedule": coord.schedule.state_dict(),
        "log": list(coord.log),
        "counters": [getattr(coord, k) for k in COUNTERS],
    }


def apply_deltas(state: dict[str, Any], deltas: list[dict[str, Any]], until: int) -> dict[str, Any]:
    """The snapshot ``state`` moved forward by the deltas of steps below ``until``."""
    out = json.loads(json.dumps(state))
    weights = out.get("weights") or []
    by_tokens = out.get("by", "tokens") == "tokens"
    for delta in deltas:
        if "log" in delta:
            _apply_log(out, delta["log"])
            continue
        if delta["step"] < out["step"] or delta["step"] >= until:
            continue  # in the base already / later (changes logged after them still count)
        weights = delta.get("w", weights)
        tags = out["tags"]
        for entry in delta.get("s", ()):
            i, row, d_docs, d_tokens = entry[:4]
            vec = out["sources"][i]["state"]
            vec[2], vec[3], vec[4] = row, vec[3] + d_docs, vec[4] + d_tokens
            if len(entry) > 4:
                vec[1] = entry[4]
            if len(entry) > 5:
                vec[0] = entry[5]
            tags[i] = tags[i] + (d_tokens if by_tokens else d_docs) / weights[i]
            out["vtime"] = max(out["vtime"], tags[i])
        for i, vec in delta.get("x", {}).items():
            old = out["sources"][int(i)]["state"]
            d_docs, d_tokens = vec[3] - old[3], vec[4] - old[4]
            out["sources"][int(i)]["state"] = vec
            if d_docs:
                tags[int(i)] = tags[int(i)] + (d_tokens if by_tokens else d_docs) / weights[int(i)]
                out["vtime"] = max(out["vtime"], tags[int(i)])
        for i, tag in delta.get("t", {}).items():
            tags[int(i)] = tag
        out["vtime"] = delta.get("v", out["vtime"])
        out["active"] = delta.get("a", out["active"])
        out["counters"] = [
            a + b for a, b in zip(out["counters"][:7], delta["c"], strict=True)
        ] + list(delta["e"])
        out["weights"] = weights
        out["step"] = delta["step"] + 1
        out["end_step"] = delta.get("end")
    return out


def _apply_log(out: dict[str, Any], entry: dict[str, Any]) -> None:
    out["log"].append(entry)
    if entry["kind"] == "add" and not any(
        s["spec"]["name"] == entry["spec"]["name"] for s in out["sources"]
    ):
        out["sources"].append({"spec": entry["spec"], "catalog": entry["catalog"], "state": None})
        out["tags"].append(None)
        out["active"].append(0)


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
    """Collects a compact delta after every drawn step, and log entries as they happen.

    Per source that moved: ``[index, row, +documents, +tokens(, position(, epoch))]``. Its
    mixer tag is not stored: it follows as ``tag + consumed / weight``, which is exactly how
    the mixer computed it (an explicit ``t`` entry covers any other change). The rarely
    changing fields (skipped, truncated, retired) come as whole vectors under ``x``.
    """

    def __init__(self, coord: Coordinator) -> None:
        self.by_tokens = coord.plan.mixing_by == "tokens"
        self._vectors = [_vector(coord, i) for i in range(len(coord.streams))]
        self._tags: list[float | None] = list(coord.mixer.tags.tolist())
        self._active = coord._active.astype(int).tolist()
        self._weights: list[float] | None = None
        self._counters = [getattr(coord, k) for k in COUNTERS]
        self._vtime = coord.mixer.vtime
        self.pending: list[dict[str, Any]] = []

    def log(self, entry: dict[str, Any]) -> None:
        self.pending.append({"log": entry})

    def after_step(self, coord: Coordinator, step: int) -> None:
        n = len(coord.streams)
        while len(self._vectors) < n:  # a source joined
            self._vectors.append([0] * 8)
            self._tags.append(None)
        delta: dict[str, Any] = {"step": step}
        weights = [float(w) for w in coord._step_weights]
        if weights != self._weights:
            delta["w"] = self._weights = weights
        moved, whole, tags = [], {}, {}
        vtime = self._vtime
        for i in range(n):
            vec, old = _vector(coord, i), self._vectors[i]
            tag = float(coord.mixer.tags[i])
            expected = self._tags[i]
            if vec != old:
                d_docs, d_tokens = vec[3] - old[3], vec[4] - old[4]
                if d_docs and expected is not None and weights[i] > 0:
                    expected = expected + (d_tokens if self.by_tokens else d_docs) / weights[i]
                    vtime = max(vtime, expected)
                if vec[5:] != old[5:]:
                    whole[str(i)] = vec
                else:
                    entry = [i, vec[2], d_docs, d_tokens]
                    if vec[0] != old[0]:
                        entry += [vec[1], vec[0]]
                    elif vec[1] != old[1]:
                        entry.append(vec[1])
                    moved.append(entry)
                self._vectors[i] = vec
            if tag != expected:
                tags[str(i)] = tag
            self._tags[i] = tag
        if moved:
            delta["s"] = moved
        if whole:
            delta["x"] = whole
        if tags:
            delta["t"] = tags
        if coord.mixer.vtime != vtime:
            delta["v"] = coord.mixer.vtime
        self._vtime = coord.mixer.vtime
        active = coord._active.astype(int).tolist()
        if active != self._active:
            delta["a"] = self._active = active
        counters = [getattr(coord, k) for k in COUNTERS]
        delta["c"] = [a - b for a, b in zip(counters[:7], self._counters[:7], strict=True)]
        delta["e"] = counters[7:]
        self._counters = counters
        if coord.end_step is not None:
            delta["end"] = coord.end_step
        self.pending.append(delta)

    def take(self) -> list[dict[str, Any]]:
        out, self.pending = self.pending, []
        return out

"""The data plane's state as plain data: full snapshots and per-step deltas (pure, no I/O).

A snapshot holds everything that cannot be re-derived from the files: per source its spec and
cursor (epoch, position, row) and counters, the mixer's finish tags, the log of live changes,
and the job's counters. Read units, shards and recipes are not in it: they follow from the
cursors. A delta holds, for one drawn step, only what that step changed::

    {"step": 41, "s": [[0, 130, 3, 1711]], "c": [3, 1711, 8192, 0, 0, 0, 1],
     "e": [40.93, 0.97]}                            (about 100 bytes; see StateRecorder)

Applying the deltas of steps B..S-1 to the snapshot at step B gives the state at step S, so a
checkpoint made of one base and its deltas can restore any step in between exactly.

The state lives in three parts of the data plane, which these functions read and restore:
the sources (:class:`~.live.LiveSources`: cursors, schedule, log), the mixer
(:class:`~.draw.Drawer`: tags, virtual time, who takes part) and the counters
(:class:`~.figures.Figures`).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from omniload_dask.core.draw import Drawer
from omniload_dask.core.figures import Figures
from omniload_dask.core.live import LiveSources
from omniload_dask.plan import source_dict
from omniload_dask.sources.catalog import catalog_fingerprint

__all__ = [
    "STATE_VERSION",
    "StateRecorder",
    "apply_deltas",
    "catalog_fingerprint",
    "restore",
    "snapshot",
]

STATE_VERSION = 1


def _vector(sources: LiveSources, i: int) -> list[int]:
    return list(sources.streams[i].state_dict().values())


def snapshot(
    step: int, end_step: int | None, sources: LiveSources, drawer: Drawer, figures: Figures
) -> dict[str, Any]:
    """The full state at ``step``, the first step not drawn yet (JSON-able)."""
    return {
        "version": STATE_VERSION,
        "step": step,
        "end_step": end_step,
        "sources": [
            {
                "spec": source_dict(s.spec),
                "catalog": catalog_fingerprint(s.catalog),
                "state": _vector(sources, i),
            }
            for i, s in enumerate(sources.streams)
        ],
        "tags": drawer.mixer.tags.tolist(),
        "vtime": drawer.mixer.vtime,
        "by": drawer.mixer.by,
        "weights": [float(w) for w in drawer.weights],
        "active": drawer.active.astype(int).tolist(),
        "schedule": sources.schedule.state_dict(),
        "log": list(sources.log),
        "counters": figures.counters(),
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


def restore(
    state: dict[str, Any], sources: LiveSources, drawer: Drawer, figures: Figures
) -> tuple[int, int | None]:
    """Put ``state`` (a snapshot, possibly moved forward) into fresh parts whose streams were
    built from the snapshot's sources, in the same order; returns ``(step, end_step)``.

    Changes logged for steps from ``step`` on (sources joining or leaving) are pending again.
    """
    if state.get("version") != STATE_VERSION:
        raise ValueError(f"unknown data-plane state version {state.get('version')!r}")
    step = int(state["step"])
    for stream, src in zip(sources.streams, state["sources"], strict=True):
        if src["state"] is not None:
            stream.load_state_dict(dict(zip(stream.STATE_KEYS, src["state"], strict=True)))
        else:  # added after this step: not part of the job yet
            stream.retired = True
    tags = np.asarray([np.nan if t is None else t for t in state["tags"]], dtype=np.float64)
    tags[np.isnan(tags)] = state["vtime"]
    drawer.restore(tags, float(state["vtime"]), np.asarray(state["active"], dtype=bool))
    sources.restore(state["schedule"], state["log"], step)
    figures.load_counters(state["counters"])
    return step, state.get("end_step")


class StateRecorder:
    """Collects a compact delta after every drawn step, and log entries as they happen.

    Per source that moved: ``[index, row, +documents, +tokens(, position(, epoch))]``. Its
    mixer tag is not stored: it follows as ``tag + consumed / weight``, which is exactly how
    the mixer computed it (an explicit ``t`` entry covers any other change). The rarely
    changing fields (skipped, truncated, retired) come as whole vectors under ``x``.
    """

    def __init__(self, sources: LiveSources, drawer: Drawer, figures: Figures) -> None:
        """Start from the parts' state now (deltas are of the steps drawn after it)."""
        self._sources = sources
        self._drawer = drawer
        self._figures = figures
        self.by_tokens = drawer.mixer.by == "tokens"
        self._vectors = [_vector(sources, i) for i in range(len(sources.streams))]
        self._tags: list[float | None] = list(drawer.mixer.tags.tolist())
        self._active = drawer.active.astype(int).tolist()
        self._weights: list[float] | None = None
        self._counters = figures.counters()
        self._vtime = drawer.mixer.vtime
        self.pending: list[dict[str, Any]] = []

    def log(self, entry: dict[str, Any]) -> None:
        """A live change was logged."""
        self.pending.append({"log": entry})

    def after_step(self, step: int, end_step: int | None) -> None:
        """Step ``step`` was drawn: record what it changed."""
        mixer = self._drawer.mixer
        n = len(self._sources.streams)
        while len(self._vectors) < n:  # a source joined
            self._vectors.append([0] * 8)
            self._tags.append(None)
        delta: dict[str, Any] = {"step": step}
        weights = [float(w) for w in self._drawer.weights]
        if weights != self._weights:
            delta["w"] = self._weights = weights
        moved, whole, tags = [], {}, {}
        vtime = self._vtime
        for i in range(n):
            vec, old = _vector(self._sources, i), self._vectors[i]
            tag = float(mixer.tags[i])
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
        if mixer.vtime != vtime:
            delta["v"] = mixer.vtime
        self._vtime = mixer.vtime
        active = self._drawer.active.astype(int).tolist()
        if active != self._active:
            delta["a"] = self._active = active
        counters = self._figures.counters()
        delta["c"] = [a - b for a, b in zip(counters[:7], self._counters[:7], strict=True)]
        delta["e"] = counters[7:]
        self._counters = counters
        if end_step is not None:
            delta["end"] = end_step
        self.pending.append(delta)

    def take(self) -> list[dict[str, Any]]:
        """The deltas and log entries since the last call, in order."""
        out, self.pending = self.pending, []
        return out

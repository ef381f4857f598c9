"""The data plane's state as plain data: full snapshots and per-step deltas (pure, no I/O).

A snapshot holds everything that cannot be re-derived from the files: per source its spec and
cursor (epoch, position, row, and the offset into a document cut between two steps) and
counters, the mixer's finish tags, the log of live changes, and the job's counters. Read units, shards and recipes are not in it: they follow from the
cursors. A delta holds, for one drawn step, only what that step changed::

    {"step": 41, "s": [[0, 130, 3, 1711]], "c": [3, 1711, 8192, 0, 0, 0, 1],
     "e": [40.93, 0.97]}                            (about 100 bytes; see StateRecorder)

Applying the deltas of steps B..S-1 to the snapshot at step B gives the state at step S, so a
checkpoint made of one base and its deltas can restore any step in between exactly. Live changes
come in the same list as ``{"log": entry}`` when they are asked for; a source that a change adds
has no cursor (``state`` None) until the step it joins at, and from then on a fresh one.

Version 2 added the offset (the ninth entry of a source's state vector); a version 1 state is
read as offset 0.

The state lives in three components of the data plane, which these functions read and restore:
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
from omniload_dask.core.streams import cursor_state
from omniload_dask.plan import source_dict
from omniload_dask.sources.catalog import catalog_fingerprint

__all__ = [
    "READABLE_VERSIONS",
    "STATE_VERSION",
    "StateRecorder",
    "apply_deltas",
    "catalog_fingerprint",
    "restore",
    "snapshot",
]

STATE_VERSION = 2
READABLE_VERSIONS = (1, 2)
# A source's state vector (SourceStream.STATE_KEYS): epoch, position, row, docs, tokens,
# skipped, truncated_tokens, retired, offset, filtered.
ROW, DOCS, TOKENS, OFFSET = 2, 3, 4, 8
RARE = slice(5, 8)  # skipped, truncated, retired: sent whole (under "x") when they change
LATER = slice(9, None)  # filtered (and keys added after it, and holes): sent whole too
FRESH = [0] * 10  # the state of a stream that has not drawn yet


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
    if out.get("version") not in READABLE_VERSIONS:
        raise ValueError(f"unknown data-plane state version {out.get('version')!r}")
    for src in out["sources"]:
        if src["state"] is not None and len(src["state"]) == OFFSET:  # version 1: no offset
            src["state"].append(0)
    out["version"] = STATE_VERSION
    weights = out.get("weights") or []
    by_tokens = out.get("by", "tokens") == "tokens"
    tags = out["tags"]

    def advance(i: int, d_docs: int, d_tokens: int) -> None:
        # the mixer's tag after the step, as StateRecorder expects it (None: a source that has
        # just joined; its tag comes under "t")
        size = d_tokens if by_tokens else d_docs
        if size and tags[i] is not None and weights[i] > 0:
            tags[i] = tags[i] + size / weights[i]
            out["vtime"] = max(out["vtime"], tags[i])

    for delta in deltas:
        if "log" in delta:
            _apply_log(out, delta["log"])
            continue
        if delta["step"] < out["step"] or delta["step"] >= until:
            continue  # in the base already / later (changes logged after them still count)
        weights = delta.get("w", weights)
        for entry in delta.get("s", ()):
            i, row, d_docs, d_tokens = entry[:4]
            vec = _cursor(out, i)
            vec[ROW], vec[DOCS], vec[TOKENS] = row, vec[DOCS] + d_docs, vec[TOKENS] + d_tokens
            if len(entry) > 4:
                vec[1] = entry[4]
            if len(entry) > 5:
                vec[0] = entry[5]
            advance(i, d_docs, d_tokens)
        for i, vec in delta.get("x", {}).items():
            old = _cursor(out, int(i))
            out["sources"][int(i)]["state"] = list(vec)
            advance(int(i), vec[DOCS] - old[DOCS], vec[TOKENS] - old[TOKENS])
        for i, offset in delta.get("o", {}).items():
            _cursor(out, int(i))[OFFSET] = offset
        for i, tag in delta.get("t", {}).items():
            tags[int(i)] = tag
        out["vtime"] = delta.get("v", out["vtime"])
        if "a" in delta:  # (of the sources at that step: one logged later joins inactive)
            out["active"] = _padded(delta["a"], len(out["sources"]), 0)
        out["counters"] = [
            a + b for a, b in zip(out["counters"][:7], delta["c"], strict=True)
        ] + list(delta["e"])
        out["weights"] = _padded(weights, len(out["sources"]), 0.0)
        out["step"] = delta["step"] + 1
        out["end_step"] = delta.get("end")
    # A source added before the step reached has joined: a fresh cursor if it has not moved.
    for entry in out["log"]:
        if entry["kind"] == "add" and entry["step"] < out["step"]:
            i = next(
                k for k, s in enumerate(out["sources"]) if s["spec"]["name"] == entry["source"]
            )
            _cursor(out, i)
    return out


def _apply_log(out: dict[str, Any], entry: dict[str, Any]) -> None:
    """A logged change: a source new to the job gets an entry without a cursor yet."""
    out["log"].append(entry)
    if entry["kind"] == "add" and not any(
        s["spec"]["name"] == entry["spec"]["name"] for s in out["sources"]
    ):
        out["sources"].append({"spec": entry["spec"], "catalog": entry["catalog"], "state": None})
        out["tags"].append(None)
        out["active"].append(0)


def _padded(values: list[Any], n: int, fill: Any) -> list[Any]:
    """``values`` for ``n`` sources: those added after they were recorded get ``fill``."""
    return list(values) + [fill] * (n - len(values))


def _cursor(out: dict[str, Any], i: int) -> list[int]:
    """Source i's state vector (a fresh one for a source that joins now)."""
    src = out["sources"][i]
    if src["state"] is None:
        src["state"] = list(FRESH)
    state: list[int] = src["state"]
    return state


def restore(
    state: dict[str, Any], sources: LiveSources, drawer: Drawer, figures: Figures
) -> tuple[int, int | None]:
    """Put ``state`` (a snapshot, possibly moved forward) into fresh components whose streams were
    built from the snapshot's sources, in the same order; returns ``(step, end_step)``.

    Changes logged for steps from ``step`` on (sources joining or leaving) are pending again.
    """
    if state.get("version") not in READABLE_VERSIONS:
        raise ValueError(f"unknown data-plane state version {state.get('version')!r}")
    step = int(state["step"])
    for stream, src in zip(sources.streams, state["sources"], strict=True):
        if src["state"] is not None:
            stream.load_state_dict(cursor_state(src["state"]))
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

    Per source that moved: ``[index, row, +documents, +tokens(, position(, epoch))]``, and
    its offset under ``o`` when that changed. Its mixer tag is not stored: it follows as
    ``tag + consumed / weight``, which is exactly how the mixer computed it (an explicit ``t``
    entry covers any other change). The rarely changing fields (skipped, truncated, retired)
    come as whole vectors under ``x``.
    """

    def __init__(self, sources: LiveSources, drawer: Drawer, figures: Figures) -> None:
        """Start from the components' state now (deltas are of the steps drawn after it)."""
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
        """Step ``step`` was drawn and committed just now: record what it changed."""
        self.committed(self.drawn(step), end_step)

    def drawn(self, step: int) -> dict[str, Any]:
        """Step ``step`` was drawn just now: what its draw changed (the sources, the mixer),
        to be completed by :meth:`committed` when the step is committed (its counted
        figures). Steps drawn ahead of their commit (several in flight) are recorded so,
        each with the state right after its own draw."""
        mixer = self._drawer.mixer
        n = len(self._sources.streams)
        while len(self._vectors) < n:  # a source joined
            self._vectors.append(list(FRESH))
            self._tags.append(None)
        delta: dict[str, Any] = {"step": step}
        weights = [float(w) for w in self._drawer.weights]
        if weights != self._weights:
            delta["w"] = self._weights = weights
        moved, whole, tags, offsets = [], {}, {}, {}
        vtime = self._vtime
        for i in range(n):
            vec, old = _vector(self._sources, i), self._vectors[i]
            tag = float(mixer.tags[i])
            expected = self._tags[i]
            if vec != old:
                d_docs, d_tokens = vec[DOCS] - old[DOCS], vec[TOKENS] - old[TOKENS]
                size = d_tokens if self.by_tokens else d_docs
                if size and expected is not None and weights[i] > 0:
                    expected = expected + size / weights[i]
                    vtime = max(vtime, expected)
                if vec[RARE] != old[RARE] or vec[LATER] != old[LATER]:
                    whole[str(i)] = vec
                else:
                    if vec[OFFSET] != old[OFFSET]:
                        offsets[str(i)] = vec[OFFSET]
                    entry = [i, vec[ROW], d_docs, d_tokens]
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
        if offsets:
            delta["o"] = offsets
        if tags:
            delta["t"] = tags
        if mixer.vtime != vtime:
            delta["v"] = mixer.vtime
        self._vtime = mixer.vtime
        active = self._drawer.active.astype(int).tolist()
        if active != self._active:
            delta["a"] = self._active = active
        return delta

    def committed(self, delta: dict[str, Any], end_step: int | None) -> None:
        """The step of ``delta`` (from :meth:`drawn`) was committed: add what it counted."""
        counters = self._figures.counters()
        delta["c"] = [a - b for a, b in zip(counters[:7], self._counters[:7], strict=True)]
        delta["e"] = counters[7:]
        self._counters = counters
        if end_step is not None:
            delta["end"] = end_step
        self.pending.append(delta)

    def restart(self, step: int) -> StateRecorder:
        """The components were put back to ``step`` (:mod:`.rewind`): a recorder of deltas from
        their state now, with this one's pending entries, less the deltas of steps from
        ``step`` on."""
        fresh = StateRecorder(self._sources, self._drawer, self._figures)
        fresh.pending = [d for d in self.pending if d.get("step", -1) < step]
        return fresh

    def take(self, below: int | None = None) -> list[dict[str, Any]]:
        """The deltas and log entries since the last call, in order; with ``below``, the
        deltas of steps from ``below`` on stay (they may be drawn again, :mod:`.rewind`)."""
        out, self.pending = self.pending, []
        if below is not None:
            self.pending = [d for d in out if d.get("step", -1) >= below]
            out = [d for d in out if d.get("step", -1) < below]
        return out

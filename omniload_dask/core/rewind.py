"""Drawing again what was drawn and not built, so that a live change takes effect sooner.

The data plane draws ahead of what it builds: where one construction builds a block of
several steps, its steps are drawn and committed one by one and built when the last one is
in, and every step is in flight between its draw and its commit. No rank has any of those
steps, so a live change may take effect at the first of them, the *floor*, instead of at the
first step not drawn::

    blocks of 4 from step 1; 1-4 built; 5, 6, 7 drawn (block 5-8 open)
    set_weights({...})       takes effect at 5 (the first step not drawn is 8)
                             the cursors, the mixer and the counters go back to their mark
                             at 5; the units the cursors passed in 5-7 go back to their
                             sources (their shards are held: releases wait for the block);
                             5, 6, 7 are drawn again, under the change

A mark is taken before each block's first step is drawn: every source's cursor and counters,
the mixer's tags, virtual time, weights and who took part, and (when the step is committed)
the job's counters. Marks below the floor are dropped. A source joining or leaving at a step
drawn since the floor cannot be taken back (its units were released): the floor is then the
first step not drawn.

The draw is a pure function of the cursors, the reported lengths, the weights and the log of
changes, so the steps drawn again are those of a fresh run with the change in its log. The
checkpoint holds steps below the floor only (:meth:`.Coordinator.take_deltas`, its snapshot
is the state at the floor), so a resume never meets a step drawn twice.

Pure: no I/O and no Dask.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omniload_dask.core.actions import Release
from omniload_dask.core.dealer import DrawnStep
from omniload_dask.core.delivery import Delivery
from omniload_dask.core.draw import Drawer
from omniload_dask.core.figures import Figures
from omniload_dask.core.keys import Keys
from omniload_dask.core.live import LiveSources
from omniload_dask.core.stepping import StepCycle
from omniload_dask.core.streams import SourceStream, Unit, cursor_state, put_cursor
from omniload_dask.errors import InternalError

__all__ = ["Mark", "Rewinds", "redraw"]


@dataclass
class Mark:
    """The data plane's state before step ``step`` was drawn (see the module docstring)."""

    step: int
    cursors: list[list[Any]]  # each source's SourceStream.state_dict() values
    tags: np.ndarray
    vtime: float
    active: np.ndarray
    weights: np.ndarray
    applied: int  # source changes in effect (LiveSources.applied)
    counters: list[Any] | None = None  # the job's counters before the step was committed
    finished: list[Unit] = field(default_factory=list)  # units passed from this step on


class Rewinds:
    """The marks of the steps drawn and not built, and taking the components back to one."""

    def __init__(self, sources: LiveSources, drawer: Drawer, figures: Figures, keys: Keys):
        self._sources = sources
        self._drawer = drawer
        self._figures = figures
        self._keys = keys
        self._marks: dict[int, Mark] = {}
        self._dropped: list[DrawnStep] = []  # steps in flight that a redraw dropped

    def was_dropped(self, drawn: DrawnStep) -> bool:
        """Whether a redraw dropped ``drawn`` while it was dealt (its split is void)."""
        if not any(drawn is d for d in self._dropped):
            return False
        self._dropped = [d for d in self._dropped if d is not drawn]
        return True

    def reset(self) -> None:
        """Forget every mark (a resume: nothing is drawn past the restored step)."""
        self._marks = {}

    def mark(self, step: int) -> None:
        """Step ``step`` begins a block and is drawn next: keep the state before it."""
        mixer, drawer = self._drawer.mixer, self._drawer
        self._marks[step] = Mark(
            step,
            [_cursor(s) for s in self._sources.streams],
            mixer.tags.copy(),
            mixer.vtime,
            drawer.active.copy(),
            drawer.weights.copy(),
            self._sources.applied,
        )

    def drawn(self, step: int, finished: list[Unit]) -> None:
        """Step ``step`` was drawn; the cursors passed ``finished``."""
        owners = [m for m in self._marks if m <= step] if finished else []
        if owners:
            self._marks[max(owners)].finished += finished

    def committing(self, step: int) -> None:
        """Step ``step`` is about to be committed (counted)."""
        mark = self._marks.get(step)
        if mark is not None and mark.counters is None:
            mark.counters = self._figures.counters()

    def prune(self, built: int) -> None:
        """Steps below ``built`` are built: drop their marks."""
        for step in [m for m in self._marks if m < built]:
            del self._marks[step]

    def floor(self, built: int, next_step: int) -> int:
        """The first step a change can take effect at: ``built`` (the first step not built)
        where it can be drawn again, else ``next_step``."""
        mark = self._marks.get(built)
        if built >= next_step or mark is None:
            return next_step
        same = mark.applied == self._sources.applied
        return built if same and len(mark.cursors) == len(self._sources.streams) else next_step

    def rewind(self, step: int) -> list[Unit]:
        """Put the sources, the mixer and the counters back to their mark at ``step`` (the
        floor); returns the units given back to the sources (their releases are void)."""
        mark = self._marks.get(step)
        if mark is None:
            raise InternalError(f"internal error: no mark to draw step {step} again")
        streams = self._sources.streams
        given: list[Unit] = []
        for later in sorted(m for m in self._marks if m >= step):
            given += self._marks.pop(later).finished
        for unit in given:
            stream = self._stream_of(unit)
            stream.units[(unit.epoch, unit.position)] = unit
        for stream, cursor in zip(streams, mark.cursors, strict=True):
            _restore(stream, cursor)
        self._drawer.restore(mark.tags.copy(), mark.vtime, mark.active.copy())
        self._drawer.weights = mark.weights.copy()
        self._drawer.starved = set()
        figures = self._figures
        if mark.counters is not None:  # (else no step from here on was counted)
            figures.load_counters(mark.counters)
        while figures.history and figures.history[-1].step >= step:
            figures.history.pop()
        return given

    def snapshot_at(self, step: int, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` (the snapshot of the components now) as it was at the mark of ``step``, the
        floor: the cursors, the mixer and the counters of then; the log and the schedule of
        now (changes for later steps are replayed from the log)."""
        mark = self._marks[step]
        out = dict(state, step=step, end_step=None)
        out["sources"] = [
            dict(src, state=list(cursor))
            for src, cursor in zip(state["sources"], mark.cursors, strict=True)
        ]
        out["tags"] = mark.tags.tolist()
        out["vtime"] = mark.vtime
        out["weights"] = [float(w) for w in mark.weights]
        out["active"] = mark.active.astype(int).tolist()
        if mark.counters is not None:
            out["counters"] = list(mark.counters)
        return out

    def _stream_of(self, unit: Unit) -> SourceStream:
        """The stream ``unit`` was read for (its key names the source)."""
        for i, stream in enumerate(self._sources.streams):
            if self._keys.read(i, (unit.epoch, unit.position)) == unit.key:
                return stream
        raise InternalError(f"internal error: no source of read unit {unit.key}")


def redraw(rewinds: Rewinds, cycle: StepCycle, delivery: Delivery, step: int) -> list[Release]:
    """Draw again from ``step`` (the floor): the components back to its mark, the steps in flight
    dropped, the block being drawn forgotten. Returns the releases that block held back of
    units not given back to their sources."""
    given = {k for u in rewinds.rewind(step) for k in u.keys}
    rewinds._dropped = [*rewinds._dropped, *cycle.rewind(step)][-256:]
    releases = []
    for release in delivery.unoffer(step):
        keys = tuple(k for k in release.keys if k not in given)
        if keys:
            releases.append(Release(keys))
    return releases


def _cursor(stream: SourceStream) -> list[Any]:
    return list(stream.state_dict().values())


def _restore(stream: SourceStream, cursor: list[Any]) -> None:
    """Put ``stream``'s cursor, counters and holes back (its units stay: shards still held)."""
    put_cursor(stream, cursor_state(cursor))

"""One source's sample stream: unit order per epoch, row order per unit, and the read cursor.

The stream of source s in epoch e is fixed by the seed alone::

    units in epoch e    = permutation of the catalog's units   (seed, source name, e)
    rows in unit u      = permutation of its records            (seed, source name, e, u)
    stream              = rows of unit order[0], then of order[1], ... then epoch e + 1

The cursor ``(epoch, position, row, offset)`` is the whole consumption state: ``offset`` is how
many tokens of the row at the cursor earlier batches took already (a document that continues in
the next global batch, ``long_documents: split``). Record counts per unit
are learned when the unit's read task reports, so the stream is only known up to the first unit
that has not reported yet; :meth:`SourceStream.candidates` says how far it is known.

A unit may be read in several portions (tasks over sub-ranges that together hold its records
in file order, see :mod:`.autoscale`); it is known once every portion has reported, and its
rows are then numbered across the portions exactly as if it had been read whole.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omniload_dask.batching.labels import Holes
from omniload_dask.core.actions import ReadSpec
from omniload_dask.core.keys import Keys
from omniload_dask.errors import JobError
from omniload_dask.plan import SourceSpec
from omniload_dask.sources import Catalog

__all__ = ["SourceStream", "Unit", "UnitRef", "cursor_state", "put_cursor"]

UnitRef = tuple[int, int]  # (epoch, position in that epoch's unit order)


@dataclass
class Unit:
    """A submitted read unit; ``lengths``/``order`` arrive with its read tasks' reports.

    ``extra`` is a cost per record beyond its tokens' (image encoder terms), when the source
    reports one; ``holes`` its records' tokens that are no targets (chat sources, images: what
    the dealer counts a step's loss tokens with). With ``portions > 1`` the unit is read by
    tasks ``keys[p]``; ``bounds`` numbers their records: portion p holds the unit's rows
    ``bounds[p]:bounds[p + 1]``.
    """

    key: str
    epoch: int
    position: int
    catalog_index: int
    lengths: np.ndarray | None = None
    order: np.ndarray | None = None
    skipped: int = 0
    filtered: int = 0  # records the source's filter or transform dropped
    extra: np.ndarray | None = None
    holes: Holes | None = None
    portions: int = 1
    portion_sizes: tuple[int, ...] = ()
    bounds: np.ndarray | None = None
    specs: tuple[ReadSpec, ...] = field(default=(), repr=False)  # its portions', once made
    # lengths came from the source's index at submission; the portions' reports only feed meters
    up_front: bool = False
    _metered: set[int] = field(default_factory=set, repr=False)
    _reported: dict[int, tuple[np.ndarray, int, np.ndarray | None, int, Holes | None]] = field(
        default_factory=dict, repr=False
    )

    @property
    def keys(self) -> tuple[str, ...]:
        """The keys of its read tasks (the unit's own key when it is read whole)."""
        if self.portions == 1:
            return (self.key,)
        return tuple(Keys.read_portion(self.key, p) for p in range(self.portions))

    @property
    def pending(self) -> int:
        """Read tasks of this unit that have not reported yet."""
        if self.up_front:
            return self.portions - len(self._metered)
        return 0 if self.lengths is not None else self.portions - len(self._reported)

    def locate(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(portion, row within the portion)`` of the unit's ``rows``."""
        if self.portions == 1 or self.bounds is None:
            return np.zeros(len(rows), dtype=np.int64), rows
        portion = self.bounds.searchsorted(rows, side="right") - 1
        return portion, rows - self.bounds[portion]

    _capped: tuple[int, int] | None = None

    def capped_tokens(self, cap: int) -> int:
        """Tokens of its records, each document counted up to ``cap`` (cached)."""
        if self._capped is None or self._capped[0] != cap:
            total = int(np.minimum(self.lengths, cap).sum()) if self.lengths is not None else 0
            self._capped = (cap, total)
        return self._capped[1]


@dataclass
class Candidates:
    """Upcoming documents of one source: effective lengths and where each one lives."""

    lengths: np.ndarray
    raw: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # before the cap
    units: list[Unit] = field(default_factory=list)
    unit_of: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    row_of: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    waiting: bool = False  # stopped at a unit whose report has not arrived
    complete: bool = False  # the source ends after these (its last epoch)
    offset: int = 0  # > 0: the first candidate is the rest of a document from this token on
    _running: np.ndarray | None = field(default=None, repr=False)  # cumulative lengths

    def prefix(self, want_tokens: int, want_docs: int) -> Candidates:
        """The shortest prefix with at least ``want_*`` (whole units are collected;
        the mixer only needs what the wants ask for, and sorting less is faster)."""
        if self._running is None:
            self._running = self.lengths.cumsum()
        keep = max(int(self._running.searchsorted(want_tokens)) + 1, want_docs)
        if keep >= len(self.lengths):
            return self
        return Candidates(
            self.lengths[:keep],
            self.raw[:keep],
            self.units,
            self.unit_of[:keep],
            self.row_of[:keep],
            waiting=False,
            complete=False,
            offset=self.offset,
        )

    @property
    def continuing(self) -> bool:
        """Whether the first candidate is the rest of a document begun in an earlier batch."""
        return self.offset > 0 and len(self.lengths) > 0

    def covers(self, want_tokens: int, want_docs: int) -> bool:
        """True if these candidates answer a request for at least that much."""
        if self.waiting or self.complete:
            return True
        if self._running is None:
            self._running = self.lengths.cumsum()
        total = int(self._running[-1]) if len(self._running) else 0
        return total >= want_tokens and len(self.lengths) >= want_docs


class SourceStream:
    """Cursor and in-flight units of one source (pure; keys are made by the read-ahead)."""

    def __init__(self, index: int, spec: SourceSpec, catalog: Catalog, seed: int) -> None:
        """Source ``index`` of the job at the start of its first epoch."""
        if catalog.num_units == 0:
            raise JobError(f"source {spec.name!r}: its files hold no data (0 read units)")
        self.index = index
        self.spec = spec
        self.catalog = catalog
        self.seed = seed
        self._name_hash = zlib.crc32(spec.name.encode())
        self._orders: dict[int, np.ndarray] = {}
        self.epoch = 0
        self.position = 0
        self.row = 0
        self.offset = 0  # tokens of the row at the cursor that earlier batches took
        self.next_submit: UnitRef = (0, 0)
        self.units: dict[UnitRef, Unit] = {}
        self.docs = self.tokens = self.skipped = self.filtered = self.truncated_tokens = 0
        self.retired = False  # removed from the job (its cursor is kept)
        self.holes: frozenset[tuple[int, int, int]] = frozenset()  # taken ahead (.pool)
        self._cache: tuple[int, Candidates] | None = None  # candidates while nothing changes
        self.version = 0  # bumped whenever the cursor moves or a unit reports

    @property
    def exhausted(self) -> bool:
        """True once the source has served its last epoch (``epochs`` in the plan)."""
        return self.spec.epochs is not None and self.epoch >= self.spec.epochs

    def within_epochs(self, ref: UnitRef) -> bool:
        """Whether unit ``ref`` lies in an epoch the plan's ``epochs`` allows."""
        return self.spec.epochs is None or ref[0] < self.spec.epochs

    # -- order -------------------------------------------------------------------------------
    def unit_order(self, epoch: int) -> np.ndarray:
        """The catalog's units in the order of ``epoch`` (kept for the epochs in use)."""
        order = self._orders.get(epoch)
        if order is None:
            rng = np.random.default_rng([self.seed, self._name_hash, epoch])
            order = rng.permutation(self.catalog.num_units)
            self._orders = {e: o for e, o in self._orders.items() if e >= self.epoch}
            self._orders[epoch] = order
        return order

    def row_order(self, unit: Unit, count: int) -> np.ndarray:
        """The order in which ``unit``'s ``count`` records are served in its epoch."""
        rng = np.random.default_rng([self.seed, self._name_hash, unit.epoch, unit.catalog_index])
        return rng.permutation(count)

    def successor(self, ref: UnitRef) -> UnitRef:
        """The unit after ``ref`` in the stream (the next epoch's first after the last)."""
        epoch, pos = ref
        return (epoch, pos + 1) if pos + 1 < self.catalog.num_units else (epoch + 1, 0)

    def catalog_index(self, ref: UnitRef) -> int:
        """Which catalog unit is at ``ref``."""
        return int(self.unit_order(ref[0])[ref[1]])

    # -- reading -----------------------------------------------------------------------------
    def submitted_ahead(self) -> int:
        """Units submitted from the cursor's unit on (the read-ahead window in use)."""
        return sum(1 for ref in self.units if ref >= (self.epoch, self.position))

    def pending_reads(self) -> int:
        """Read tasks submitted and not reported yet (what the in-flight quota counts)."""
        return sum(unit.pending for unit in self.units.values())

    def report(
        self,
        ref: UnitRef,
        lengths: np.ndarray,
        skipped: int,
        portion: int = 0,
        extra: np.ndarray | None = None,
        filtered: int = 0,
        holes: Holes | None = None,
    ) -> bool:
        """A read task reported; returns False if the unit is no longer tracked.

        A unit read in portions is complete (``lengths`` set) once every portion has reported.
        """
        unit = self.units.get(ref)
        if unit is not None and unit.up_front:  # known already: the report only counts
            if portion in unit._metered or portion >= unit.portions:
                return False
            unit._metered.add(portion)
            self.version += 1
            return True
        if unit is None or unit.lengths is not None or portion in unit._reported:
            return False
        got_now = (np.asarray(lengths, np.int64), int(skipped), extra, filtered, holes)
        unit._reported[portion] = got_now
        if len(unit._reported) < unit.portions:
            return True
        got = [unit._reported[p] for p in range(unit.portions)]
        unit._reported = {}
        unit.bounds = np.concatenate([[0], np.cumsum([len(g[0]) for g in got])]).astype(np.int64)
        unit.lengths = np.concatenate([g[0] for g in got])
        unit.skipped = sum(g[1] for g in got)
        unit.filtered = sum(g[3] for g in got)
        if any(g[2] is not None for g in got):
            unit.extra = np.concatenate(
                [g[2] if g[2] is not None else np.zeros(len(g[0])) for g in got]
            ).astype(np.float64)
        unit.holes = Holes.join([(len(g[0]), g[4]) for g in got])
        unit.order = self.row_order(unit, len(unit.lengths))
        self._cache = None
        self.version += 1
        return True

    def know_up_front(self, ref: UnitRef) -> bool:
        """Give the submitted unit ``ref`` its records' lengths (and holes) from the index, where
        discovery found them (:meth:`~omniload_dask.sources.catalog.Catalog.known_lengths`):
        the stream is known past it before its read reports; empty records skipped and counted."""
        unit, catalog = self.units[ref], self.catalog
        if (known := catalog.known_lengths(unit.catalog_index, unit.portions)) is None:
            return False
        holes = catalog.known_holes(unit.catalog_index, unit.portions)  # (a mask column's)
        for p, lengths in enumerate(known):
            kept = lengths[lengths > 0]
            self.report(ref, kept, len(lengths) - len(kept), p, holes=holes[p])
        unit.up_front = True
        return True

    # -- drawing -----------------------------------------------------------------------------
    def candidates(self, cap: int, want_tokens: int, want_docs: int) -> Candidates:
        """Known upcoming documents, at least ``want_*`` of them if known that far.

        Sources that a step does not touch are asked again every step: their answer is kept
        until the cursor moves or a unit reports.
        """
        if (
            self._cache is None
            or self._cache[0] != cap
            or not self._cache[1].covers(want_tokens, want_docs)
        ):
            self._cache = (cap, self._collect(cap, want_tokens, want_docs))
        return self._cache[1].prefix(want_tokens, want_docs)

    def _collect(self, cap: int, want_tokens: int, want_docs: int) -> Candidates:
        capped: list[np.ndarray] = []
        raws: list[np.ndarray] = []
        unit_of: list[np.ndarray] = []
        row_of: list[np.ndarray] = []
        units: list[Unit] = []
        tokens = docs = 0
        ref, row = (self.epoch, self.position), self.row
        waiting = complete = False
        empty_run = 0
        while tokens < want_tokens or docs < want_docs:
            if not self.within_epochs(ref):
                complete = True
                break
            unit = self.units.get(ref)
            if unit is None or unit.lengths is None:
                waiting = True
                break
            rows = unit.order[row:]  # type: ignore[index]
            at = np.arange(row, row + len(rows), dtype=np.int64)
            unread = len(rows)
            if self.holes:  # documents a pooled draw took ahead of the cursor (.pool)
                rows, at = _unheld(self.holes, unit, rows, at)
            if len(rows):
                empty_run = 0
                raw = unit.lengths[rows]
                lengths = np.minimum(raw, cap)
                if not capped and self.offset:  # the rest of a document cut by the last batch
                    raw = raw.copy()
                    raw[0] -= self.offset
                    lengths[0] -= self.offset
                capped.append(lengths)
                raws.append(raw)
                unit_of.append(np.full(len(rows), len(units), np.int64))
                row_of.append(at)
                tokens += int(lengths.sum())
                docs += len(rows)
            else:
                empty_run += 0 if unread else 1  # (a unit whose rest is holes is not empty)
                if empty_run >= 2 * self.catalog.num_units:  # a whole epoch lies inside
                    _no_records(self.spec.name, units)
            units.append(unit)
            ref, row = self.successor(ref), 0
        if not capped:
            return Candidates(
                np.zeros(0, np.int64),
                np.zeros(0, np.int64),
                units,
                waiting=waiting,
                complete=complete,
            )
        return Candidates(
            np.concatenate(capped),
            np.concatenate(raws),
            units,
            np.concatenate(unit_of),
            np.concatenate(row_of),
            waiting,
            complete,
            offset=self.offset,  # offset > 0: the cursor's row has tokens left, it comes first
        )

    def skipped_ahead(self) -> int:
        """Records skipped in units read ahead of the cursor that hold none to draw (a file
        that cannot be read, or none of whose records could).

        ``skipped`` counts a unit's bad records once its cursor has passed it (once per epoch,
        also across a resume); such a unit in a source's last epoch is never passed, so what
        is shown (``stats``, the dashboard, the metric) adds these at once: when the cursor
        passes one, its count moves into ``skipped`` and the sum stays the same.
        """
        return sum(
            u.skipped for u in self.units.values() if u.lengths is not None and not len(u.lengths)
        )

    def first_unknown(self) -> UnitRef:
        """The first unit from the cursor on whose report is missing."""
        ref = (self.epoch, self.position)
        while (unit := self.units.get(ref)) is not None and unit.lengths is not None:
            ref = self.successor(ref)
        return ref

    def consume(self, cands: Candidates, count: int, partial: int = 0) -> list[Unit]:
        """Move the cursor past the first ``count`` candidates; return units now finished.

        ``partial > 0``: of the last of them only that many tokens are taken; the cursor stays
        on its row, and the rest leads the next batch.
        """
        if count == 0:
            return []
        last = count - 1
        unit = cands.units[int(cands.unit_of[last])]
        row = int(cands.row_of[last]) + 1
        self._cache = None
        self.version += 1
        head = cands.offset if count else 0
        if partial:
            whole = slice(0, last)
            kept = int(cands.lengths[whole].sum()) + partial
            raw = int(cands.raw[whole].sum()) + partial  # the cap counts once the rest is taken
            offset = (head if last == 0 else 0) + partial
        else:
            kept = int(cands.lengths[:count].sum())
            raw = int(cands.raw[:count].sum())
            offset = 0
        self.truncated_tokens += raw - kept
        self.docs += count - (1 if head else 0)  # a document counts at its first piece
        self.tokens += kept
        finished = []
        ref = (self.epoch, self.position)
        if partial:
            row -= 1  # the cursor stays on the row being cut
        while ref != (unit.epoch, unit.position):
            finished.append(self.units.pop(ref))
            ref = self.successor(ref)
        if row >= len(unit.lengths):  # type: ignore[arg-type]
            finished.append(self.units.pop(ref))
            ref, row = self.successor(ref), 0
        self.epoch, self.position = ref
        self.row = row
        self.offset = offset
        # Skipped records count once per epoch, when the cursor has passed their unit.
        self.skipped += sum(u.skipped for u in finished)
        self.filtered += sum(u.filtered for u in finished)
        return finished

    STATE_KEYS = (
        "epoch",
        "position",
        "row",
        "docs",
        "tokens",
        "skipped",
        "truncated_tokens",
        "retired",
        "offset",
        "filtered",
    )

    def state_dict(self) -> dict[str, Any]:
        """The cursor and counters: everything that is not re-derived from the files; with
        holes (a pooled draw's, :mod:`.pool`), ``holes`` too, flat ``[epoch, position, row,
        ...]`` in order (absent when there are none, so other plans' states stay as they were)."""
        out: dict[str, Any] = {k: int(getattr(self, k)) for k in self.STATE_KEYS}
        if self.holes:
            out["holes"] = [x for hole in sorted(self.holes) for x in hole]
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s output; no unit is in flight afterwards."""
        put_cursor(self, state)
        self.units.clear()
        self.next_submit = (self.epoch, self.position)
        self._orders.clear()

    def forget_candidates(self) -> None:
        """The cursor or the holes moved: candidates are collected again."""
        self._cache = None
        self.version += 1


def put_cursor(stream: SourceStream, state: dict[str, Any]) -> None:
    """Set the cursor, counters and holes of ``state`` (its units stay)."""
    for key in stream.STATE_KEYS:
        value = state.get(key, 0)  # (a state from before a key was added: 0)
        setattr(stream, key, bool(value) if key == "retired" else int(value))
    flat = state.get("holes") or []
    stream.holes = frozenset(tuple(flat[i : i + 3]) for i in range(0, len(flat), 3))
    stream.forget_candidates()


def _unheld(
    holes: frozenset[tuple[int, int, int]], unit: Unit, rows: np.ndarray, at: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """``rows`` of ``unit`` (served as its ``at``-th) less those a pooled draw took ahead."""
    epoch, position = unit.epoch, unit.position
    held = [k for e, p, k in holes if p == position and e == epoch]
    if not held:
        return rows, at
    keep = ~np.isin(at, held)
    return rows[keep], at[keep]


def cursor_state(vector: list[Any]) -> dict[str, Any]:
    """A stream's state from its vector (:meth:`SourceStream.state_dict`'s values, maybe
    of an older version with fewer keys, or with the holes last)."""
    n = len(SourceStream.STATE_KEYS)
    state: dict[str, Any] = dict(zip(SourceStream.STATE_KEYS, list(vector[:n]), strict=False))
    if len(vector) > n:
        state["holes"] = list(vector[n])
    return state


def _no_records(name: str, units: list[Unit]) -> None:
    """A whole epoch of source ``name`` (its ``units``) held no records: a clear error."""
    once = {  # one epoch's: each empty unit's file once
        u.catalog_index: u.skipped for u in units if u.lengths is not None and not len(u.lengths)
    }
    raise JobError(
        f"source {name!r}: a whole epoch held no records ({sum(once.values())} bad records "
        "skipped in it: see the source's bad_examples); every file of it is unreadable or empty"
    )

"""Drawing global batch t: ask each source for its next documents, let the mixer choose.

The draw of a step is a pure function of the sources' cursors, their reported document
lengths, the weights and the mixer's tags, never of timing::

    weights at t    ->  candidates per source: its next known documents, twice its share
                        of the budget (mixing.Mixer may ask for more: x2, x4, ...)
                    ->  Mixer.select: the documents of the batch, in tag order (with
                        ``long_documents: split`` the last one may be cut: its rest leads the
                        next batch)
                    ->  the cursors move past them; each document is located in its read unit
                        (and portion): the shard slot and row a recipe will name, and the token
                        where its piece starts (> 0 for the rest of a document cut before)

When a source must report a read first, the draw waits (:meth:`Drawer.draw` returns None), and
it does not try again until one of the sources it waited for reports (or the weights, the caps
or the budget change). Another source's report cannot end the wait: the mixer needs documents
of the waiting source that no one has read yet. Where many ranks share the cluster most draws
wait, so a retry on every report would be mixer work that can only fail.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

from omniload_dask.batching.mixing import Mixer, NeedMore, Selection
from omniload_dask.batching.sorting import stable_order
from omniload_dask.core import pool as pool_draw
from omniload_dask.core.live import LiveSources, token_shares
from omniload_dask.core.pool_buckets import BucketPool, place_buckets
from omniload_dask.core.streams import Candidates, SourceStream, Unit
from omniload_dask.errors import JobError
from omniload_dask.plan import BatchSpec, Plan

__all__ = ["Documents", "Drawer"]

MAX_SCALE = 1 << 20  # how far a source's wants may double before the batch is unfillable
FEW_SOURCES = 4  # documents of up to this many sources are found by a scan per source
# Candidates shown per source, as a multiple of its expected share of the budget. A token
# budget's documents vary with the long ones drawn: shown too few, the mixer often comes back
# short and is called again, which costs more on the event loop than showing twice the share
# up front. What is shown never changes a draw.
SHOW = 2.0


@dataclass
class Documents:
    """The documents of one drawn global batch, in tag order, and where each one lives.

    Document d is ``lengths[d]`` tokens (after the cap), from token ``starts[d]`` on, of source
    ``sources[d]``; it is row ``rows[d]`` of the read task ``slots[slot[d]]`` = (unit, portion),
    whose source is ``slot_source[slot[d]]``. ``starts[d] > 0`` is the rest of a document that
    an earlier batch began; a piece ends before the document does when the batch cut it.
    ``extra`` is each document's encoder cost (image sources; None when the plan declares
    none), charged to its first piece. ``finished`` are the units the cursors have now passed.
    """

    sources: np.ndarray
    lengths: np.ndarray
    extra: np.ndarray | None
    rows: np.ndarray
    slot: np.ndarray
    slots: list[tuple[Unit, int]]
    slot_source: list[int]
    finished: list[Unit]
    starts: np.ndarray | None = None  # token where each piece starts in its record (0: whole)
    head: int = 1  # the first documents a pooled draw packed first (.pool.place)

    @property
    def first_pieces(self) -> np.ndarray:
        """Which pieces begin their document (the documents this batch counts)."""
        if self.starts is None:
            return np.ones(len(self.sources), dtype=bool)
        return self.starts == 0


class Drawer:
    """The mixer and what each draw remembers: who takes part, and what the last one waited on.

    It reads the streams and document caps of ``sources`` and moves their cursors.
    """

    def __init__(self, sources: LiveSources, plan: Plan, with_extra: bool) -> None:
        """A mixer over ``sources``; ``with_extra``: documents carry an encoder cost."""
        self._sources = sources
        self._batch = plan.batch
        self._groups = plan.layout.dp
        self._names = plan.source_names  # (a bucket's sources, by index)
        self._at(0)
        self._with_extra = with_extra
        n = len(sources.streams)
        self.mixer = Mixer(n, plan.mixing_by)
        self.active = np.zeros(n, dtype=bool)  # weight > 0 last step
        self.weights = np.zeros(n)  # the weights the last step was drawn with
        self.starved: set[int] = set()  # sources the last draw waited for
        self._starved_seen: tuple[Any, ...] | None = None  # what that draw saw

    def add_source(self) -> None:
        """A stream joined the job: it starts at the mixer's virtual time, not active yet."""
        self.mixer.add_source()
        self.active = np.append(self.active, False)

    def restore(self, tags: np.ndarray, vtime: float, active: np.ndarray) -> None:
        """Take a snapshot's mixer tags, virtual time and active sources."""
        self.mixer.tags = tags
        self.mixer.vtime = vtime
        self.active = active

    def draw(self, step: int, weights: np.ndarray) -> Documents | None:
        """Draw global batch ``step`` at ``weights`` (some > 0).

        Returns None if a source must report first, else the batch's documents: none when
        every source with weight ran out (the stream ends there).
        """
        self._at(step)
        tokens, docs = self._budget
        streams, caps = self._sources.streams, self._sources.caps
        # The last draw of this step waited for reads: until a source it waited for reports
        # (or weights, caps or the budget change) it would wait again, so skip the candidates
        # and the mixer (module doc).
        if self.starved and self._seen(step, weights, self.starved) == self._starved_seen:
            return None
        for joining in ((weights > 0) & ~self.active).nonzero()[0].tolist():
            self.mixer.activate(joining)  # (re)joining sources start at the virtual time
        shares = self._token_shares(weights)
        if self._pool:
            return self._draw_pooled(step, weights, shares)
        empty = Candidates(np.zeros(0, np.int64))
        cands = [
            stream.candidates(caps[i], *self._wants(i, shares, 1.0)) if weights[i] > 0 else empty
            for i, stream in enumerate(streams)
        ]
        scale = np.ones(len(streams))
        while True:
            result = self.mixer.select(
                weights,
                [c.lengths for c in cands],
                [not c.complete for c in cands],
                budget_tokens=tokens,
                budget_documents=docs,
                cut=self._cut,
                chunk=self._chunk,
                continuing=[c.continuing for c in cands],
            )
            if not isinstance(result, NeedMore):
                break
            waiting = {i for i in result.sources if cands[i].waiting}
            if waiting:
                self.starved = waiting
                self._starved_seen = self._seen(step, weights, waiting)
                return None
            for i in result.sources:  # only the sources that fell short are asked for more
                scale[i] *= 2
                if scale[i] > MAX_SCALE:
                    raise JobError("cannot fill a global batch: check batch.global_tokens")
                cands[i] = streams[i].candidates(caps[i], *self._wants(i, shares, float(scale[i])))
        self.starved = set()
        if len(result.order):  # (else every source with weight ran out during this step)
            self.active = weights > 0
            self.weights = weights
            self.mixer.commit(result)
        return _locate(result, cands, streams, self._with_extra)

    def _draw_pooled(self, step: int, weights: np.ndarray, shares: np.ndarray) -> Documents | None:
        """:meth:`draw` with ``batch.pack_pool``: a window of the mix, packed (:mod:`.pool`)."""
        streams, caps = self._sources.streams, self._sources.caps
        assert self._pool is not None  # (draw calls this only then)
        tokens, pool, bins, capacity = self._pool
        got = pool_draw.draw_window(
            self.mixer,
            streams,
            caps,
            weights,
            lambda i, scale: self._wants(i, shares, scale),
            tokens,
            pool,
        )
        if isinstance(got, set):
            self.starved = got
            self._starved_seen = self._seen(step, weights, got)
            return None
        self.starved = set()
        rows, cands = got
        if len(rows):
            self.active = weights > 0
            self.weights = weights
        if self._buckets is not None:
            selection, head = place_buckets(self.mixer, rows, cands, weights, self._buckets)
        else:
            selection, head = pool_draw.place(
                self.mixer, rows, cands, weights, (bins, capacity, tokens)
            )
        docs = _locate(selection, cands, streams, self._with_extra, pooled=True)
        docs.head = max(head, 1)
        return docs

    def restage(self, batch: BatchSpec, version: int = 0) -> None:
        """Draw with ``batch``'s stages from now on (a live stage change, :mod:`.stages`)."""
        self._batch = batch

    def _at(self, step: int) -> None:
        """Take the budget and piece size of the batch that rules ``step`` (its stage)."""
        batch = self._batch.at(step)
        self._budget = (batch.global_tokens, batch.global_documents)
        # split: a token budget is filled exactly, the document that does not fit is cut
        # (unless documents are kept whole: BatchSpec.whole_documents)
        self._cut = not batch.whole_documents and batch.global_tokens is not None
        self._chunk = batch.seq_len  # long documents are tagged (and flow) in such pieces
        # pack_pool: (budget, pool, micro-batches of the step, their tokens), else None
        self._pool = (
            (
                batch.global_tokens,
                batch.pack_pool,
                self._groups * batch.micro_batches,
                batch.seq_len,
            )
            if batch.pack_pool and batch.global_tokens is not None
            else None
        )
        # ... with buckets: each packed on its own, within its part of the budget
        self._buckets = (
            BucketPool.of(batch, self._groups, self._names)
            if self._pool is not None and len(batch.context_buckets) > 1
            else None
        )

    def _seen(self, step: int, weights: np.ndarray, sources: set[int]) -> tuple[Any, ...]:
        """What a draw that waited for ``sources`` depends on: the step, the weights, the
        caps, the budget, and those sources' versions (a report or a cursor move bumps one)."""
        streams = self._sources.streams
        return (
            step,
            weights.tobytes(),
            tuple(self._sources.caps),
            self._budget,
            tuple((i, streams[i].version) for i in sorted(sources)),
        )

    def _wants(self, i: int, shares: np.ndarray, scale: float) -> tuple[int, int]:
        tokens, docs = self._budget
        # Twice the source's share (SHOW); the mixer asks again (scale x2) if short.
        if tokens is not None:
            return int(shares[i] * tokens * SHOW * scale) + 1, 2
        return 1, int(shares[i] * docs * SHOW * scale) + 2

    def _token_shares(self, weights: np.ndarray) -> np.ndarray:
        """Each source's expected share of a draw's budget at ``weights``.

        With ``mixing.by: documents`` and a token budget, the shares count documents, so a
        source's share of the tokens follows from the mean length of the documents it gave
        so far (asked for by weight alone, a source of long documents fell short at nearly
        every draw, and one of short documents showed many times what it gave). How much is
        shown never changes the draw: the mixer asks for more when it could matter.
        """
        if self.mixer.by != "documents" or self._budget[0] is None:
            return weights / weights.sum()
        return token_shares(weights, self._sources.mean_lengths())


def _locate(
    selection: Selection, cands: list[Candidates], streams: list[SourceStream], with_extra: bool,
    pooled: bool = False,
) -> Documents:  # fmt: skip
    """Move the cursors past the chosen documents and find each one's read task and row (of
    a source's last one, maybe only its first tokens: the rest leads the next batch).
    ``pooled``: the chosen may leave some candidates out (holes, :func:`.pool.take`)."""
    order, taken = selection.order, selection.taken
    counts = (
        np.bincount(order[:, 0], minlength=len(streams))
        if len(order)
        else (np.zeros(len(streams), np.int64))
    )
    finished: list[Unit] = []
    for i, stream in enumerate(streams):
        if counts[i] and pooled:
            finished += pool_draw.take(stream, cands[i], np.sort(order[order[:, 0] == i, 1]))
        elif counts[i]:
            finished += stream.consume(cands[i], int(counts[i]), selection.cut.get(i, 0))
    # Documents in tag order: (source, unit, row in file order, effective length).
    src = order[:, 0]
    idx = order[:, 1]
    doc_unit = np.empty(len(order), dtype=np.int64)  # index into units
    rows = np.empty(len(order), dtype=np.int64)
    lengths = np.empty(len(order), dtype=np.int64)
    starts = np.zeros(len(order), dtype=np.int64)
    extra = np.zeros(len(order)) if with_extra else None
    units: list[tuple[Unit, int]] = []  # (unit, portion) read by a shard slot
    unit_source: list[int] = []
    chosen = counts.nonzero()[0].tolist()
    scan = len(chosen) <= FEW_SOURCES  # a scan of a few sources is cheaper than the sort
    if not scan:  # one sort instead of one scan per source
        by_source = stable_order(src)
        source_bounds = np.concatenate([[0], counts.cumsum()]).tolist()
    for s in chosen:
        sel = (
            (src == s).nonzero()[0] if scan else by_source[source_bounds[s] : source_bounds[s + 1]]
        )
        c = cands[s]
        k = idx[sel]
        lengths[sel] = c.lengths[k]
        if c.continuing:
            starts[sel[k == 0]] = c.offset
        # Each unit's documents (units in index order, documents in tag order), then each
        # portion's of the unit: runs of one stable sort, not a scan per unit.
        for here, at, u in _runs(sel, k, c.unit_of[k]):
            unit = c.units[u]
            assert unit.order is not None  # a candidate's unit has reported
            unit_rows = unit.order[c.row_of[at]]
            if extra is not None and unit.extra is not None:
                extra[here] = unit.extra[unit_rows]  # (charged to a document's first piece)
            portion, portion_rows = unit.locate(unit_rows)
            for mine, rows_of, p in _runs(here, portion_rows, portion):
                rows[mine] = rows_of
                doc_unit[mine] = len(units)
                units.append((unit, p))
                unit_source.append(s)
    if taken is not None:
        lengths[:] = taken
    if extra is not None:
        extra[starts > 0] = 0.0  # its images were charged with the document's first piece
    return Documents(src, lengths, extra, rows, doc_unit, units, unit_source, finished, starts)


def _runs(
    items: np.ndarray, values: np.ndarray, keys: np.ndarray
) -> list[tuple[np.ndarray, np.ndarray, int]]:
    """``(items, values, key)`` for each distinct key of ``keys`` (integers >= 0), keys
    ascending, each run's entries in their order: ``[(items[keys == u], values[keys == u],
    u) for u in np.unique(keys)]``, from one stable sort."""
    if len(keys) and keys[0] == keys[-1] and (keys == keys[0]).all():
        return [(items, values, int(keys[0]))]  # one key (a unit read whole: the usual case)
    if (keys[1:] >= keys[:-1]).all():  # in key order already (a stream's units are): slices
        edges = [0, *((keys[1:] != keys[:-1]).nonzero()[0] + 1).tolist(), len(keys)]
        return [
            (items[a:b], values[a:b], int(keys[a])) for a, b in itertools.pairwise(edges) if b > a
        ]
    order = stable_order(keys)
    ordered = keys[order]
    edges = [0, *((ordered[1:] != ordered[:-1]).nonzero()[0] + 1).tolist(), len(keys)]
    return [
        (items[order[a:b]], values[order[a:b]], int(ordered[a]))
        for a, b in itertools.pairwise(edges)
        if b > a
    ]

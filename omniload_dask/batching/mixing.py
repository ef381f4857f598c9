"""Drawing each global batch from the mix: deterministic, exact up to one document per source.

Sources are served like flows in weighted fair queueing. Each source carries a finish tag
``F`` (a source that joins, or whose weight rises from 0, starts at the current virtual time);
its j-th upcoming document gets the tag ``F + (cumulative size up to j) / weight``,
where size is the token count (``by: tokens``) or 1 (``by: documents``). A global batch takes
documents in increasing tag order (ties: lower source index) until the budget is reached:

- a document budget: the first N in tag order;
- a token budget with ``long_documents: split`` (``cut``): the first document that does not fit
  is cut to fill the batch exactly, and the rest of it leads its source in the next batch (by
  documents it was counted at its first piece, so the rest adds nothing to the tag). Nothing is
  padded or dropped and the mix is exact up to one document per source, at any budget: a
  183k-token document simply continues over as many batches as it needs;
- a token budget with ``long_documents: truncate`` (documents stay whole): a source whose next
  document does not fit in the room left is closed for this batch (that document stays first in
  line and keeps its low tag, so it leads the next batch); the other sources fill the room in tag
  order, but never past :data:`HORIZON_BATCHES` global batches of virtual time beyond the
  document that did not fit. That bounds how far any source can run ahead of another (and so the
  deficit a closed source carries forward is paid back): every finish tag stays within that
  horizon plus one document of the others, at the price of some padding at small budgets.

Worked example, weights web=3, code=1, by documents, budget 4 documents, tags start at 0::

    web  tags 1/3 2/3 3/3 4/3 ...      code tags 1 2 3 ...
    merged order: web 1/3, web 2/3, web 1, code 1, web 4/3 ...
    batch 0 = web, web, web, code      (tag 1 tie: web has the lower index)

So each source's cumulative share tracks its weight with a lag of at most one document, and the
result is a pure function of the weights, the tags and the upcoming document sizes: never of
timing. A weight change only changes the increments from then on, so the next batches follow the
new weights at once, with no catch-up burst. :meth:`Mixer.select` works on numpy arrays of
candidates (one sort per batch), which keeps a draw well under a millisecond per thousand
documents.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omniload_dask.batching.sorting import stable_order
from omniload_dask.plan import BatchSpec, MixingSpec

__all__ = ["HORIZON_BATCHES", "Mixer", "NeedMore", "Selection", "WeightSchedule", "mix_guarantee"]

FILL_CHUNK = 256  # candidates converted to Python at a time while filling a batch's room
HORIZON_BATCHES = 4  # how far (in global batches of virtual time) a fill may run ahead


@dataclass(frozen=True)
class Selection:
    """The documents of one global batch: per source, how many of its candidates are taken.

    Row k of ``order`` takes ``taken[k]`` tokens of that candidate: all of it, or (for the last
    candidate a source gives, with ``cut``) its first ``taken[k]``; the rest leads next time.
    ``cut`` maps such a source to the tokens taken of its last candidate.
    """

    counts: np.ndarray  # int64 per source: candidates touched (a cut one included)
    order: np.ndarray  # (source, index within its candidates) in tag order, shape (n, 2)
    tags: np.ndarray  # finish tag of what is taken of each, in the same order
    taken: np.ndarray | None = None  # int64 tokens taken of each (None: all of each)
    cut: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class NeedMore:
    """The batch cannot be decided yet: these sources must show more upcoming documents."""

    sources: tuple[int, ...]


class Mixer:
    """Weighted-fair draw of documents from many sources.

    ``weights[i] == 0`` excludes source i. State (for checkpoints) is the finish tags and the
    virtual time, see :meth:`state_dict`.
    """

    def __init__(self, num_sources: int, by: str = "tokens") -> None:
        if by not in ("tokens", "documents"):
            raise ValueError(f"by must be 'tokens' or 'documents', got {by!r}")
        self.by = by
        self.tags = np.zeros(num_sources, dtype=np.float64)
        self.vtime = 0.0

    def select(
        self,
        weights: np.ndarray,
        candidates: list[np.ndarray],
        truncated: list[bool],
        *,
        budget_tokens: int | None = None,
        budget_documents: int | None = None,
        cut: bool = False,
        chunk: int | None = None,
        continuing: list[bool] | None = None,
    ) -> Selection | NeedMore:
        """Choose the next global batch from each source's upcoming document sizes.

        ``candidates[i]`` are the token counts of source i's next documents, in order;
        ``truncated[i]`` says whether more documents follow them. Returns a :class:`NeedMore`
        when a truncated source could still change the batch. With ``cut`` (a token budget and
        ``long_documents: split``) the batch is filled exactly: what does not fit continues
        next time; ``chunk`` (tokens) then tags a long document piece by piece, so it flows at
        its source's share instead of arriving whole at its finish tag. ``continuing[i]``
        says that source i's first candidate is the rest of a document cut before (with
        ``by: documents`` it was counted at its first piece).
        """
        if (budget_tokens is None) == (budget_documents is None):
            raise ValueError("give exactly one of budget_tokens and budget_documents")
        active = [i for i, w in enumerate(weights) if w > 0]
        parts = [np.asarray(candidates[i], dtype=np.int64) for i in active]
        starved = [i for i, p in zip(active, parts, strict=True) if len(p) == 0 and truncated[i]]
        if starved:
            return NeedMore(tuple(starved))
        shown = [(i, p) for i, p in zip(active, parts, strict=True) if len(p)]
        if not shown:
            return Selection(
                np.zeros(len(weights), np.int64), np.zeros((0, 2), np.int64), np.zeros(0)
            )
        going = [bool(continuing and continuing[i]) for i, _ in shown]
        c = _Chunks.of(shown, going, chunk if cut else None, self.by == "documents")
        rates = np.asarray(weights, dtype=np.float64)
        order_src = np.asarray([i for i, _ in shown], dtype=np.int64)
        per_src = np.diff(c.ends, prepend=0)  # (each source's items are one run)
        tags = self.tags[order_src].repeat(per_src) + c.within / rates[order_src].repeat(per_src)
        last_tag = np.full(len(weights), np.inf)
        more = np.asarray([truncated[i] for i, _ in shown], dtype=bool)
        last_tag[order_src[more]] = tags[c.ends[more] - 1]
        # By tag, ties to the lower source: the sources' runs are in index order, so a
        # stable sort of the tags is that order (a merge of each source's ascending run).
        order = tags.argsort(kind="stable")
        lengths = c.lengths
        if budget_tokens is not None:
            total = lengths[order].cumsum()
            take = int(total.searchsorted(budget_tokens, side="right"))
        else:
            take = min(int(budget_documents), len(order))  # type: ignore[arg-type]
        # Every source must be known up to ``settled``: no unseen document may come before it.
        chosen = order[:take]
        taken = lengths[chosen]
        chosen_tags = tags[chosen]
        if take == len(order):  # everything shown fits: only exhausted sources are settled
            settled = np.inf
        elif budget_tokens is None:  # the first document left out ends the batch
            settled = tags[order[take]]
        else:
            room = budget_tokens - (int(total[take - 1]) if take else 0)
            first_out = order[take]
            settled = tags[first_out]
            if room == 0:  # exactly full: nothing after the last document taken fits
                settled = tags[order[take - 1]] if take else -np.inf
            elif cut:  # what is left out first fills the room; its rest leads next time
                chosen = order[: take + 1]
                taken = np.append(taken, room)
                part_tag = settled
                if self.by == "tokens":
                    part_tag -= (int(lengths[first_out]) - room) / rates[c.srcs[first_out]]
                chosen_tags = np.append(chosen_tags, part_tag)
            else:
                limit = settled + self._horizon(rates, budget_tokens, lengths[order[:take]])
                fill = _fill(order[take:], c.srcs, lengths, tags, last_tag, len(shown), room, limit)
                if isinstance(fill, NeedMore):
                    return fill
                chosen = np.concatenate([chosen, fill])
                taken = lengths[chosen]
                chosen_tags = tags[chosen]
                settled = -np.inf  # _fill checked every document it looked at
        short = tuple(i for i in active if last_tag[i] < settled)
        if short:
            return NeedMore(short)
        return c.selection(chosen, taken, chosen_tags, len(weights))

    def _horizon(self, rates: np.ndarray, budget: int, prefix: np.ndarray) -> float:
        """How far past the first document left out the fill may reach, in virtual time.

        :data:`HORIZON_BATCHES` global batches at the target mix: one is ``budget /
        sum(weights)`` by tokens; by documents, the documents it holds at the mean length of
        the batch's prefix.
        """
        total = float(rates[rates > 0].sum())
        if self.by == "tokens":
            return HORIZON_BATCHES * budget / total
        mean = float(prefix.mean()) if len(prefix) else float(budget)
        return HORIZON_BATCHES * budget / max(mean, 1.0) / total

    def activate(self, source: int) -> None:
        """Call when a source starts to take part (weight 0 -> positive, or newly added).

        It starts at the current virtual time, so it neither owes nor is owed past shares.
        """
        self.tags[source] = max(self.tags[source], self.vtime)

    def add_source(self) -> int:
        """Make room for one more source (index returned); it starts at the virtual time."""
        self.tags = np.append(self.tags, self.vtime)
        return len(self.tags) - 1

    def commit(self, selection: Selection) -> None:
        """Advance the tags past the documents of ``selection`` (call once per drawn batch)."""
        if len(selection.tags) == 0:
            return
        np.maximum.at(self.tags, selection.order[:, 0], selection.tags)
        self.vtime = max(self.vtime, float(selection.tags.max()))

    def state_dict(self) -> dict[str, object]:
        """The tags and the virtual time, as plain data."""
        return {"by": self.by, "tags": self.tags.tolist(), "vtime": self.vtime}

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Continue from :meth:`state_dict`'s output."""
        self.by = str(state["by"])
        self.tags = np.asarray(state["tags"], dtype=np.float64)
        self.vtime = float(state["vtime"])  # type: ignore[arg-type]


class WeightSchedule:
    """Target weight of every source at every step: plan weights, schedule, live changes.

    The weight of source ``name`` at step t (having consumed ``tokens`` before it) is, first
    match wins: the latest live change naming it with ``step <= t``; the plan's schedule at t
    (or at ``tokens``, for a schedule over tokens); the source's own plan weight. A live change
    only names the sources it changes; the others keep following the plan. Example, schedule
    ``[{at: 0, web: 1}, {at: 100, web: 3}]``, linear: web weighs 2 at step 50.
    """

    def __init__(self, base: dict[str, float], spec: MixingSpec) -> None:
        self.base = dict(base)
        self.spec = spec
        self.changes: list[tuple[int, dict[str, float]]] = []
        self.reset_step = 0

    def add_source(self, name: str, weight: float) -> None:
        """A source joins with its plan ``weight`` (live changes naming it still win)."""
        self.base[name] = weight

    def change(self, step: int, weights: dict[str, float]) -> None:
        """Record a live change effective from ``step`` (changes are kept sorted by step)."""
        self.changes.append((step, dict(weights)))
        self.changes.sort(key=lambda c: c[0])

    def at(self, names: list[str], step: int, tokens: int) -> np.ndarray:
        """Weights of ``names`` at ``step`` as an array in the same order."""
        planned = self._planned(step, tokens)
        out = np.empty(len(names), dtype=np.float64)
        for i, name in enumerate(names):
            value = planned.get(name, self.base.get(name, 0.0))
            for at, weights in self.changes:
                if at > step:
                    break
                if at < self.reset_step <= step:
                    continue
                if name in weights:
                    value = weights[name]
            out[i] = value
        return out

    def _planned(self, step: int, tokens: int) -> dict[str, float]:
        points = self.spec.schedule
        if not points:
            return {}
        x = step if self.spec.over == "steps" else tokens
        if x < points[0].at:
            return {}
        idx = max(i for i, p in enumerate(points) if p.at <= x)
        here = {**self.base, **points[idx].weights}
        if self.spec.interpolate == "constant" or idx + 1 == len(points):
            return here
        nxt = {**self.base, **points[idx + 1].weights}
        frac = (x - points[idx].at) / (points[idx + 1].at - points[idx].at)
        return {
            k: here.get(k, 0.0) + frac * (nxt.get(k, 0.0) - here.get(k, 0.0))
            for k in set(here) | set(nxt)
        }

    def reset_at(self, step: int) -> None:
        """From ``step`` on, ignore live changes made for earlier steps (a new plan rules)."""
        self.reset_step = step

    def state_dict(self) -> dict[str, object]:
        """The live changes, base weights and reset step, as plain data."""
        return {
            "changes": [[s, w] for s, w in self.changes],
            "base": dict(self.base),
            "reset_step": self.reset_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take the live changes and reset step of :meth:`state_dict`'s output (the base
        weights come from the plan)."""
        self.changes = [(int(s), {k: float(v) for k, v in w.items()}) for s, w in state["changes"]]
        self.reset_step = int(state.get("reset_step", 0))


@dataclass
class _Chunks:
    """The candidates as the mixer tags them: every document, or (``chunk``) every piece of at
    most ``chunk`` tokens of it, with its source, document and tag size, in stream order."""

    srcs: np.ndarray  # source of each item
    docs: np.ndarray  # its candidate (document) index within the source
    lengths: np.ndarray  # its tokens
    within: np.ndarray  # cumulative tag size within its source, up to and with this item
    ends: np.ndarray  # per shown source: one past its last item
    item_doc: np.ndarray  # its document among all shown documents
    doc_lengths: np.ndarray  # tokens of each shown document
    head: np.ndarray  # whether it is its document's first piece

    @classmethod
    def of(
        cls,
        shown: list[tuple[int, np.ndarray]],
        continuing: list[bool],
        chunk: int | None,
        by_documents: bool,
    ) -> _Chunks:
        """Items of the shown sources (``continuing``: the first document is a rest)."""
        per_src = np.asarray([len(p) for _, p in shown], dtype=np.int64)
        lengths = np.concatenate([p for _, p in shown])
        ids = np.asarray([i for i, _ in shown], dtype=np.int64)
        first_doc = np.zeros(len(shown), dtype=np.int64)
        per_src[:-1].cumsum(out=first_doc[1:])
        if chunk is None or not (lengths > chunk).any():
            per_src_items = per_src
            item_len, item_doc, head = lengths, np.arange(len(lengths)), np.ones(len(lengths), bool)
        else:
            pieces = np.maximum(1, -(-lengths // chunk))
            item_doc = np.arange(len(lengths)).repeat(pieces)
            starts = pieces.cumsum() - pieces
            k = np.arange(len(item_doc), dtype=np.int64) - starts[item_doc]
            item_len = np.minimum(chunk, lengths[item_doc] - k * chunk)
            head = k == 0
            per_src_items = np.add.reduceat(pieces, first_doc)  # (every shown source has some)
        # Per item, from runs per source (no gathers): its source and its document's index
        # within the source.
        srcs = ids.repeat(per_src_items)
        docs = item_doc - first_doc.repeat(per_src_items)
        if by_documents:  # 1 at a document's first piece, none for the rest of a cut one
            counted = np.ones(len(lengths), dtype=np.int64)
            counted[first_doc[np.asarray(continuing, dtype=bool)]] = 0
            sizes = np.where(head, counted[item_doc], 0)
        else:
            sizes = item_len
        ends = per_src_items.cumsum()
        begins = ends - per_src_items
        running = sizes.cumsum()
        before = (running[begins] - sizes[begins]).repeat(per_src_items)
        return cls(
            srcs,
            docs,
            item_len.astype(np.int64),
            running - before,
            ends,
            np.asarray(item_doc, dtype=np.int64),
            lengths,
            head,
        )

    def selection(
        self, chosen: np.ndarray, taken: np.ndarray, tags: np.ndarray, num_sources: int
    ) -> Selection:
        """The chosen items (tag order) as documents: pieces of one document merge into one
        row, placed where its first piece is; its tag is that of its last piece."""
        gdoc = self.item_doc[chosen]
        # Usually every chosen piece comes after its document's first piece (a source's
        # pieces are chosen in stream order): a document's row is where that piece is.
        is_head = self.head[chosen]
        first = is_head.nonzero()[0]
        row = np.full(len(self.doc_lengths), -1, dtype=np.int64)
        row[gdoc[first]] = np.arange(len(first))
        row_of = row[gdoc]
        if not ((row_of < 0).any() or (first[row_of] > np.arange(len(gdoc))).any()):
            # Each document's total and latest tag from its first piece, then the few others
            # (the pieces after a long document's first), not a pass over all of them.
            others = (~is_head).nonzero()[0]
            out_taken = taken[first].astype(np.int64)
            np.add.at(out_taken, row_of[others], taken[others])
            out_tags = np.asarray(tags, dtype=np.float64)[first]
            np.maximum.at(out_tags, row_of[others], tags[others])
        else:  # np.unique(gdoc, return_index=True, return_inverse=True) from a radix sort
            by_doc = stable_order(gdoc)
            new = np.ones(len(gdoc), dtype=bool)
            new[1:] = gdoc[by_doc[1:]] != gdoc[by_doc[:-1]]
            first = by_doc[new]
            inverse = np.empty(len(gdoc), dtype=np.int64)
            inverse[by_doc] = new.cumsum() - 1
            rows = stable_order(first)  # documents in the order they first appear
            rank = np.empty(len(first), dtype=np.int64)
            rank[rows] = np.arange(len(first))
            first, row_of = first[rows], rank[inverse]
            out_taken = np.bincount(row_of, taken, len(first)).astype(np.int64)
            out_tags = np.full(len(first), -np.inf)
            np.maximum.at(out_tags, row_of, tags)
        pos = chosen[first]
        src = self.srcs[pos]
        counts = np.bincount(src, minlength=num_sources).astype(np.int64)
        order = np.empty((len(pos), 2), dtype=np.int64)
        order[:, 0], order[:, 1] = src, self.docs[pos]
        short = (out_taken < self.doc_lengths[gdoc[first]]).nonzero()[0]
        cut = {int(src[k]): int(out_taken[k]) for k in short.tolist()}
        return Selection(counts=counts, order=order, tags=out_tags, taken=out_taken, cut=cut)


def mix_guarantee(batch: BatchSpec, by: str, weights: Sequence[float]) -> str:
    """How closely a plan's batches follow its mix, in one line (``omniload validate``).

    The bound is on each source's cumulative share at fixed ``weights``: finish tags stay
    within a spread ``D`` of virtual time of each other, so a share is within
    ``w_max / W * D / (tokens drawn)`` of its target. ``D`` is one piece of at most ``seq_len``
    tokens per source when documents continue across batches (``split``), and
    :data:`HORIZON_BATCHES` batches plus one document when they are kept whole (``truncate``).
    """
    w = np.asarray([x for x in weights if x > 0], dtype=np.float64)
    if batch.global_tokens is None:
        return (
            f"mix: by {by}, exact up to one document per source (a global batch is the next "
            f"{batch.global_documents} documents in the mix)"
        )
    budget = batch.global_tokens
    top, total, low = float(w.max()), float(w.sum()), float(w.min())
    if not batch.whole_documents:
        if by == "documents":
            return (
                "mix: by documents, exact up to one document per source; a document that does "
                "not fit continues in the next global batch (nothing is padded or dropped)"
            )
        points = 100 * top / total * batch.seq_len * total / (low * budget) / 1000
        return (
            f"mix: by tokens, exact up to one document piece (<= {batch.seq_len} tokens) per "
            "source; a document that does not fit continues in the next global batch, so at "
            f"fixed weights every share is within {points:.2f} points of its target over "
            "1,000 steps"
        )
    cap = batch.seq_len
    points = 100 * top / total * (HORIZON_BATCHES + cap * total / (low * budget)) / 1000
    return (
        f"mix: by {by}, documents kept whole (never cut): a source whose next "
        f"document does not fit sits out and is paid back within {HORIZON_BATCHES} global "
        f"batches, so at fixed weights every share is within {points:.2f} points of its "
        "target over 1,000 full steps"
    )


def _fill(
    tail: np.ndarray,
    srcs: np.ndarray,
    lengths: np.ndarray,
    tags: np.ndarray,
    last_tag: np.ndarray,
    num_shown: int,
    room: int,
    limit: float = np.inf,
) -> np.ndarray | NeedMore:
    """Fill the ``room`` left by the first document that did not fit (see the module doc).

    ``tail`` are the candidates after the batch's prefix, in tag order. A source whose next
    document does not fit is closed for this batch; the others go on in tag order while room is
    left. Every document looked at must have no unseen document of an open, truncated source
    before it (``last_tag``), so the answer never depends on how many candidates were shown.
    """
    tail = tail[tags[tail] <= limit]  # documents beyond the horizon wait for later batches
    last_tag = np.where(last_tag >= limit, np.inf, last_tag)  # known far enough
    closed: set[int] = set()
    # Open truncated sources by the tag of their last shown document (closed ones are dropped
    # lazily): the smallest is how far the scan may go.
    pending = [(t, i) for i, t in enumerate(last_tag.tolist()) if t != np.inf]
    heapq.heapify(pending)
    taken: list[int] = []
    for lo in range(0, len(tail), FILL_CHUNK):  # most batches fill within the first chunk
        part = tail[lo : lo + FILL_CHUNK]
        chunk = zip(srcs[part].tolist(), tags[part].tolist(), lengths[part].tolist(), strict=True)
        for k, (s, tag, n) in enumerate(chunk, start=lo):
            if s in closed:
                continue
            while pending and pending[0][1] in closed:
                heapq.heappop(pending)
            if pending and tag > pending[0][0]:
                return NeedMore(tuple(sorted({i for t, i in pending if t < tag} - closed)))
            if n <= room:
                taken.append(k)
                room -= n
                if room == 0:
                    return tail[np.asarray(taken, dtype=np.int64)]
                continue
            closed.add(s)
            if len(closed) == num_shown:
                return tail[np.asarray(taken, dtype=np.int64)]
    # Every shown document was looked at and room is left: open truncated sources must show more.
    waiting = sorted({i for _, i in pending} - closed)
    if waiting:
        return NeedMore(tuple(waiting))
    return tail[np.asarray(taken, dtype=np.int64)]

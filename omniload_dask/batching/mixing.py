"""Drawing each global batch from the mix: deterministic, exact up to one document per source.

Sources are served like flows in weighted fair queueing. Each source carries a finish tag
``F`` (a source that joins, or whose weight rises from 0, starts at the current virtual time);
its j-th upcoming document gets the tag ``F + (cumulative size up to j) / weight``,
where size is the token count (``by: tokens``) or 1 (``by: documents``). A global batch takes
documents in increasing tag order (ties: lower source index) until the budget is reached. With a
token budget, a source whose next document does not fit in the room left is closed for this
batch (that document stays first in line for the next one, and keeps its low tag, so it is served
first there); the other sources go on in tag order while room is left. So a 60k-token document
at the end of a step does not leave 60k tokens of padding, and each source still yields its
documents in stream order. With a document budget the batch is simply the first N in tag order.

Worked example, weights web=3, code=1, by documents, budget 4 documents, tags start at 0::

    web  tags 1/3 2/3 3/3 4/3 ...      code tags 1 2 3 ...
    merged order: web 1/3, web 2/3, web 1, code 1, web 4/3 ...
    batch 0 = web, web, web, code      (tag 1 tie: web has the lower index)

So each source's cumulative share tracks its weight with a lag of at most one document, and the
result is a pure function of the weights, the tags and the upcoming document sizes: never of
timing. A weight change only changes the increments from then on, so the next batches follow the
new weights at once, with no catch-up burst. :meth:`Mixer.select` works on numpy arrays of
candidates (one sort per batch), which keeps planning well under a millisecond per thousand
documents.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any

import numpy as np

from omniload_dask.plan import MixingSpec

__all__ = ["Mixer", "NeedMore", "Selection", "WeightSchedule"]

FILL_CHUNK = 256  # candidates converted to Python at a time while filling a batch's room


@dataclass(frozen=True)
class Selection:
    """The documents of one global batch: per source, how many of its candidates are taken."""

    counts: np.ndarray  # int64 per source
    order: np.ndarray  # (source, index within its candidates) in tag order, shape (n, 2)
    tags: np.ndarray  # finish tag of each taken document, in the same order


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
    ) -> Selection | NeedMore:
        """Choose the next global batch from each source's upcoming document sizes.

        ``candidates[i]`` are the token counts of source i's next documents, in order;
        ``truncated[i]`` says whether more documents follow them. Returns a :class:`NeedMore`
        when a truncated source could still change the batch.
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
        # All sources at once: a cumulative sum per source (exact, in integers) as one array.
        counts_shown = np.asarray([len(p) for _, p in shown], dtype=np.int64)
        order_src = np.asarray([i for i, _ in shown], dtype=np.int64)
        lengths = np.concatenate([p for _, p in shown])
        srcs = np.repeat(order_src, counts_shown)
        starts = np.zeros(len(shown), dtype=np.int64)
        np.cumsum(counts_shown[:-1], out=starts[1:])
        ends = starts + counts_shown
        sizes = lengths if self.by == "tokens" else np.ones_like(lengths)
        running = np.cumsum(sizes)
        within = running - np.repeat(running[starts] - sizes[starts], counts_shown)
        tags = self.tags[srcs] + within / np.asarray(weights, dtype=np.float64)[srcs]
        idxs = np.arange(len(lengths), dtype=np.int64) - np.repeat(starts, counts_shown)
        last_tag = np.full(len(weights), np.inf)
        cut = np.asarray([truncated[i] for i in order_src], dtype=bool)
        last_tag[order_src[cut]] = tags[ends[cut] - 1]
        order = np.lexsort((srcs, tags))
        if budget_tokens is not None:
            total = np.cumsum(lengths[order])
            take = int(np.searchsorted(total, budget_tokens, side="right"))
        else:
            take = min(int(budget_documents), len(order))  # type: ignore[arg-type]
        # Every source must be known up to ``settled``: no unseen document may come before it.
        chosen = order[:take]
        if take == len(order):  # everything shown fits: only exhausted sources are settled
            settled = np.inf
        elif budget_tokens is None:  # the first document left out ends the batch
            settled = tags[order[take]]
        else:
            room = budget_tokens - (int(total[take - 1]) if take else 0)
            if room == 0:  # exactly full: nothing after the last document taken fits
                settled = tags[order[take - 1]] if take else -np.inf
            else:
                fill = _fill(order[take:], srcs, lengths, tags, last_tag, len(shown), room)
                if isinstance(fill, NeedMore):
                    return fill
                chosen = np.concatenate([chosen, fill])
                settled = -np.inf  # _fill checked every document it looked at
        short = tuple(i for i in active if last_tag[i] < settled)
        if short:
            return NeedMore(short)
        counts = np.bincount(srcs[chosen], minlength=len(weights)).astype(np.int64)
        return Selection(
            counts=counts, order=np.stack([srcs[chosen], idxs[chosen]], axis=1), tags=tags[chosen]
        )

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


def _fill(
    tail: np.ndarray,
    srcs: np.ndarray,
    lengths: np.ndarray,
    tags: np.ndarray,
    last_tag: np.ndarray,
    num_shown: int,
    room: int,
) -> np.ndarray | NeedMore:
    """Fill the ``room`` left by the first document that did not fit (see the module doc).

    ``tail`` are the candidates after the batch's prefix, in tag order. A source whose next
    document does not fit is closed for this batch; the others go on in tag order while room is
    left. Every document looked at must have no unseen document of an open, truncated source
    before it (``last_tag``), so the answer never depends on how many candidates were shown.
    """
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

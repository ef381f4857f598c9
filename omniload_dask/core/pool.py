"""A draw that may let a whole document wait for a later step (``batch.pack_pool: N``).

With whole documents the in-order draw ends a step at the first document that does not fit,
and the step's documents often cannot be packed whole into its micro-batches. With a pool the
step looks at a window of the mix and packs the micro-batches from it, best fit decreasing::

    mix order (tags)      d0 d1 d2 ... d(D-1) | dD ... d(D+N-1)     D: the in-order prefix
                          \\________________ window ________________/  that fits the budget
    pack                  the head first: the oldest documents within half the budget
                          (at least d0), longest first; then the rest longest first; each
                          into the micro-batch with the least room that holds it, while the
                          step's tokens stay within the budget
    placed                the step's documents (in tag order)
    left                  wait: each stays first in its source's line (its cursor does not
                          pass it); the documents taken after it are holes the stream skips

So the pool is not a buffer: it is the documents between each source's cursor and the last one
taken, less the holes, and its whole state is the holes (``SourceStream.holes``) in the
checkpointed cursor state. A resume reads the units from the cursor on again and skips the
holes: the same stream, exactly once. The head keeps the wait short: the window's front moves by
about half a budget a step, so a document waits at most about ``2 * window / budget`` steps
and the holes stay a few steps' documents. (Longest first over the whole window would leave the
short documents to wait until each is the oldest, and the holes would grow with the run.) A
source's finish tag moves by what it placed only
(``tag + placed / weight``, the rule the checkpoint deltas replay), so a document left out keeps
its low tag, leads the next windows and is placed as their head at the latest: the mix holds
in expectation, each source's share lagging its target by at most the window. When the sources
run out, the window is what is left and the pool drains (every step places its head).

Pure: no I/O and no Dask.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

import numpy as np

from omniload_dask.batching.mixing import Mixer, NeedMore, Selection
from omniload_dask.core.streams import Candidates, SourceStream, Unit
from omniload_dask.errors import JobError

__all__ = [
    "best_fit",
    "commit",
    "draw_window",
    "head_of",
    "lengths_of",
    "pack_window",
    "place",
    "take",
]

MAX_SCALE = 1 << 20  # how far a source's wants may double before the window is unfillable


HEAD = 0.5  # the share of the budget the oldest documents of a window have first


def pack_window(lengths: np.ndarray, bins: int, capacity: int, budget: int) -> np.ndarray:
    """Which documents of a window (``lengths``, in mix order) a step places: the head (the
    first documents within ``HEAD`` of the budget, at least one) longest first, then the
    others longest first (ties: mix order), each into the bin with the least room that holds
    it, while the placed tokens stay within ``budget``. Returns a boolean mask.

    >>> pack_window(np.array([3, 6, 5, 2, 4]), bins=2, capacity=8, budget=16).tolist()
    [True, True, True, True, False]
    """
    placed = np.zeros(len(lengths), dtype=bool)
    if not len(lengths):
        return placed
    head = head_of(lengths, budget)
    index = np.arange(len(lengths))
    order = np.lexsort((index, -lengths, index >= head))  # head first, each part longest first
    return best_fit(order, lengths, [[capacity] * bins], None, budget)


def best_fit(
    order: np.ndarray, lengths: np.ndarray, rooms: list[list[int]], bucket: np.ndarray | None,
    budget: int,
) -> np.ndarray:  # fmt: skip
    """Place documents in ``order``, each into the bin with the least room that holds it
    among its bucket's (``rooms[bucket[d]]``, ascending; ``bucket`` None: the one bucket),
    while the placed tokens stay within ``budget``; a document that does not fit is passed
    over. Returns a boolean mask of the placed documents. ``rooms`` is used up."""
    placed = np.zeros(len(lengths), dtype=bool)
    left = budget
    for d in order.tolist():
        n = int(lengths[d])
        mine = rooms[0 if bucket is None else int(bucket[d])]
        if n > left:
            continue
        at = bisect.bisect_left(mine, n)  # the bin with the least room that holds it
        if at == len(mine):
            continue
        room = mine.pop(at) - n
        bisect.insort(mine, room)
        placed[d] = True
        left -= n
    return placed


def head_of(lengths: np.ndarray, budget: int) -> int:
    """How many documents of a window (``lengths``, in mix order) are its head: the first
    ones within ``HEAD`` of the budget, at least one."""
    return max(1, int(lengths.cumsum().searchsorted(HEAD * budget, side="right")))


def draw_window(
    mixer: Mixer,
    streams: Sequence[SourceStream],
    caps: Sequence[int],
    weights: np.ndarray,
    wants: Callable[[int, float], tuple[int, int]],
    budget: int,
    pool: int,
) -> tuple[np.ndarray, list[Candidates]] | set[int]:
    """The window of a step: the first ``D + pool`` documents of the mix, ``D`` those of its
    in-order prefix within ``budget`` tokens, as rows ``(source, candidate)`` in tag order,
    with the candidates they index. A set instead: the sources whose reports it waits for.
    What is shown never changes the window: the mixer asks for more when it could matter."""
    empty = Candidates(np.zeros(0, np.int64))
    scale = np.ones(len(streams))

    def show(i: int) -> Candidates:
        if weights[i] <= 0:
            return empty
        tokens, docs = wants(i, float(scale[i]))
        share = float(weights[i] / weights.sum())
        return streams[i].candidates(caps[i], tokens, max(docs, int(share * pool * scale[i]) + 2))

    cands = [show(i) for i in range(len(streams))]
    shown = [c.lengths for c in cands if len(c.lengths)]
    mean = float(np.concatenate(shown).mean()) if shown else 1.0
    ask = pool + 1 + int(budget / mean)  # about D + pool (fewer calls of the mixer; any works)
    while True:
        result = mixer.select(
            weights,
            [c.lengths for c in cands],
            [not c.complete for c in cands],
            budget_documents=ask,
        )
        if isinstance(result, NeedMore):
            waiting = {i for i in result.sources if cands[i].waiting}
            if waiting:
                return waiting
            for i in result.sources:
                scale[i] *= 2
                if scale[i] > MAX_SCALE:
                    raise JobError("cannot fill a global batch: check batch.global_tokens")
                cands[i] = show(i)
            continue
        rows = result.order
        lengths = lengths_of(rows, cands)
        prefix = int(lengths.cumsum().searchsorted(budget, side="right"))
        need = prefix + pool
        if need <= len(rows) or len(rows) < ask:  # (fewer: every source has run out)
            return rows[:need], cands
        ask = need


def place(
    mixer: Mixer,
    rows: np.ndarray,
    cands: list[Candidates],
    weights: np.ndarray,
    shape: tuple[int, int, int],
) -> tuple[Selection, int]:
    """The window's documents the step places (:func:`pack_window` into ``shape`` = (bins,
    capacity, budget)), as a selection in tag order, and how many of them (the first ones)
    are of the window's head; each placing source's finish tag moves by what it placed (module
    doc). The balancer packs a step's documents in that order again where it must pack them
    by length (:func:`omniload_dask.batching.balance.place.pack`), so they fit as here."""
    lengths = lengths_of(rows, cands)
    capacity = shape[1]
    if len(lengths) and int(lengths.max()) > capacity:
        raise JobError(f"a whole document of {int(lengths.max())} tokens exceeds seq_len")
    mask = pack_window(lengths, *shape)
    head = np.zeros(len(lengths), dtype=bool)
    head[: head_of(lengths, shape[2]) if len(lengths) else 0] = True
    return commit(mixer, rows, cands, weights, mask, head)


def commit(
    mixer: Mixer,
    rows: np.ndarray,
    cands: list[Candidates],
    weights: np.ndarray,
    mask: np.ndarray,
    head: np.ndarray,
) -> tuple[Selection, int]:
    """The window's rows that ``mask`` places, as a selection: those of the ``head`` first,
    then the others, each part in tag order (one bucket: its head is the window's first rows,
    so this is tag order), and how many are of the head; each placing source's finish tag
    moves by what it placed (module doc)."""
    chosen = np.concatenate([rows[mask & head], rows[mask & ~head]])
    sizes = lengths_of(chosen, cands) if mixer.by == "tokens" else np.ones(len(chosen))
    n = len(weights)
    counts = np.bincount(chosen[:, 0], minlength=n).astype(np.int64)
    placed = np.bincount(chosen[:, 0], weights=sizes, minlength=n)
    tags = mixer.tags.copy()
    for i in counts.nonzero()[0].tolist():
        tags[i] = mixer.tags[i] + int(placed[i]) / weights[i]
    if len(chosen):
        mixer.tags = tags
        mixer.vtime = max(mixer.vtime, float(tags[counts > 0].max()))
    return Selection(counts, chosen, tags[chosen[:, 0]]), int((mask & head).sum())


def take(stream: SourceStream, cands: Candidates, picked: np.ndarray) -> list[Unit]:
    """Take the candidates ``picked`` (ascending) of ``stream``: the cursor moves past those
    before the first one left, the others become holes; returns the units it passed."""
    if not len(picked):
        return []
    count = len(picked)
    first_left = count if picked[-1] == count - 1 else int((picked != np.arange(count)).argmax())
    finished = stream.consume(cands, first_left)
    ahead = picked[first_left:]
    if len(ahead):
        holes = set(stream.holes)
        for k in ahead.tolist():
            unit = cands.units[int(cands.unit_of[k])]
            holes.add((unit.epoch, unit.position, int(cands.row_of[k])))
        kept, raw = int(cands.lengths[ahead].sum()), int(cands.raw[ahead].sum())
        stream.docs += len(ahead)
        stream.tokens += kept
        stream.truncated_tokens += raw - kept
        stream.holes = frozenset(holes)
    cursor = (stream.epoch, stream.position, stream.row)
    stream.holes = frozenset(h for h in stream.holes if h >= cursor)
    stream.forget_candidates()
    return finished


def lengths_of(rows: np.ndarray, cands: list[Candidates]) -> np.ndarray:
    """The length of each row ``(source, candidate)``."""
    out = np.zeros(len(rows), dtype=np.int64)
    for s in np.unique(rows[:, 0]).tolist() if len(rows) else []:
        mine = rows[:, 0] == s
        out[mine] = cands[s].lengths[rows[mine, 1]]
    return out

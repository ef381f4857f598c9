"""Target masks of a whole read's conversations at once, from their tokens' character offsets.

A token is a target when its characters ``[start, end)`` meet a target span ``[lo, hi)`` of its
own conversation: ``start < hi and end > lo`` for some span (:mod:`.chat_encode`). Done span by
span and conversation by conversation, that is several numpy calls per span; here it is one
pass over the read. Each conversation's
characters are moved past the previous one's (plus a gap of one, so no token meets a span of
another conversation), the spans of the read are then one sorted list, and for each token only
the first span that ends after its start can meet it::

    spans     [2, 5)   [9, 12)          token [4, 6): first span ending after 4 is [2, 5),
    token       [4, 6)                  and 2 < 6: a target
    token           [6, 9)              first ending after 6 is [9, 12); 9 < 9 fails: not one

That holds when every conversation's spans are in order and do not overlap (``lo <= hi <=``
the next ``lo``), which is what the template's generation blocks and the prefix renderings
give; where they are not, :func:`read_targets` says so (``None``) and the caller goes span by
span (:func:`span_targets`). :func:`whole_read` then adds the plan's BOS/EOS and makes the
per-conversation checks (over the cap, no target token) the same way, over the read at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from omniload_dask.plan.chat import ChatSpec

__all__ = ["ChatTokens", "no_target", "read_targets", "span_targets", "too_long", "whole_read"]


@dataclass
class ChatTokens:
    """Tokens, offsets and target mask of the records that encoded; ``bad`` the others as
    ``(index into the input, reason)``; with images, where each kept record's image runs start
    (token offsets inside its document)."""

    tokens: np.ndarray  # uint32
    offsets: np.ndarray  # int64, kept records + 1
    target: np.ndarray  # bool, per token
    kept: np.ndarray  # int64 indices of the kept records
    bad: list[tuple[int, str]]
    image_starts: list[np.ndarray] = field(default_factory=list)  # per kept record (images)


def span_targets(
    starts: np.ndarray, ends: np.ndarray, spans: Sequence[tuple[int, int]]
) -> np.ndarray:
    """One conversation's targets, span by span (any spans, in any order)."""
    target = np.zeros(len(starts), dtype=bool)
    for lo, hi in spans:
        target |= (starts < hi) & (ends > lo)
    return target


def read_targets(
    starts: np.ndarray,
    ends: np.ndarray,
    lengths: np.ndarray,
    spans: Sequence[Sequence[tuple[int, int]]],
    text_lengths: Sequence[int],
) -> np.ndarray | None:
    """Targets of all tokens of a read (``starts``/``ends`` flat, each within its own text;
    ``lengths`` tokens per conversation; ``spans`` and ``text_lengths`` per conversation), or
    ``None`` where some conversation's spans are out of order or overlap."""
    counts = np.fromiter(map(len, spans), dtype=np.int64, count=len(spans))
    base = np.zeros(len(text_lengths), dtype=np.int64)
    np.cumsum(np.asarray(text_lengths, dtype=np.int64)[:-1] + 1, out=base[1:])
    flat = np.fromiter(
        (p for one in spans for pair in one for p in pair),
        dtype=np.int64,
        count=2 * int(counts.sum()),
    ).reshape(-1, 2)
    span_base = np.repeat(base, counts)
    lo, hi = flat[:, 0] + span_base, flat[:, 1] + span_base
    if len(lo) and (bool((lo > hi).any()) or bool((lo[1:] < hi[:-1]).any())):
        return None
    target = np.zeros(len(starts), dtype=bool)
    if not len(lo):
        return target
    token_base = np.repeat(base, lengths)
    first = np.searchsorted(hi, starts + token_base, side="right")
    meets = first < len(hi)
    target[meets] = lo[first[meets]] < ends[meets] + token_base[meets]
    return target


def whole_read(
    chat: ChatSpec,
    ids: np.ndarray,
    target: np.ndarray,
    lengths: np.ndarray,
    specials: list[tuple[bool, bool]],
    rendered: list[int],
    bos_eos: tuple[int | None, int | None],
) -> ChatTokens:
    """The read's tokens and targets with BOS/EOS added and the checks made, all at once."""
    lengths = lengths.copy()
    stops = np.cumsum(lengths)
    adds = np.asarray(specials, dtype=bool).reshape(-1, 2)
    adds &= np.array([bos_eos[0] is not None, bos_eos[1] is not None])
    if adds.any():  # (at each text's start and stop, in order: EOS of one, then BOS of the next)
        where = np.stack([stops - lengths, stops], axis=1)[adds]
        ids = np.insert(ids, where, np.array([bos_eos[0] or 0, bos_eos[1] or 0])[adds.nonzero()[1]])
        target = np.insert(target, where, adds.nonzero()[1] == 1)
        lengths += adds.sum(axis=1)
        stops = np.cumsum(lengths)
    if chat.train_on == "everything":
        target[:] = True
    firsts = stops - lengths
    counted = np.zeros(len(target) + 1, dtype=np.int64)
    np.cumsum(target, out=counted[1:])
    # (a document's first token is never predicted: its targets from its second token on)
    aimed = counted[stops] - counted[np.minimum(firsts + 1, stops)]
    over = np.zeros(len(lengths), dtype=bool)
    if chat.max_tokens is not None:
        over = lengths > chat.max_tokens
    keep = ~over & (aimed > 0)
    bad = [
        (rendered[k], too_long(int(lengths[k]), chat.max_tokens) if over[k]
         else no_target(chat))
        for k in np.flatnonzero(~keep).tolist()
    ]  # fmt: skip
    kept_tokens = np.repeat(keep, lengths)
    offsets = np.zeros(int(keep.sum()) + 1, dtype=np.int64)
    np.cumsum(lengths[keep], out=offsets[1:])
    return ChatTokens(
        tokens=ids[kept_tokens].astype(np.uint32, copy=False),
        offsets=offsets,
        target=target[kept_tokens],
        kept=np.asarray(rendered, dtype=np.int64)[keep],
        bad=bad,
    )


def too_long(tokens: int, cap: int | None) -> str:
    """Why a conversation over the plan's cap is a bad record."""
    return (
        f"the conversation is {tokens} tokens, longer than the plan allows ({cap}: the "
        "batch's document cap or chat.max_tokens); it is never cut"
    )


def no_target(chat: ChatSpec) -> str:
    """Why a conversation with no target token is a bad record."""
    return f"no target token under train_on: {chat.train_on}"

"""A whole read's targets, BOS/EOS and checks at once equal the span-by-span rule and each
conversation encoded alone."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

from omniload_dask.demo.chat import CHATML_GENERATION
from omniload_dask.plan import TokenizerSpec
from omniload_dask.plan.chat import ChatSpec
from omniload_dask.preprocess.chat_encode import encode_chats
from omniload_dask.preprocess.chat_targets import ChatTokens, read_targets, span_targets


def _conversation(rng: random.Random) -> tuple[int, np.ndarray, np.ndarray, list[tuple[int, int]]]:
    """A text length, token offsets (gaps, touching and empty tokens included) and spans in
    order (empty, touching and whole-text ones included)."""
    size = rng.randint(0, 40)
    starts, ends, at = [], [], 0
    while at < size:
        at += rng.choice([0, 0, 1, 2])  # (characters in no token, like whitespace)
        width = rng.choice([0, 1, 1, 2, 3])
        if at + width > size:
            break
        starts.append(at)
        ends.append(at + width)
        at += width
    spans, at = [], 0
    while at <= size and rng.random() < 0.7:
        lo = rng.randint(at, size)
        hi = rng.randint(lo, min(size, lo + 8))
        spans.append((lo, hi))
        at = hi
    return size, np.asarray(starts, np.int64), np.asarray(ends, np.int64), spans


def test_read_targets_equal_span_by_span_on_random_reads():
    rng = random.Random(3)
    for _ in range(300):
        convs = [_conversation(rng) for _ in range(rng.randint(1, 6))]
        sizes = [c[0] for c in convs]
        starts = np.concatenate([c[1] for c in convs])
        ends = np.concatenate([c[2] for c in convs])
        lengths = np.asarray([len(c[1]) for c in convs], np.int64)
        spans = [c[3] for c in convs]
        got = read_targets(starts, ends, lengths, spans, sizes)
        want = np.concatenate([span_targets(c[1], c[2], c[3]) for c in convs])
        assert got is not None
        assert got.tolist() == want.tolist(), (convs, got, want)


def test_spans_out_of_order_or_overlapping_are_left_to_the_span_by_span_rule():
    starts, ends = np.array([0, 3, 6]), np.array([2, 5, 8])
    lengths = np.array([3])
    assert read_targets(starts, ends, lengths, [[(4, 6), (0, 2)]], [8]) is None
    assert read_targets(starts, ends, lengths, [[(0, 5), (4, 6)]], [8]) is None
    # (spans of different conversations never meet: each one's characters are its own)
    two = read_targets(np.array([0, 0]), np.array([1, 1]), np.array([1, 1]), [[(0, 1)], []], [1, 1])
    assert two is not None and two.tolist() == [True, False]


def _alone(out: ChatTokens, k: int) -> tuple[list[int], list[bool]]:
    lo, hi = int(out.offsets[k]), int(out.offsets[k + 1])
    return out.tokens[lo:hi].tolist(), out.target[lo:hi].tolist()


@pytest.mark.parametrize("train_on", ["assistant", "all", "last_assistant", "everything"])
def test_a_read_at_once_equals_its_conversations_one_at_a_time(train_on: str) -> None:
    """Targets, BOS/EOS and the bad-record checks over a whole read give each conversation
    what it gets alone, and each bad one its reason and index."""
    chat = ChatSpec(template=CHATML_GENERATION, train_on=train_on, max_tokens=160)  # type: ignore[arg-type]
    spec = TokenizerSpec(kind="byte")
    turn = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    convs: list[Any] = [
        turn,
        [{"role": "user", "content": "a\ue000b"}, {"role": "assistant", "content": "c"}],
        [{"role": "user", "content": "nobody answers"}],
        [*turn, {"role": "user", "content": "x" * 200}, {"role": "assistant", "content": "z"}],
        [{"role": "system", "content": "be brief"}, *turn, *turn],
        [{"role": "user", "content": "é ü"}, {"role": "assistant", "content": "ß"}],
    ]
    whole = encode_chats(chat, spec, "c", convs)
    reasons = dict(whole.bad)
    assert "U+E000" in reasons[1] and "longer than the plan allows" in reasons[3]
    assert (2 in reasons) == (train_on in ("assistant", "last_assistant"))
    assert whole.kept.tolist() == [i for i in range(len(convs)) if i not in reasons]
    for k, i in enumerate(whole.kept.tolist()):
        alone = encode_chats(chat, spec, "c", [convs[i]])
        assert alone.bad == [] and _alone(whole, k) == _alone(alone, 0)


def test_plain_pairs_get_bos_and_eos_at_once_as_one_at_a_time() -> None:
    chat = ChatSpec(layout="prompt_completion", field="prompt", train_on="completion")
    spec = TokenizerSpec(kind="byte")
    pairs = [{"prompt": p, "completion": c} for p, c in
             [("ab", "cd"), ("", ""), ("x", ""), ("", "y"), ("pq", "r")]]  # fmt: skip
    whole = encode_chats(chat, spec, "pc", pairs)
    assert whole.bad == [] and whole.kept.tolist() == list(range(len(pairs)))
    for k, pair in enumerate(pairs):
        assert _alone(whole, k) == _alone(encode_chats(chat, spec, "pc", [pair]), 0)
    assert _alone(whole, 1) == ([256, 257], [False, True])

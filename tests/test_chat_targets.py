"""A whole read's target masks at once equal the span-by-span rule, conversation by conversation."""

from __future__ import annotations

import random

import numpy as np

from omniload_dask.preprocess.chat_targets import read_targets, span_targets


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

"""``derived``: the labels and positions every feeder computes per micro-batch. Plain text
takes a shortcut (the tokens shifted by one, each piece's last position ignored); it must give
exactly the labels that :func:`loss_positions` selects, for every shape a micro-batch takes:
empty pieces (first, inner, last), one-token pieces, padding after the tokens, no tokens."""

from __future__ import annotations

import numpy as np
import pytest

from omniload_dask.batching.labels import IGNORE_INDEX, derived, loss_positions


def _reference(ids: np.ndarray, cu: np.ndarray, total: int) -> tuple[np.ndarray, np.ndarray]:
    """Labels and positions spelt out: a label wherever ``loss_positions`` says, a position
    counted from each piece's first token; padding 0 and -100."""
    labels = np.full(len(ids), IGNORE_INDEX, dtype=np.int64)
    at = np.flatnonzero(loss_positions(cu, total, None, None))
    labels[at] = ids[at + 1]
    positions = np.zeros(len(ids), dtype=np.int64)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        positions[a:b] = np.arange(b - a)
    return positions, labels


@pytest.mark.parametrize("seed", range(40))
def test_plain_text_labels_are_those_loss_positions_selects(seed: int) -> None:
    rng = np.random.default_rng(seed)
    pieces = rng.integers(0, 6, size=int(rng.integers(0, 8)))  # zeros: empty pieces
    total = int(pieces.sum())
    width = total + int(rng.integers(0, 4))  # padding after the tokens
    cu = np.concatenate([[0], np.cumsum(pieces)]).astype(np.int32)
    ids = rng.integers(0, 1000, size=width).astype(np.int64)
    positions, labels = derived(ids, cu, total, None)
    want_positions, want_labels = _reference(ids, cu, total)
    np.testing.assert_array_equal(labels, want_labels)
    np.testing.assert_array_equal(positions, want_positions)
    assert labels.dtype == np.int64 and positions.dtype == np.int64


@pytest.mark.parametrize("cu", [[0], [0, 0], [0, 0, 3], [0, 3, 3], [0, 1, 2, 3]])
def test_edge_shapes(cu: list[int]) -> None:
    cu_arr = np.asarray(cu, dtype=np.int32)
    total = cu[-1]
    for width in (total, total + 2):
        if width == 0 and total == 0:
            ids = np.zeros(0, dtype=np.int64)
        else:
            ids = np.arange(10, 10 + width, dtype=np.int64)
        positions, labels = derived(ids, cu_arr, total, None)
        want_positions, want_labels = _reference(ids, cu_arr, total)
        np.testing.assert_array_equal(labels, want_labels)
        np.testing.assert_array_equal(positions, want_positions)

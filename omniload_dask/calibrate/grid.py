"""Which micro-batches a calibration times: a grid to fit on, and random ones held back.

A :class:`MicroBatch` is the shape of one packed micro-batch: its document pieces (lengths, in
order) and the images they carry (patches per image, and the piece holding each). The fit grid
spreads the terms apart so that each can be told from the others; the held-back micro-batches
look like what a balancer packs (a mix of short and long documents, mostly full), and only
check the fit. For ``seq_len`` 1024 the fit grid holds, among others::

    [1024]  [512, 512]  [256] * 4  ...  [16] * 64     full, more and more pieces
    [16]  [32]  [64]  ...  [1024]                     one piece, longer and longer
    [768, 64, 64, 64, 64]                             one long piece among short ones
    random packings of log-uniform lengths, filled to 50-100 %

Everything is drawn from a seeded generator: the same arguments give the same grid.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["MicroBatch", "fit_grid", "held_back"]


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch to time: piece lengths, and images (patches) with the piece of each."""

    pieces: tuple[int, ...]
    images: tuple[int, ...] = ()
    image_piece: tuple[int, ...] = ()

    @property
    def tokens(self) -> int:
        """Tokens in the micro-batch (the sum of its pieces)."""
        return sum(self.pieces)

    def to_dict(self) -> dict[str, list[int]]:
        """The micro-batch as plain data (its pieces, and its images' patches if any)."""
        out = {"pieces": list(self.pieces)}
        if self.images:
            out["images"] = list(self.images)
            out["image_piece"] = list(self.image_piece)
        return out


def fit_grid(
    seq_len: int,
    *,
    min_length: int = 16,
    random: int = 24,
    images: Sequence[int] = (),
    merge: int = 2,
    seed: int = 0,
) -> list[MicroBatch]:
    """Micro-batches of at most ``seq_len`` tokens that separate the terms (module doc).

    ``images``: patch counts to time (each a multiple of ``merge**2``); with them, micro-batches
    of text pieces that carry 1 to 4 images of each size are added.
    """
    rng = np.random.default_rng(seed)
    out: list[MicroBatch] = []
    k = 1
    while seq_len // k >= min_length:  # full, ever more pieces
        out.append(MicroBatch((seq_len // k,) * k))
        k *= 2
    for length in _geometric(min_length, seq_len, 8)[:-1]:  # one piece, partly full
        out.append(MicroBatch((length,)))
    short = max(min_length, seq_len // 32)
    for share in (0.5, 0.75):  # one long piece among short ones
        long = int(share * seq_len)
        out.append(MicroBatch((long,) + (short,) * ((seq_len - long) // short)))
    for _ in range(random):
        out.append(_packing(rng, seq_len, min_length, float(rng.uniform(0.5, 1.0)), "uniform"))
    out += _image_batches(rng, seq_len, images, merge, random=False)
    return out


def held_back(
    seq_len: int,
    count: int = 24,
    *,
    min_length: int = 16,
    images: Sequence[int] = (),
    merge: int = 2,
    seed: int = 1,
) -> list[MicroBatch]:
    """``count`` micro-batches packed like a balancer's (mostly full, short and long documents
    mixed), never in the fit grid; with ``images``, a quarter of them also carry images."""
    rng = np.random.default_rng(seed + 7919)  # never the fit grid's stream
    with_images = count // 4 if images else 0
    out = [
        _packing(rng, seq_len, min_length, float(rng.uniform(0.75, 1.0)), "mix")
        for _ in range(count - with_images)
    ]
    more: list[MicroBatch] = []
    while len(more) < with_images:
        more += _image_batches(rng, seq_len, images, merge, random=True)
    return out + more[:with_images]


def _geometric(lo: int, hi: int, n: int) -> list[int]:
    """``n`` integers from ``lo`` to ``hi``, evenly spaced in log."""
    return sorted({round(float(x)) for x in np.geomspace(lo, hi, n)})


def _packing(
    rng: np.random.Generator, seq_len: int, min_length: int, fill: float, kind: str
) -> MicroBatch:
    """Pieces drawn one by one until ``fill * seq_len`` tokens; the last one is cut to fit.

    ``uniform``: log-uniform lengths; ``mix``: a heavy-tailed mix like real corpora (short
    web-like documents, longer files, and documents as long as the micro-batch).
    """
    target = max(min_length, int(fill * seq_len))
    pieces: list[int] = []
    left = target
    while left >= min_length:
        if kind == "uniform":
            n = float(np.exp(rng.uniform(np.log(min_length), np.log(seq_len))))
        else:
            which = rng.choice(3, p=[0.6, 0.3, 0.1])
            median = (seq_len / 40, seq_len / 8, seq_len / 1.5)[which]
            n = float(rng.lognormal(np.log(median), 0.8))
        pieces.append(int(min(max(n, min_length), left)))
        left -= pieces[-1]
    return MicroBatch(tuple(pieces))


def _image_batches(
    rng: np.random.Generator, seq_len: int, images: Sequence[int], merge: int, random: bool
) -> list[MicroBatch]:
    """Micro-batches of text documents that carry images: each image in a document of its
    tokens (``patches / merge**2``) plus some text; the rest filled with text pieces."""
    out = []
    for patches in images:
        tokens = int(patches) // (merge * merge)
        if tokens < 1 or tokens + 16 > seq_len:
            raise ValueError(f"an image of {patches} patches does not fit {seq_len} tokens")
        most = max(1, min(4, seq_len // (tokens + 16)))
        for count in sorted({1, most} if not random else {int(rng.integers(1, most + 1))}):
            text = int(rng.integers(16, 64))
            doc = min(seq_len // count, tokens + text)
            pieces = [doc] * count
            left = seq_len - doc * count
            while left >= 32:
                n = min(left, int(rng.integers(32, max(33, seq_len // 4))))
                pieces.append(n)
                left -= n
            out.append(MicroBatch(tuple(pieces), (int(patches),) * count, tuple(range(count))))
    return out

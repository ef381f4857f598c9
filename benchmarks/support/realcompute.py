"""Step time on real compute: a small transformer's forward and backward over packed batches.

The head-to-head and balance benchmarks both time what a trainer rank would spend on its
micro-batches, instead of scoring them with the balancer's own cost model::

    timer = StepTimer()                       # CPU, one torch thread, fixed seed
    timer.calibrate()                         # time one piece of each length in GRID
    timer.fit()                               # (linear, quadratic) for a plan's cost section
    timer.micro_batch([512, 7680])            # measured: forward + backward of this batch
    timer.estimate([512, 7680])               # the sum of its pieces' measured times
    step = timer.step([[512, 7680], [8192]])  # per rank (estimates): the step waits for the
    step.max, step.mean, step.efficiency      # slowest rank; the mean is the balance bound

The model (``TINY``: 2 layers, hidden 64, one head of 64, SwiGLU 256) attends within each piece
only (causal), as varlen attention does, so its cost is additive over the pieces of a
micro-batch and a long document costs its square. That is why a step is timed from the measured
per-piece curve (``estimate``, interpolated between measured lengths) and checked against
direct measurements of whole micro-batches (``micro_batch``): timing every micro-batch of every
rank directly would take hours on one CPU core. Note the proportions: at 8k tokens this model
spends about 90 % of its time in attention, an 8B model about 15 %; a cost model calibrated on it
(``fit``) is far more quadratic than one of an 8B model.

Times are the process's CPU seconds (``time.process_time``) with one torch thread, the best of
``repeats``: on a shared, noisy machine CPU time moves far less than wall time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["GRID", "TINY", "StepTime", "StepTimer"]

TINY = {"hidden": 64, "layers": 2, "heads": 1, "ffn": 256, "vocab": 256}
GRID = (32, 64, 128, 256, 512, 1024, 2048, 3072, 4096, 6144, 8192)


@dataclass(frozen=True)
class StepTime:
    """One step's measured per-rank seconds."""

    ranks: tuple[float, ...]

    @property
    def max(self) -> float:
        """The step's time: the slowest rank's."""
        return max(self.ranks)

    @property
    def mean(self) -> float:
        """The perfect-balance bound: every rank doing the mean work."""
        return float(np.mean(self.ranks))

    @property
    def efficiency(self) -> float:
        return self.mean / self.max if self.max > 0 else 1.0


class StepTimer:
    """Times forward + backward of :data:`TINY` over packed micro-batches (see module doc)."""

    def __init__(self, seed: int = 0, repeats: int = 2, model: dict[str, Any] | None = None):
        import torch

        torch.manual_seed(seed)
        torch.set_num_threads(1)
        self.torch = torch
        self.cfg = {**TINY, **(model or {})}
        self.repeats = repeats
        self.cache: dict[tuple[int, ...], float] = {}
        self.model = _build(torch, self.cfg)
        self.micro_batch([64, 192])  # warm-up: first calls allocate

    def micro_batch(self, pieces: list[int] | np.ndarray) -> float:
        """CPU seconds of one micro-batch whose documents have these token counts."""
        key = tuple(int(n) for n in pieces if n > 0)
        if not key:
            return 0.0
        if key in self.cache:
            return self.cache[key]
        torch = self.torch
        gen = torch.Generator().manual_seed(len(key))
        ids = torch.randint(0, self.cfg["vocab"], (sum(key),), generator=gen)
        best = float("inf")
        for _ in range(self.repeats):
            self.model.zero_grad(set_to_none=True)
            t0 = time.process_time()
            loss = self.model(ids, list(key))
            loss.backward()
            best = min(best, time.process_time() - t0)
        self.cache[key] = best
        return best

    def calibrate(self, grid: tuple[int, ...] = GRID, up_to: int | None = None) -> None:
        """Time one piece of each length in ``grid`` (up to ``up_to``) for :meth:`estimate`."""
        self.grid = np.asarray([n for n in grid if up_to is None or n <= up_to], np.int64)
        self.grid_s = np.asarray([self.micro_batch([int(n)]) for n in self.grid])
        # what a call costs whatever its size (the model's per-batch overhead), from a pack of
        # small pieces: counted once per micro-batch, not once per piece
        small = int(self.grid[0])
        pack = self.micro_batch([small] * 64)
        self.overhead = max(0.0, (64 * self.grid_s[0] - pack) / 63)

    def save(self) -> dict[str, Any]:
        """The calibration as plain data (for :meth:`load`)."""
        return {"grid": self.grid.tolist(), "seconds": self.grid_s.tolist(),
                "overhead": self.overhead}  # fmt: skip

    def load(self, data: dict[str, Any]) -> None:
        """Use a calibration :meth:`save` gave (measured earlier on this machine)."""
        self.grid = np.asarray(data["grid"], np.int64)
        self.grid_s = np.asarray(data["seconds"], np.float64)
        self.overhead = float(data["overhead"])

    def estimate(self, pieces: list[int] | np.ndarray) -> float:
        """Seconds of a micro-batch from its pieces' measured times (log-log interpolation),
        the per-call overhead counted once."""
        lengths = np.asarray([n for n in pieces if n > 0], np.float64)
        if not len(lengths):
            return 0.0
        x, y = np.log(self.grid), np.log(self.grid_s)
        slope_lo = (y[1] - y[0]) / (x[1] - x[0])
        slope_hi = (y[-1] - y[-2]) / (x[-1] - x[-2])
        lx = np.log(lengths)
        out = np.interp(lx, x, y)
        out = np.where(lx < x[0], y[0] + slope_lo * (lx - x[0]), out)
        out = np.where(lx > x[-1], y[-1] + slope_hi * (lx - x[-1]), out)
        return float((np.exp(out) - self.overhead).sum() + self.overhead)

    def fit(self) -> tuple[float, float]:
        """Least-squares ``(linear, quadratic)`` seconds per token and token squared of the
        calibration, for a plan's ``cost: {linear, quadratic}`` (weighted by relative error)."""
        n = self.grid.astype(np.float64)
        a = np.stack([n, n * n], axis=1) / self.grid_s[:, None]
        coef, *_ = np.linalg.lstsq(a, np.ones(len(n)), rcond=None)
        return max(float(coef[0]), 1e-12), max(float(coef[1]), 0.0)

    def step(self, ranks: list[list[list[int]]]) -> StepTime:
        """Per rank, its micro-batches' pieces: estimated seconds per rank."""
        return StepTime(tuple(sum(self.estimate(mb) for mb in rank) for rank in ranks))


def _build(torch: Any, cfg: dict[str, Any]) -> Any:
    import torch.nn.functional as F

    h, heads, f = cfg["hidden"], cfg["heads"], cfg["ffn"]

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.n1, self.n2 = torch.nn.RMSNorm(h), torch.nn.RMSNorm(h)
            self.qkv = torch.nn.Linear(h, 3 * h, bias=False)
            self.out = torch.nn.Linear(h, h, bias=False)
            self.gate = torch.nn.Linear(h, f, bias=False)
            self.up = torch.nn.Linear(h, f, bias=False)
            self.down = torch.nn.Linear(f, h, bias=False)

        def forward(self, x: Any, sizes: list[int]) -> Any:
            qkv = self.qkv(self.n1(x)).view(-1, 3, heads, h // heads)
            outs = []
            for part in qkv.split(sizes):  # attention within each document only
                q, k, v = part.permute(1, 2, 0, 3).unbind(0)  # heads x tokens x dim
                outs.append(F.scaled_dot_product_attention(q, k, v, is_causal=True))
            a = torch.cat(outs, dim=1).permute(1, 0, 2).reshape(-1, h)
            x = x + self.out(a)
            y = self.n2(x)
            return x + self.down(F.silu(self.gate(y)) * self.up(y))

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(cfg["vocab"], h)
            self.blocks = torch.nn.ModuleList([Block() for _ in range(cfg["layers"])])
            self.head = torch.nn.Linear(h, cfg["vocab"], bias=False)

        def forward(self, ids: Any, sizes: list[int]) -> Any:
            x = self.emb(ids)
            for block in self.blocks:
                x = block(x, sizes)
            return F.cross_entropy(self.head(x), ids)

    return Model()

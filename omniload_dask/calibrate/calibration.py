"""The calibration procedure: time a grid of micro-batches, fit the terms, check the fit.

:func:`calibrate` loads the model (:mod:`.runner`), times the fit grid and the held-back
micro-batches in one interleaved run until each one's time is confirmed (:mod:`.grid`,
:mod:`.steady`), fits on the grid and checks on the held-back ones (:mod:`.fit`), and returns
a :class:`~.result.Calibration`. Imports torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from omniload_dask.calibrate.fit import check_fit, features, fit_terms
from omniload_dask.calibrate.grid import fit_grid, held_back
from omniload_dask.calibrate.result import Calibration
from omniload_dask.calibrate.runner import StepTimer, load_model
from omniload_dask.errors import CalibrationError

__all__ = ["calibrate"]


def calibrate(
    model: str | Mapping[str, Any],
    *,
    seq_len: int,
    device: str = "cpu",
    threads: int = 1,
    repeats: int = 5,
    max_repeats: int | None = None,
    dtype: Any = None,
    attention: str = "auto",
    encoder: Mapping[str, Any] | None = None,
    images: Sequence[int] = (),
    patch_size: int = 14,
    merge: int = 2,
    vocab: int | None = None,
    random: int = 24,
    held_back_count: int = 24,
    min_length: int = 16,
    seed: int = 0,
    progress: Callable[[str, int, int], None] | None = None,
) -> Calibration:
    """Time ``model`` on a grid of micro-batches of at most ``seq_len`` tokens, fit the cost
    terms, and check them on held-back micro-batches (see :mod:`omniload_dask.calibrate`).

    Each micro-batch's time is fitted at the machine's best speed from at least ``repeats``
    timings, and at most ``max_repeats`` (default three times ``repeats``) until it is
    confirmed (:meth:`.StepTimer.settle`).
    ``images`` (patch counts) adds micro-batches with images, for the encoder terms.
    ``progress(phase, done, total)`` is called as timings complete.
    """
    import torch

    if seq_len < 2 * min_length:
        raise CalibrationError(f"seq_len: must be >= {2 * min_length}, got {seq_len}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise CalibrationError(f"device: {device!r} asked for, but torch sees no CUDA device")
    if images and encoder is None and not isinstance(model, str):
        raise CalibrationError("images: timing images needs an encoder description (or a "
                               "model factory whose model takes them)")  # fmt: skip
    net, about = load_model(model, device, dtype=dtype, attention=attention, encoder=encoder,
                            patch_size=patch_size, merge=merge)  # fmt: skip
    if vocab is None:
        vocab = int(about.get("transformer", {}).get("vocab", 0)) or 256
    timer = StepTimer(net, device, vocab=vocab, threads=threads, patch_size=patch_size,
                      merge=merge, seed=seed)  # fmt: skip
    grid = fit_grid(seq_len, min_length=min_length, random=random, images=images, merge=merge,
                    seed=seed)  # fmt: skip
    check = held_back(seq_len, held_back_count, min_length=min_length, images=images,
                      merge=merge, seed=seed)  # fmt: skip
    steps = [[mb] for mb in grid + check]

    def report(done: int, total: int) -> None:
        if progress is not None:
            progress("timing", done, total)

    settled = timer.settle(steps, keep=repeats, min_repeats=repeats, progress=report,
                           max_repeats=max(repeats, max_repeats or 3 * repeats))  # fmt: skip
    best = settled.seconds
    rows = features([mb.pieces for mb in grid + check], [mb.images for mb in grid + check])
    n = len(grid)
    try:
        fit = fit_terms(rows[:n], best[:n])
    except ValueError as exc:
        raise CalibrationError(f"cannot fit the cost terms: {exc}") from None
    verdict = check_fit(fit, rows[n:], best[n:]) if len(check) else None
    errors = settled.error[np.isfinite(settled.error)]
    noise = float(np.median(errors)) if len(errors) else None
    return Calibration(
        fit=fit,
        check=verdict,
        seq_len=seq_len,
        model=about,
        device=str(timer.device),
        device_name=_device_name(timer.device),
        threads=threads,
        clock=timer.clock,
        repeats=repeats,
        torch_version=str(torch.__version__),
        dtype=str(next(iter(timer.parameters)).dtype).replace("torch.", "")
        if timer.parameters
        else "",
        noise=noise,
        timing=settled.summary(),
        fit_batches=grid,
        held_batches=check,
        fit_seconds=best[:n],
        held_seconds=best[n:],
    )


def _device_name(device: Any) -> str:
    """A readable name of the device (the CPU model on Linux, the GPU's name on CUDA)."""
    import platform

    import torch

    if device.type == "cuda":
        return str(torch.cuda.get_device_name(device))
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()

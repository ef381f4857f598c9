"""A calibration's outcome: the fitted terms, how well they predict, and the file it writes.

The file is YAML: a ``cost:`` block, exactly as a plan takes it (copy it into a plan, or name
the file with ``cost: {calibration: FILE}``), and a ``calibration:`` section that says how it
was measured and how well it fits. Costs are in microseconds of forward + backward::

    cost:
      piece: 742.284        # per document piece (one attention call each)
      linear: 31.2612       # per token
      quadratic: 0.0194192  # per token squared (attention)
    calibration:
      version: 1
      unit: microseconds
      model: {transformer: {hidden: 64, layers: 2, ...}, attention: loop}
      device: cpu   device_name: ...   threads: 1   clock: thread CPU time
      repeats: 5            # timings of each micro-batch at least, more until confirmed
      timing: {units: 67, timings: 402, counted_share: 0.93, confirmed_share: 0.97, ...}
      micro_batch: 1729.12  # the fixed part of every micro-batch (not a balancing cost)
      fit: {points: 41, dropped: 2, mean_abs_rel_error_pct: 2.518}
      held_back: {points: 24, mean_abs_rel_error_pct: 2.273, max_abs_rel_error_pct: 10.01,
                  rank_correlation: 0.97217}
      timings: {fit: [...], held_back: [...]}   # each micro-batch's pieces and seconds

Only ``cost`` and ``calibration.version`` are read back (:mod:`omniload_dask.plan.parse_cost`);
the rest is for people, and for refitting without timing again.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from omniload_dask.calibrate.fit import Check, Fit
from omniload_dask.calibrate.grid import MicroBatch
from omniload_dask.errors import CalibrationError
from omniload_dask.plan.parse_cost import CALIBRATION_VERSION

__all__ = ["Calibration"]

MICRO = 1e6  # the file's unit: microseconds
COST_TERMS = (  # (term in the fit, key in the cost: block)
    ("piece", "piece"),
    ("linear", "linear"),
    ("quadratic", "quadratic"),
)
ENCODER_TERMS = (("encoder_linear", "linear"), ("encoder_quadratic", "quadratic"))


def _round(x: float, digits: int = 6) -> float:
    """``x`` to ``digits`` significant digits (a readable file; far below the timing noise)."""
    return float(f"{x:.{digits}g}")


@dataclass
class Calibration:
    """What :func:`omniload_dask.calibrate.calibrate` measured and fitted."""

    fit: Fit
    check: Check | None
    seq_len: int
    model: dict[str, Any]
    device: str
    device_name: str
    threads: int
    clock: str
    repeats: int
    torch_version: str
    dtype: str
    noise: float | None  # the median relative standard error of the micro-batches' times
    timing: dict[str, Any] = field(default_factory=dict)  # Settled.summary(): how it was timed
    fit_batches: list[MicroBatch] = field(default_factory=list)
    held_batches: list[MicroBatch] = field(default_factory=list)
    fit_seconds: np.ndarray = field(default_factory=lambda: np.zeros(0))
    held_seconds: np.ndarray = field(default_factory=lambda: np.zeros(0))
    date: str = field(default_factory=lambda: datetime.date.today().isoformat())

    @property
    def has_encoder(self) -> bool:
        """Whether the fit has a non-zero image (encoder) term."""
        return any(self.fit.coefficient(t) for t, _ in ENCODER_TERMS)

    def cost_block(self) -> dict[str, Any]:
        """The ``cost:`` block (microseconds); a CalibrationError if the fit left no token term."""
        out: dict[str, Any] = {k: _round(self.fit.coefficient(t) * MICRO) for t, k in COST_TERMS}
        if out["linear"] == 0 and out["quadratic"] == 0:
            raise CalibrationError(
                "the fit found no cost per token nor per token squared: the timings do not grow "
                "with the tokens (too noisy, or the model ignores its input?)"
            )
        if self.has_encoder:
            out["encoder"] = {k: _round(self.fit.coefficient(t) * MICRO) for t, k in ENCODER_TERMS}
        return out

    def cost_model(self) -> Any:
        """The :class:`~omniload_dask.plan.cost.CostModel` of :meth:`cost_block`."""
        from omniload_dask.plan.cost import CostModel

        block = self.cost_block()
        encoder = block.get("encoder", {})
        return CostModel(
            linear=block["linear"],
            quadratic=block["quadratic"],
            piece=block["piece"],
            encoder_linear=encoder.get("linear", 0.0),
            encoder_quadratic=encoder.get("quadratic", 0.0),
        )

    @property
    def micro_batch_seconds(self) -> float:
        """The fitted fixed time of one micro-batch (the same for every rank)."""
        return self.fit.coefficient("micro_batch")

    def to_document(self) -> dict[str, Any]:
        """The file's content as plain data (module doc)."""
        meta: dict[str, Any] = {
            "version": CALIBRATION_VERSION,
            "unit": "microseconds",
            "date": self.date,
            "model": self.model,
            "seq_len": self.seq_len,
            "device": self.device,
            "device_name": self.device_name,
            "threads": self.threads,
            "clock": self.clock,
            "repeats": self.repeats,
            **({"timing": self.timing} if self.timing else {}),
            "torch": self.torch_version,
            "dtype": self.dtype,
            "micro_batch": _round(self.micro_batch_seconds * MICRO),
            "fit": {
                "points": self.fit.points,
                "dropped": self.fit.dropped,
                "mean_abs_rel_error_pct": round(100 * self.fit.mean_abs_rel_error, 3),
            },
        }
        if self.check is not None:
            meta["held_back"] = self.check.to_dict()
        if self.noise is not None:
            meta["timer_noise_pct"] = round(100 * self.noise, 3)
        meta["timings"] = {
            "fit": _timings(self.fit_batches, self.fit_seconds),
            "held_back": _timings(self.held_batches, self.held_seconds),
        }
        return {"cost": self.cost_block(), "calibration": meta}

    def write(self, path: str | os.PathLike[str]) -> Path:
        """Write the calibration file (module doc); returns its path."""
        path = Path(path)
        header = (
            f"# Cost calibration by `omniload calibrate`, {self.date}: forward + backward on "
            f"{self.device} ({self.device_name}).\n# Use it in a plan with "
            f"`cost: {{calibration: {path.name}}}`, or copy its cost: block.\n"
        )
        body = yaml.safe_dump(self.to_document(), sort_keys=False, default_flow_style=None,
                              width=100)  # fmt: skip
        try:
            path.write_text(header + body)
        except OSError as exc:
            raise CalibrationError(f"cannot write {str(path)!r}: {exc.strerror}") from None
        return path

    def _confirmed(self) -> str:
        """`` (97 % confirmed)``: the share of micro-batches whose best was confirmed."""
        share = self.timing.get("confirmed_share")
        return "" if share is None else f" ({100 * share:.0f} % confirmed)"

    def summary(self) -> str:
        """The fit as a few lines for a terminal."""
        block = self.cost_block()
        lines = [
            f"calibrated on {self.device} ({self.device_name}), {self.threads} thread(s), "
            f"{self.clock}, {self.repeats}+ timings each{self._confirmed()}, micro-batches of "
            f"up to {self.seq_len} tokens",
            f"  per piece         {block['piece']:>12.6g} us",
            f"  per token         {block['linear']:>12.6g} us",
            f"  per token^2       {block['quadratic']:>12.6g} us",
        ]
        if "encoder" in block:
            lines += [
                f"  per patch         {block['encoder']['linear']:>12.6g} us",
                f"  per patch^2       {block['encoder']['quadratic']:>12.6g} us",
            ]
        lines.append(
            f"  per micro-batch   {self.micro_batch_seconds * MICRO:>12.6g} us (fixed; not a "
            "balancing cost)"
        )
        lines.append(
            f"fit: {self.fit.points} micro-batches ({self.fit.dropped} left out as disturbed), "
            f"mean |error| {100 * self.fit.mean_abs_rel_error:.2f} %"
        )
        if self.check is not None:
            lines.append(
                f"held back: {self.check.points} micro-batches, mean |error| "
                f"{100 * self.check.mean_abs_rel_error:.2f} %, max "
                f"{100 * self.check.max_abs_rel_error:.2f} %, rank correlation "
                f"{self.check.rank_correlation:.4f}"
            )
        if self.noise is not None:
            lines.append(f"timer noise: a micro-batch's time to {100 * self.noise:.2f} % "
                         "(standard error, median)")  # fmt: skip
        return "\n".join(lines)


def _timings(batches: list[MicroBatch], seconds: np.ndarray) -> list[dict[str, Any]]:
    return [
        {**mb.to_dict(), "seconds": _round(float(s))}
        for mb, s in zip(batches, np.asarray(seconds).tolist(), strict=True)
    ]

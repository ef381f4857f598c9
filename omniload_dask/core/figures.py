"""The data plane's figures: counters, per-step records, dealing times, the realised mix.

:class:`Figures` owns what the data plane has counted since the job began (documents, tokens,
capacity, cuts, balance efficiency; a checkpoint carries them as ``counters``) and the records
of the last ``HISTORY`` steps (:class:`StepFigures`), which feed the stats, the dashboard and
:meth:`Figures.mixture`::

    step 41: efficiency 0.97, 2 micro-steps, 8192 tokens in 31 documents
             source_tokens [6100, 2092]  target [0.75, 0.25]  cuts 1

Pure: no I/O and no Dask.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omniload_dask.batching.balance import Assignment
from omniload_dask.core.streams import SourceStream

__all__ = ["COUNTERS", "HISTORY", "Figures", "StepFigures"]

HISTORY = 4096  # steps whose figures are kept
# The counters a checkpoint carries, in this order: the first seven are added up by deltas,
# the last two (efficiency sum and minimum) are carried whole.
COUNTERS = (
    "documents",
    "tokens",
    "capacity_tokens",
    "extra_micro_steps",
    "cuts",
    "spilled",
    "steps_drawn",
    "efficiency_sum",
    "efficiency_min",
)


@dataclass
class StepFigures:
    """What one drawn step was: its balance, shape, tokens and mix."""

    step: int
    efficiency: float
    num_micro_steps: int
    tokens: int
    documents: int
    source_tokens: list[int] = field(default_factory=list)
    source_documents: list[int] = field(default_factory=list)
    target: list[float] = field(default_factory=list)  # weight shares the step was drawn with
    cuts: int = 0


class Figures:
    """Counters since the job began, the last steps' figures, and dealing times."""

    def __init__(self, groups: int, declared_micro_steps: int) -> None:
        """Figures of a job with ``groups`` DP groups and as many micro-steps per step as
        its plan declares (steps that need more count as ``extra_micro_steps``)."""
        self._groups = groups
        self._declared = declared_micro_steps
        self.documents = 0
        self.tokens = 0
        self.capacity_tokens = 0
        self.extra_micro_steps = 0
        self.cuts = 0
        self.spilled = 0
        self.steps_drawn = 0
        self.efficiency_sum = 0.0
        self.efficiency_min = 1.0
        self.history: deque[StepFigures] = deque(maxlen=HISTORY)
        self.timing: dict[str, float] = {}  # milliseconds of the last step's dealing phases
        self.dealing_ms: deque[float] = deque(maxlen=256)

    def record(
        self,
        step: int,
        plan: Assignment,
        lengths: np.ndarray,
        source_tokens: np.ndarray,
        sources: np.ndarray,
        weights: np.ndarray,
        first: np.ndarray | None = None,
    ) -> None:
        """Count drawn step ``step``: its split, its documents' ``lengths`` and ``sources``,
        and the target ``weights`` it was drawn with (one per source).

        ``first`` marks the pieces that begin a document (the rest of a document begun in an
        earlier step adds tokens, not a document); all of them when not given.
        """
        efficiency = plan.efficiency
        first = np.ones(len(lengths), dtype=bool) if first is None else first
        documents = int(first.sum())
        self.documents += documents
        self.tokens += int(lengths.sum())
        self.capacity_tokens += self._groups * int(plan.micro_capacity.sum())
        self.extra_micro_steps += max(0, plan.num_micro_steps - self._declared)
        self.cuts += plan.cuts
        self.spilled += plan.spilled
        self.steps_drawn += 1
        self.efficiency_sum += efficiency
        self.efficiency_min = min(self.efficiency_min, efficiency)
        self.history.append(
            StepFigures(
                step=step,
                efficiency=efficiency,
                num_micro_steps=plan.num_micro_steps,
                tokens=int(lengths.sum()),
                documents=documents,
                source_tokens=source_tokens.astype(int).tolist(),
                source_documents=np.bincount(sources[first], minlength=len(weights)).tolist(),
                target=(weights / max(weights.sum(), 1e-300)).round(6).tolist(),
                cuts=plan.cuts,
            )
        )

    def dealt(self, total_ms: float) -> None:
        """A step was dealt in ``total_ms``; the split and recipes times are in ``timing``."""
        split = self.timing.get("assign_ms", 0.0) + self.timing.get("recipes_ms", 0.0)
        self.timing.update(step_ms=total_ms, draw_ms=total_ms - split)
        self.dealing_ms.append(total_ms)

    def counters(self) -> list[Any]:
        """The values of :data:`COUNTERS`, in that order."""
        return [getattr(self, k) for k in COUNTERS]

    def load_counters(self, values: Sequence[Any]) -> None:
        """Take the values of :data:`COUNTERS` (from a snapshot)."""
        for key, value in zip(COUNTERS, values, strict=True):
            setattr(self, key, value)

    def summary(self) -> dict[str, Any]:
        """The counters and recent figures, as ``PlaneView.stats`` reports them."""
        steps = self.steps_drawn
        recent = list(self.history)[-64:]
        return {
            "documents": self.documents,
            "tokens": self.tokens,
            "capacity_tokens": self.capacity_tokens,
            # empty positions of the micro-batches drawn, over their capacity (padding with
            # pad_to_seq_len; room left unused without it)
            "padding_share": (
                1.0 - self.tokens / self.capacity_tokens if self.capacity_tokens else None
            ),
            "extra_micro_steps": self.extra_micro_steps,
            "documents_cut": self.cuts,
            "documents_spilled": self.spilled,
            "steps_drawn": steps,
            "efficiency_mean": self.efficiency_sum / steps if steps else None,
            "efficiency_min": self.efficiency_min if steps else None,
            "efficiency_recent": [round(f.efficiency, 4) for f in recent],
            "planning_ms_p50": float(np.median(self.dealing_ms)) if self.dealing_ms else None,
        }

    def step_figures(self, start: int = 0) -> list[StepFigures]:
        """The kept figures of steps from ``start`` on."""
        return [f for f in self.history if f.step >= start]

    def mixture(
        self,
        window: int,
        streams: Sequence[SourceStream],
        now: np.ndarray,
        by_tokens: bool,
        before: int | None = None,
    ) -> list[dict[str, Any]]:
        """Per source: target and realised share, over the last ``window`` steps and overall,
        of the steps below ``before`` (the steps delivered; None: every step counted).

        Shares are of tokens (``by_tokens``) or of documents; the target of a window is the mean
        of its steps' normalised target weights, ``now`` the weights at the next step.
        """
        n = len(streams)
        kept = [f for f in self.history if before is None or f.step < before]
        recent = kept[-window:]
        ahead = [f for f in self.history if before is not None and f.step >= before]

        def pad(values: list[Any]) -> np.ndarray:
            return np.asarray(list(values) + [0] * (n - len(values)), dtype=np.float64)

        def realised(f: StepFigures) -> np.ndarray:
            return pad(f.source_tokens if by_tokens else f.source_documents)

        got = np.zeros(n)
        target = np.zeros(n)
        for f in recent:
            got += realised(f)
            target += pad(f.target)
        total = np.asarray([s.tokens if by_tokens else s.docs for s in streams], float)
        for f in ahead:  # counted, not delivered yet
            total -= realised(f)
        out = []
        for i, stream in enumerate(streams):
            out.append(
                {
                    "name": stream.spec.name,
                    "target_now": float(now[i] / now.sum()) if now.sum() else 0.0,
                    "target_window": float(target[i] / len(recent)) if recent else 0.0,
                    "realised_window": float(got[i] / got.sum()) if got.sum() else 0.0,
                    "realised_total": float(total[i] / total.sum()) if total.sum() else 0.0,
                    "epoch": stream.epoch,
                    "exhausted": stream.exhausted,
                    "retired": stream.retired,
                    "delivered_step": before,
                }
            )
        return out

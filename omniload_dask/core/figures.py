"""The data plane's figures: per-step records, stats and the realised mixture.

A part of :class:`~omniload_dask.core.coordinator.Coordinator` (it inherits this class); kept
apart so that each file holds one concern. Pure: no I/O and no Dask.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omniload_dask.batching.balance import Assignment
from omniload_dask.core.base import PlaneBase


@dataclass
class StepFigures:
    step: int
    efficiency: float
    num_micro_steps: int
    tokens: int
    documents: int
    source_tokens: list[int] = field(default_factory=list)
    source_documents: list[int] = field(default_factory=list)
    target: list[float] = field(default_factory=list)  # weight shares the step was drawn with
    cuts: int = 0


class Figures(PlaneBase):
    """Methods of the coordinator; see its docstring for the state they use."""

    def _record(
        self,
        step: int,
        plan: Assignment,
        lengths: np.ndarray,
        source_tokens: np.ndarray,
        sources: np.ndarray,
    ) -> None:
        efficiency = plan.efficiency
        self.documents += len(lengths)
        self.tokens += int(lengths.sum())
        self.capacity_tokens += self.layout.dp * int(plan.micro_capacity.sum())
        declared = sum(b.micro_batches for b in self.buckets)
        self.extra_micro_steps += max(0, plan.num_micro_steps - declared)
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
                documents=len(lengths),
                source_tokens=source_tokens.astype(int).tolist(),
                source_documents=np.bincount(sources, minlength=len(self.streams)).tolist(),
                target=(self._step_weights / max(self._step_weights.sum(), 1e-300))
                .round(6)
                .tolist(),
                cuts=plan.cuts,
            )
        )

    def stats(self) -> dict[str, Any]:
        """Counters for feeders, the report and monitoring (plain data)."""
        steps = self.steps_drawn
        recent = list(self.history)[-64:]
        weights = self.weights_at(self.next_step)
        quotas = self.read_quotas(weights) if self.plan.loader.quotas else None
        return {
            "next_step": self.next_step,
            "end_step": self.end_step,
            "log": list(self.log),
            "error": self.error,
            "documents": self.documents,
            "tokens": self.tokens,
            "capacity_tokens": self.capacity_tokens,
            "extra_micro_steps": self.extra_micro_steps,
            "documents_cut": self.cuts,
            "documents_spilled": self.spilled,
            "steps_drawn": steps,
            "efficiency_mean": self.efficiency_sum / steps if steps else None,
            "efficiency_min": self.efficiency_min if steps else None,
            "efficiency_recent": [round(f.efficiency, 4) for f in recent],
            "planning_ms_p50": float(np.median(self.planning_ms)) if self.planning_ms else None,
            "held_batches": len(self.held),
            "units_in_flight": sum(len(s.units) for s in self.streams),
            "ranks": {
                r: {"position": s.position, "requested_end": s.requested_end}
                for r, s in self.ranks.items()
            },
            "sources": [
                {
                    "name": s.spec.name,
                    "weight": float(weights[i]),
                    "epoch": s.epoch,
                    "epochs": s.spec.epochs,
                    "exhausted": s.exhausted,
                    "retired": s.retired,
                    "documents": s.docs,
                    "tokens": s.tokens,
                    "skipped": s.skipped,
                    "truncated_tokens": s.truncated_tokens,
                    "units_in_flight": len(s.units),
                    "reads_pending": sum(1 for u in s.units.values() if u.lengths is None),
                    "read_window": self._read_window(i, weights) if weights[i] > 0 else 0,
                    "read_tasks_pending": s.pending_reads(),
                    "quota": int(quotas[i]) if quotas is not None else None,
                    "seconds_per_record": self.meters[i].per_record,
                    "read_parts": self._last_parts.get(i, 1),
                }
                for i, s in enumerate(self.streams)
            ],
            "worker_threads": self.threads,
            "work_per_step": self.work_per_step(),
        }

    def step_figures(self, start: int = 0) -> list[StepFigures]:
        return [f for f in self.history if f.step >= start]

    def mixture(self, window: int = 100) -> list[dict[str, Any]]:
        """Per source: target and realised share, over the last ``window`` steps and overall.

        Shares are of tokens or of documents, as the plan's ``mixing.by`` says; the target of a
        window is the mean of its steps' normalised target weights.
        """
        by_tokens = self.plan.mixing_by == "tokens"
        n = len(self.streams)
        recent = list(self.history)[-window:]

        def pad(values: list[Any]) -> np.ndarray:
            return np.asarray(list(values) + [0] * (n - len(values)), dtype=np.float64)

        got = np.zeros(n)
        target = np.zeros(n)
        for f in recent:
            got += pad(f.source_tokens if by_tokens else f.source_documents)
            target += pad(f.target)
        total = np.asarray([s.tokens if by_tokens else s.docs for s in self.streams], float)
        now = self.weights_at(self.next_step)
        out = []
        for i, stream in enumerate(self.streams):
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
                }
            )
        return out

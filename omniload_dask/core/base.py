"""The state every part of the data plane shares, declared once for the type checker.

:class:`~omniload_dask.core.coordinator.Coordinator` is assembled from parts that each hold one
concern (:mod:`.plane_live`, :mod:`.plane_reads`, :mod:`.plane_figures`); they all work on the
state that ``Coordinator.__init__`` sets up. This class only declares it (annotations, no
values), so each part type-checks on its own.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from omniload_dask.batching.balance import Bucket
    from omniload_dask.batching.cost import CostModel
    from omniload_dask.batching.mixing import Mixer, WeightSchedule
    from omniload_dask.core.actions import Action
    from omniload_dask.core.autoscale import Meter
    from omniload_dask.core.figures import StepFigures
    from omniload_dask.core.state import StateRecorder
    from omniload_dask.core.streams import SourceStream, Unit, UnitRef
    from omniload_dask.plan import LayoutSpec, Plan

__all__ = ["PlaneBase"]


class PlaneBase:
    """Declarations only; see ``Coordinator.__init__`` for what each one holds."""

    plan: Plan
    run_id: str
    layout: LayoutSpec
    cost: CostModel
    buckets: list[Bucket]
    pinned: dict[int, int]
    caps: list[int]
    streams: list[SourceStream]
    schedule: WeightSchedule
    mixer: Mixer
    log: list[dict[str, Any]]
    _pending: list[tuple[int, str, Any]]
    _active: np.ndarray
    end_step: int | None
    next_step: int
    held: dict[tuple[int, int], str]
    _held_count: Counter[int]
    ranks: dict[int, Any]
    error: str | None
    history: deque[StepFigures]
    documents: int
    tokens: int
    capacity_tokens: int
    extra_micro_steps: int
    cuts: int
    spilled: int
    steps_drawn: int
    efficiency_sum: float
    efficiency_min: float
    _actions: list[Action]
    _keys: dict[str, tuple[int, UnitRef]]
    _starved: set[int]
    _reads_seen: dict[int, tuple[Any, ...]]
    planning_ms: deque[float]
    _step_weights: np.ndarray
    workers: int
    threads: int
    meters: list[Meter]
    construct_meter: Meter
    _part_of: dict[str, tuple[int, int]]
    _last_parts: dict[int, int]
    recorder: StateRecorder

    if TYPE_CHECKING:  # defined by Coordinator or another part

        @property
        def names(self) -> list[str]: ...

        def weights_at(self, step: int) -> np.ndarray: ...

        def _budget(self) -> tuple[int | None, int | None]: ...

        def read_key(self, source: int, ref: UnitRef) -> str: ...

        def _read_window(self, i: int, weights: np.ndarray) -> int: ...

        def _forget(self, unit: Unit) -> None: ...

        def work_per_step(self) -> float | None: ...

        def read_quotas(self, weights: np.ndarray) -> np.ndarray: ...

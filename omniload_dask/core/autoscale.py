"""Auto-partitioning: how the data is read, sized from measured costs (never which data).

Sources differ in what a sample costs to read and preprocess: decoding and patchifying an image
can cost twenty times what tokenizing a caption does. The data plane measures each source's cost
from its read tasks' durations and adapts three levels of how it reads, none of which touches
the sample stream (that stays a function of plan, seed, step and weight log):

1. **Task size.** A read unit whose measured cost exceeds ``loader.task_seconds`` is read in
   portions (:meth:`~omniload_dask.sources.Catalog.portions`: row, byte or record sub-ranges that
   together hold exactly the unit's records), so tasks last about the target time.
2. **Per-source quotas.** The cluster keeps ``reads_per_slot`` reads in flight per read slot
   of its workers; each source gets a share of those slots in proportion to the read work its weight
   asks of it per step (its share of the budget x the budget x measured cost per token or
   document; with ``mixing.by: documents`` and a token budget, the share of the tokens that
   the documents' mean lengths give), so a costly source is not starved behind cheap reads
   queued ahead of it. Quotas follow weight
   changes (each decision uses the weights of the steps being read for) and worker counts
   (a Dask cluster's ``scale``: the slots are counted from the workers the scheduler has).
3. **Worker count.** :func:`recommend_workers` turns the measured read work per step and the
   trainers' pace into the number of workers that keeps them fed, for Dask's adaptive scaling
   (:class:`omniload_dask.cluster.adaptive.OmniloadAdaptive`).

Worked example, 8 slots (4 workers x 1 thread x 2), by documents, 64 documents per step::

    source   share   cost/doc   work/step            quota
    text     0.5     1 ms       32 x 1 ms  = 32 ms   8 * 32 / 672 = 0.38 -> at least 1
    images   0.5     20 ms      32 x 20 ms = 640 ms  8 * 640 / 672 = 7.62 -> the other 7
    read work 0.672 s per step; trainers taking 10 steps/s -> 6.72 thread-seconds per second,
    x 1.2 headroom -> 9 workers of 1 thread
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["DECAY", "Meter", "portion_count", "quotas", "recommend_workers"]

DECAY = 0.9  # weight of the past at each new measurement (about the last 10 tasks count)
MAX_PORTIONS = 64  # a unit is read in at most this many tasks
HEADROOM = 1.2  # recommend this much more read capacity than the measured need


@dataclass
class Meter:
    """Recent read cost of one source: decayed sums over its finished read tasks.

    ``size`` is what a unit's cost scales with (records, or bytes where records are not known
    up front), measured per task so a unit's portions can be sized before it is read.
    """

    seconds: float = 0.0
    size: float = 0.0
    records: float = 0.0
    tokens: float = 0.0
    tasks: int = 0

    def add(self, seconds: float, size: float, records: float, tokens: float) -> None:
        """One finished read task: its compute seconds, size, records and tokens."""
        if not (seconds >= 0 and math.isfinite(seconds)):
            return
        self.seconds = self.seconds * DECAY + seconds
        self.size = self.size * DECAY + max(size, 0.0)
        self.records = self.records * DECAY + max(records, 0.0)
        self.tokens = self.tokens * DECAY + max(tokens, 0.0)
        self.tasks += 1

    @property
    def per_size(self) -> float | None:
        """Seconds per unit of size (None until measured)."""
        return self.seconds / self.size if self.size > 0 else None

    @property
    def per_record(self) -> float | None:
        """Seconds per record (None until measured)."""
        return self.seconds / self.records if self.records > 0 else None

    @property
    def per_token(self) -> float | None:
        """Seconds per token (None until measured)."""
        return self.seconds / self.tokens if self.tokens > 0 else None


def portion_count(size: int, per_size: float | None, target: float, max_portions: int) -> int:
    """Portions to read a unit of ``size`` in so each lasts about ``target`` seconds (>= 1).

    Unmeasured sources (``per_size`` None) and ``target`` 0 read whole units.
    """
    if per_size is None or target <= 0:
        return 1
    portions = round(size * per_size / target)
    return int(max(1, min(portions, max_portions, MAX_PORTIONS)))


def quotas(work: np.ndarray, slots: int) -> np.ndarray:
    """In-flight reads per source: ``slots`` shared in proportion to ``work``, at least 1 each.

    ``work[i]`` is source i's read seconds per step (0 for sources not read now; NaN when not
    measured yet, which counts as the mean of the measured ones, or equal shares if none is).
    The quotas add up to exactly ``slots`` (or to the number of sources read now, if that is
    more): a source whose proportional share is under one slot gets one, the others share the
    remaining slots in proportion, rounded by largest remainder (ties to the lower index).
    """
    work = np.asarray(work, dtype=np.float64)
    active = ~(work == 0)
    out = np.zeros(len(work), dtype=np.int64)
    n = int(active.sum())
    if n == 0:
        return out
    known = active & np.isfinite(work)
    fill = float(work[known].mean()) if known.any() else 1.0
    need = np.where(active, np.where(np.isfinite(work), work, fill), 0.0)
    # Sources whose share is under one slot get one; the others share what is left, again
    # in proportion (repeated until every remaining share is at least one slot).
    floor_one = np.zeros(len(work), dtype=bool)
    while True:
        rest = active & ~floor_one
        room = max(int(slots) - int(floor_one.sum()), 0)
        total = need[rest].sum()
        ideal = np.where(rest, room * need / total if total > 0 else 0.0, 0.0)
        small = rest & (ideal < 1)
        if not small.any():
            break
        floor_one |= small
    out[floor_one] = 1
    out[rest] = np.floor(ideal[rest]).astype(np.int64)
    left = int(slots) - int(out.sum())
    if left > 0:
        remainder = np.where(rest, ideal - np.floor(ideal), -1.0)
        for i in np.argsort(-remainder, kind="stable")[:left]:
            out[i] += 1
    return out


def recommend_workers(
    work_per_step: float | None,
    steps_per_second: float | None,
    wait_per_step: float,
    threads_per_worker: float,
    current: int,
) -> int:
    """Workers that keep the trainers fed.

    The trainers' own time per step is the measured step time less the time they waited for
    data; at that pace they would take ``1 / own`` steps per second, each costing
    ``work_per_step`` seconds of worker threads. With no measurements yet the current count
    stands. A trainer that only waits (own time near 0) asks for up to 20x the current rate,
    and Dask's adaptive ``maximum`` bounds the answer.
    """
    if work_per_step is None or not steps_per_second or steps_per_second <= 0:
        return max(1, current)
    step_time = 1.0 / steps_per_second
    own = max(step_time - max(wait_per_step, 0.0), 0.05 * step_time)
    threads = work_per_step / own * HEADROOM
    return max(1, math.ceil(threads / max(threads_per_worker, 1e-9) - 1e-9))

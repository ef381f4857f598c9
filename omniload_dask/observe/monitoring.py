"""What the data plane remembers for watching a job: read throughput, feeder reports, progress.

Pure and Dask-free: each running job (:class:`~omniload_dask.cluster.running.RunningJob`) feeds
its :class:`JobMonitor` events as they happen (a read task finished, a batch was built, a
feeder reported its waits, the slowest rank moved on); ``stats()`` reads the figures from it,
and the three views of a job show that: the dashboard page, the Prometheus metrics and
``omniload status``. Rates are taken over a recent window of those events, so a figure means the
same thing wherever it is shown::

    read task of source 1 done at t=12.3 s: 400 records, 51 200 tokens, read 0.04 s, tokenize 0.09 s
    feeder of rank 3 asks for steps 40..41: wait p50 0.02 ms, p99 1.9 ms, 1 of 2 steps buffered
    rates(now=15.0, window=10.0)[1] -> records/s and tokens/s of source 1 over t in (5, 15]

Nothing here is a checkpointed state: it is lost with the scheduler and starts again with it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from omniload_dask.errors import JobError

__all__ = ["FeederReport", "JobMonitor", "realised_shares"]

READ_LOG = 8192  # read completions kept for the throughput plots
STEP_LOG = 4096  # (time, slowest rank's step) samples kept for the steps/s figure
WINDOW = 10.0  # seconds of events behind a rate
BAD_EXAMPLES = 5  # reasons of skipped records kept per source


@dataclass(frozen=True)
class FeederReport:
    """What a feeder says about itself with each request for more steps.

    ``buffered`` is the number of steps the feeder held ahead of its trainer when it asked
    (its prefetch depth at that moment; ``prefetch`` is the most it keeps). The waits are the
    trainer's waits for a micro-batch over the feeder's recent ``samples`` waits.
    """

    rank: int
    time: float
    wait_p50: float | None
    wait_p99: float | None
    buffered: int
    prefetch: int
    samples: int

    FIELDS = ("wait_p50", "wait_p99", "buffered", "prefetch", "samples")

    @classmethod
    def parse(cls, rank: int, now: float, report: Mapping[str, Any]) -> FeederReport:
        """Check a report that came over RPC; a bad field raises JobError naming it."""
        if not isinstance(report, Mapping):
            raise JobError(f"feeder report of rank {rank}: expected a mapping, got {report!r}")
        unknown = set(report) - set(cls.FIELDS)
        if unknown:
            raise JobError(
                f"feeder report of rank {rank}: unknown fields {sorted(unknown)}; "
                f"known: {list(cls.FIELDS)}"
            )
        values: dict[str, Any] = {}
        for name in cls.FIELDS:
            value = report.get(name)
            if value is None and name.startswith("wait"):
                values[name] = None
                continue
            try:
                number = float(value if value is not None else 0)
            except (TypeError, ValueError):
                raise JobError(
                    f"feeder report of rank {rank}: {name} must be a number, got {value!r}"
                ) from None
            if not number >= 0:
                raise JobError(f"feeder report of rank {rank}: {name} must be >= 0, got {value!r}")
            if not number < 2**63:  # inf too: int() of it raises OverflowError
                raise JobError(
                    f"feeder report of rank {rank}: {name} must be a finite number below "
                    f"2**63, got {value!r}"
                )
            values[name] = number if name.startswith("wait") else int(number)
        return cls(rank=rank, time=now, **values)


class JobMonitor:
    """Event log and counters of one job, for monitoring only (never for decisions).

    Per source (arrays indexed by source, grown as sources join): records, tokens, read tasks,
    seconds reading+decoding and tokenizing (the task's own split), whole-task seconds, images
    decoded and bad ones, and the last few reasons records were skipped.
    """

    COUNTERS = (
        ("records", np.int64),
        ("read_tokens", np.int64),
        ("read_units", np.int64),
        ("read_seconds", np.float64),
        ("tokenize_seconds", np.float64),
        ("task_seconds", np.float64),
        ("images_read", np.int64),
        ("bad_images", np.int64),
    )

    def __init__(self, num_sources: int, started: float) -> None:
        self.started = started
        self.num_sources = 0
        self.records = np.zeros(0, dtype=np.int64)
        self.read_tokens = np.zeros(0, dtype=np.int64)
        self.read_units = np.zeros(0, dtype=np.int64)
        self.read_seconds = np.zeros(0, dtype=np.float64)
        self.tokenize_seconds = np.zeros(0, dtype=np.float64)
        self.task_seconds = np.zeros(0, dtype=np.float64)
        self.images_read = np.zeros(0, dtype=np.int64)
        self.bad_images = np.zeros(0, dtype=np.int64)
        self.bad_examples: list[deque[str]] = []
        self.batches_built = 0  # constructions finished (context-parallel slices not counted)
        # (finish time, source, records, tokens) of recent read tasks
        self._reads: deque[tuple[float, int, int, int]] = deque(maxlen=READ_LOG)
        self._progress: deque[tuple[float, int]] = deque(maxlen=STEP_LOG)
        self.feeders: dict[int, FeederReport] = {}
        self.grow(num_sources)

    def grow(self, num_sources: int) -> None:
        """Make room for sources added while the job runs."""
        extra = num_sources - self.num_sources
        if extra <= 0:
            return
        for name, dtype in self.COUNTERS:
            setattr(self, name, np.concatenate([getattr(self, name), np.zeros(extra, dtype)]))
        self.bad_examples.extend(deque(maxlen=BAD_EXAMPLES) for _ in range(extra))
        self.num_sources = num_sources

    # ------------------------------------------------------------------ events
    def on_read(
        self,
        source: int,
        now: float,
        records: int,
        tokens: int,
        read_seconds: float | None,
        tokenize_seconds: float | None,
        *,
        task_seconds: float | None = None,
        bad: Sequence[str] = (),
        images: int = 0,
        bad_images: int = 0,
    ) -> None:
        """A read (+ tokenize) task of ``source`` finished at ``now``.

        ``read_seconds`` and ``tokenize_seconds`` are the task's own split of its time;
        ``task_seconds`` is its whole compute time as Dask measured it; ``bad`` the reasons
        of the records it skipped.
        """
        if not 0 <= source < self.num_sources:
            return
        self.records[source] += records
        self.read_tokens[source] += tokens
        self.read_units[source] += 1
        self.read_seconds[source] += read_seconds or 0.0
        self.tokenize_seconds[source] += tokenize_seconds or 0.0
        self.task_seconds[source] += task_seconds or 0.0
        self.images_read[source] += images
        self.bad_images[source] += bad_images
        self.bad_examples[source].extend(bad)
        self._reads.append((now, source, records, tokens))

    def on_batch_built(self) -> None:
        """A batch construction finished."""
        self.batches_built += 1

    def on_feeder(self, rank: int, now: float, report: Mapping[str, Any]) -> FeederReport:
        """A feeder's report came with its request for more steps (checked; kept per rank)."""
        parsed = FeederReport.parse(rank, now, report)
        self.feeders[rank] = parsed
        return parsed

    def on_agent(self, ranks: Sequence[int], now: float, report: Mapping[str, Any]) -> None:
        """A fetching agent's report for the ranks it serves (checked once, kept for each)."""
        parsed = FeederReport.parse(int(ranks[0]), now, report)
        for rank in ranks:
            self.feeders[int(rank)] = parsed

    def on_progress(self, now: float, slowest_step: int) -> None:
        """Every rank has fetched every step below ``slowest_step`` (logged when it moves)."""
        if not self._progress or self._progress[-1][1] != slowest_step:
            self._progress.append((now, slowest_step))

    # ------------------------------------------------------------------ figures
    def rates(self, now: float, window: float = WINDOW) -> tuple[np.ndarray, np.ndarray]:
        """Records/s and tokens/s per source over the last ``window`` seconds (by finish time)."""
        span = min(window, max(now - self.started, 1e-9))
        records = np.zeros(self.num_sources, dtype=np.float64)
        tokens = np.zeros(self.num_sources, dtype=np.float64)
        for t, source, n, k in reversed(self._reads):
            if t <= now - span:
                break
            records[source] += n
            tokens[source] += k
        return records / span, tokens / span

    def steps_per_second(self, now: float, window: float = WINDOW) -> float | None:
        """Steps per second that the slowest rank went through lately; None before two samples."""
        recent = [(t, s) for t, s in self._progress if t > now - window]
        if len(recent) < 2:
            return None
        (t0, s0), s1 = recent[0], recent[-1][1]
        return (s1 - s0) / (now - t0) if now > t0 else None

    def throughput_series(
        self, now: float, bins: int = 60
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per-source records/s and tokens/s in ``bins`` equal time bins up to ``now``.

        Returns the bins' ends in seconds since the job started, and two ``(sources, bins)``
        arrays. The bins cover the whole run (or the logged reads once the log has wrapped), at
        least 1 s each, so a young job gets fewer than ``bins``.
        """
        first = self._reads[0][0] if len(self._reads) == self._reads.maxlen else self.started
        span = max(now - first, 1e-9)
        width = max(1.0, span / bins)
        n = max(1, min(bins, math.ceil(span / width)))
        low = now - width * n
        records = np.zeros((self.num_sources, n), dtype=np.float64)
        tokens = np.zeros((self.num_sources, n), dtype=np.float64)
        if self._reads:
            log = np.asarray(self._reads, dtype=np.float64)
            # bin k holds the reads that finished in (low + k * width, low + (k + 1) * width]
            index = np.minimum(np.ceil((log[:, 0] - low) / width).astype(np.int64) - 1, n - 1)
            keep = index >= 0
            src = log[keep, 1].astype(np.int64)
            np.add.at(records, (src, index[keep]), log[keep, 2])
            np.add.at(tokens, (src, index[keep]), log[keep, 3])
        ends = low + width * np.arange(1, n + 1)
        return ends - self.started, records / width, tokens / width


def realised_shares(
    figures: Sequence[Any], num_sources: int, by: str, window: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Target and realised mix per step from step figures (oldest first).

    Returns ``(steps, target, realised)``: the realised share of each source over the last
    ``window`` steps up to each step (documents or tokens, as the plan mixes ``by``), and the
    target share the data plane drew that step with; shares have shape ``(steps, sources)``.
    """
    if not figures:
        empty = np.zeros((0, num_sources))
        return np.zeros(0, dtype=np.int64), empty, empty
    steps = np.asarray([_get(f, "step") for f in figures], dtype=np.int64)
    key = "source_documents" if by == "documents" else "source_tokens"
    amounts = _padded([_get(f, key) for f in figures], num_sources)
    target = _padded([_get(f, "target") for f in figures], num_sources)
    cum = np.cumsum(np.vstack([np.zeros((1, num_sources)), amounts]), axis=0)
    lo = np.maximum(np.arange(len(figures)) + 1 - window, 0)
    sums = cum[1:] - cum[lo]
    totals = sums.sum(axis=1, keepdims=True)
    realised = np.divide(sums, totals, out=np.zeros_like(sums), where=totals > 0)
    return steps, target, realised


def _padded(rows: Sequence[Any], width: int) -> np.ndarray:
    """Per-source rows as one array ``(len(rows), width)``: a step drawn before a source
    joined has no entry for it (zero), and one in flight while it joined has not been counted
    yet, so the widths differ."""
    out = np.zeros((len(rows), width), dtype=np.float64)
    for i, row in enumerate(rows):
        values = np.asarray(row, dtype=np.float64)[:width]
        out[i, : len(values)] = values
    return out


def _get(figure: Any, name: str) -> Any:
    return figure[name] if isinstance(figure, Mapping) else getattr(figure, name)

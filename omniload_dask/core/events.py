"""What happens to the data plane: the events its adapter hands in, and the job's failure.

The adapter (the scheduler plugin, or :class:`~omniload_dask.testing.InlineDataPlane`) turns
what it hears into one of these small, frozen events and hands it to
:meth:`Coordinator.handle <omniload_dask.core.coordinator.Coordinator.handle>`, which returns
the actions the event calls for at once::

    ReadReported("omniload-read-r1-0-0-3", lengths, skipped=0)   the cursor may move on
    ConstructionDone(seconds=0.04, batches=2)                    cost meters only
    WorkersChanged(workers=4, read_slots=8)                      read quotas
    StepsRequested(ranks=(0, 1), start=7, count=2)               -> Release of blocks fetched
    TaskFailed("omniload-batch-r1-7-0", "MemoryError: ...")      the job fails (Failure)
    JobFailed("job stopped", Cause.STOPPED)                      the job fails (Failure)

Live changes (weights, sources) are not events: they are checked against the stream and
answer with the step they take effect at (a weight change with :class:`Scheduled`).

The job's failure is state, not a string any module may write: the first :class:`Failure`
stays (later ones would only describe what the first one caused), every draw stops there, and
feeders get its message.

Pure: no I/O and no Dask.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from omniload_dask.batching.labels import Holes

__all__ = [
    "Cause",
    "ConstructionDone",
    "Event",
    "Failure",
    "JobFailed",
    "ReadReported",
    "Scheduled",
    "StepsRequested",
    "TaskFailed",
    "WorkersChanged",
]


class Cause(enum.Enum):
    """Where a job's failure came from."""

    TASK = "task"  # a read or construction task failed for good (after Dask's retries)
    DATA_PLANE = "data plane"  # the data plane refused to go on (a source ran dry, bad data)
    ADAPTER = "adapter"  # carrying out the actions failed (an error, or a bug in the adapter)
    CONNECTION = "connection"  # the adapter lost its cluster and could not connect again
    STOPPED = "stopped"  # the job was stopped


@dataclass(frozen=True)
class Failure:
    """Why the job stopped: the message feeders see, and where it came from."""

    message: str
    cause: Cause


@dataclass(frozen=True)
class ReadReported:
    """A read task finished: its records' token counts (file order) and skipped count.

    Image sources also report each record's patches (sum, and sum of squares over its images)
    for the encoder cost. Sources whose records have tokens that are not targets (chat, images)
    report them (``holes``), so that the dealer counts each step's loss tokens exactly.
    ``seconds`` (the task's compute time) and ``records`` (read, bad
    ones included) feed the cost meters that size reads; they never change the stream.
    """

    key: str
    lengths: np.ndarray
    skipped: int
    seconds: float | None = None
    records: int | None = None
    patches: np.ndarray | None = None
    patches_sq: np.ndarray | None = None
    filtered: int = 0  # records the source's filter or transform dropped
    holes: Holes | None = None
    digest: int | None = None  # CRC of its tokens, where the source runs user code (.rereads)


@dataclass(frozen=True)
class ConstructionDone:
    """A block construction of ``batches`` group batches took ``seconds`` of compute."""

    seconds: float
    batches: int = 1


@dataclass(frozen=True)
class WorkersChanged:
    """The cluster now has ``workers`` workers with ``read_slots`` read slots in all (their
    ``omniload-read`` resources, else their threads): reads it runs at once."""

    workers: int
    read_slots: int


@dataclass(frozen=True)
class StepsRequested:
    """``ranks`` (one rank, or those one fetching agent serves) have fetched every step below
    ``start`` and ask for ``count`` more; ``now`` is the adapter's clock (for monitoring)."""

    ranks: int | Sequence[int]
    start: int
    count: int
    now: float = 0.0


@dataclass(frozen=True)
class TaskFailed:
    """A task failed for good: the job fails with ``message`` if the task is one of its own."""

    key: str
    message: str


@dataclass(frozen=True)
class JobFailed:
    """The adapter must stop the job (it was stopped, or lost its cluster, or failed)."""

    message: str
    cause: Cause


Event = ReadReported | ConstructionDone | WorkersChanged | StepsRequested | TaskFailed | JobFailed


@dataclass(frozen=True)
class Scheduled:
    """A weight change accepted: the step it takes effect at, and the weights as checked
    (those the log holds, and a replay sets)."""

    step: int
    weights: dict[str, float]

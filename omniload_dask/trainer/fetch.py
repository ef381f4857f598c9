"""One round trip of a feeder: ask the data plane for steps, then fetch them from the workers.

::

    ask_for_steps(client, job, rank, start=40, count=2, report)
        -> {"keys": [key of step 40, key of step 41], "who_has": {key: [worker, ...]},
            "end": None}                 (the keys in memory now, in step order; long-polls)
    gather_batches(client, reply)
        -> [batch of step 40, batch of step 41]   (straight from the workers; stops before
                                                    the first key a worker no longer had)

Asking also tells the data plane that the rank has fetched every step below ``start`` (it
holds each batch until every rank of its group has), and carries the rank's wait figures for
monitoring (:func:`wait_report`).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any

import numpy as np

from omniload_dask.batching.formats import GroupBatch
from omniload_dask.cluster import internals as _dask
from omniload_dask.errors import MissingJobError, OmniloadError

__all__ = [
    "LOST_RETRY",
    "POLL_TIMEOUT",
    "ask_for_steps",
    "gather_batches",
    "retryable",
    "wait_report",
]

POLL_TIMEOUT = 2.0  # seconds the data plane holds a request that nothing is ready for
LOST_RETRY = 0.05  # seconds before asking again for a batch whose worker left


def ask_for_steps(
    client: Any, job: str, rank: int, start: int, count: int, report: dict[str, Any]
) -> dict[str, Any]:
    """The data plane's reply: which of the steps ``start..start+count-1`` are ready, where.

    Raises MissingJobError when the scheduler has no data plane (yet): e.g. one just restarted.
    """
    reply = _dask.call(
        client,
        "batches",
        job=job,
        rank=rank,
        start=start,
        count=count,
        timeout=POLL_TIMEOUT,
        report=report,
    )
    if reply is None:
        raise MissingJobError(f"the scheduler has no omniload data plane for job {job!r}")
    return dict(reply)


def gather_batches(client: Any, reply: dict[str, Any]) -> list[GroupBatch]:
    """The batches of ``reply``'s keys, from the workers holding them, in step order.

    Stops at the first key lost since the reply (its worker left); when that is the first one,
    sleeps a moment so that the next ask finds it recomputed or its standby copy.
    """
    keys = reply["keys"]
    if not keys:
        return []
    data = _dask.fetch_from_workers(client, reply["who_has"])
    got = []
    for key in keys:
        if key not in data:
            break
        got.append(data[key])
    if not got:
        # Its worker left after the reply: the data plane recomputes the batch (or finds its
        # standby copy) once the scheduler notices; ask again after a moment.
        time.sleep(LOST_RETRY)
    return got


def wait_report(waits: deque[float], buffered: int, prefetch: int) -> dict[str, Any]:
    """A rank's figures for the data plane's monitoring (see ``FeederReport``): the p50/p99 of
    its recent ``waits`` for a micro-batch, and the steps it holds ahead."""
    recent = np.asarray(waits.copy(), dtype=np.float64)
    p50, p99 = np.percentile(recent, [50, 99]).tolist() if len(recent) else (None, None)
    return {
        "wait_p50": p50,
        "wait_p99": p99,
        "buffered": buffered,
        "prefetch": prefetch,
        "samples": len(recent),
    }


def retryable(exc: BaseException) -> bool:
    """Lost connections and a job not (yet) restarted are retried; job failures are not."""
    if isinstance(exc, MissingJobError):
        return True
    if isinstance(exc, OmniloadError):
        return False
    return isinstance(exc, (OSError, TimeoutError, asyncio.TimeoutError)) or (
        type(exc).__name__ in ("CommClosedError", "CancelledError", "FutureCancelledError")
    )

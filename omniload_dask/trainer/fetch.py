"""One round trip of a fetching agent: ask the data plane for steps, fetch their parts.

An agent fetches for one rank (a plain feeder), for a model-parallel group (its broadcasting
rank) or for a node's ranks (the node agent). It names the ranks it serves and the parts they
need, ``(DP group, cp rank)`` each::

    fetch_steps(link, job, ranks=[8..15], needs=[(1, 0)], start=40, count=4, report)
        -> (reply, batches)
    reply:   {"parts": [[[block key, part]], ...],      one entry per step ready (in order),
              "who_has": {block key: [worker, ...]},    one ref per need
              "end": None}                             (long-polls until one step is ready)
    batches: [[batch of step 40], [batch of step 41], ...]   straight from the workers;
             stops before the first step a worker no longer had

Both calls run as one coroutine on the links' event loop: :func:`afetch_steps` for a caller
on that loop (a feeder's prefetching), :func:`fetch_steps` from another thread (one hand-off
to the loop and back per round trip).

Asking also tells the data plane that the agent's ranks have fetched every step below
``start`` (it holds each block until every rank of its groups has), and carries the agent's
wait figures for monitoring (:func:`wait_report`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from omniload_dask.batching.formats import GroupBatch
from omniload_dask.errors import MissingJobError, OmniloadError
from omniload_dask.observe.formatting import held_back_text
from omniload_dask.trainer.link import CALL_SLACK, FETCH_TIMEOUT, Link

__all__ = [
    "HELD_BACK_REPEAT",
    "HELD_BACK_WARN",
    "LOST_RETRY",
    "POLL_TIMEOUT",
    "ROUND_TRIP_TIMEOUT",
    "StallWatch",
    "afetch_steps",
    "fetch_steps",
    "retryable",
    "wait_report",
]

POLL_TIMEOUT = 2.0  # seconds the data plane holds a request that nothing is ready for
ROUND_TRIP_TIMEOUT = POLL_TIMEOUT + CALL_SLACK + FETCH_TIMEOUT  # seconds, then retried
LOST_RETRY = 0.05  # seconds before asking again for a batch whose worker left
HELD_BACK_WARN = 30.0  # seconds without a step, held back by other ranks, before a warning
HELD_BACK_REPEAT = 60.0  # seconds between repeated warnings

logger = logging.getLogger(__name__)


def fetch_steps(
    link: Link,
    job: str,
    ranks: Sequence[int],
    needs: Sequence[tuple[int, int]],
    start: int,
    count: int,
    report: dict[str, Any],
    ahead: int = 0,
) -> tuple[dict[str, Any], list[list[GroupBatch]]]:
    """One round trip: the data plane's reply for the steps ``start..start+count-1`` and, per
    step ready, the batch of each need, straight from the workers holding them.

    Both calls run as one coroutine on the links' loop, so the calling thread hands off to
    the loop once per round trip, not once per call.
    ``ahead`` more steps are asked for but not taken: the data plane then plans and builds
    them before the agent's next request (which comes ``ahead`` steps later, see
    :mod:`.prefetch`), so that one finds all its steps ready.
    The batches stop at the first step with a part lost since the reply (its worker left);
    when that is the first one, it waits a moment so that the next ask finds it rebuilt or
    its standby copy.
    Raises MissingJobError when the scheduler has no data plane (yet): e.g. one just restarted.
    """
    coro = _fetch_steps(link, job, ranks, needs, start, count, report, ahead)
    reply, got = link.run(coro, ROUND_TRIP_TIMEOUT)
    return reply, got


async def afetch_steps(
    link: Link,
    job: str,
    ranks: Sequence[int],
    needs: Sequence[tuple[int, int]],
    start: int,
    count: int,
    report: dict[str, Any],
    ahead: int = 0,
) -> tuple[dict[str, Any], list[list[GroupBatch]]]:
    """:func:`fetch_steps` as a coroutine on the links' loop (``Link.loop``), for a caller
    that runs there itself (:class:`~.prefetch.Prefetcher` with a ``loop``): no hand-off."""
    coro = _fetch_steps(link, job, ranks, needs, start, count, report, ahead)
    return await asyncio.wait_for(coro, ROUND_TRIP_TIMEOUT)


async def _fetch_steps(
    link: Link,
    job: str,
    ranks: Sequence[int],
    needs: Sequence[tuple[int, int]],
    start: int,
    count: int,
    report: dict[str, Any],
    ahead: int,
) -> tuple[dict[str, Any], list[list[GroupBatch]]]:
    request = dict(
        job=job,
        ranks=[int(r) for r in ranks],
        parts=[[int(g), int(c)] for g, c in needs],
        start=start,
        count=count + ahead,
        timeout=POLL_TIMEOUT,
        report=report,
    )
    reply = await link.acall("batches", request)
    if reply is None:
        raise MissingJobError(f"the scheduler has no omniload data plane for job {job!r}")
    reply = dict(reply)
    reply["parts"] = reply["parts"][:count]
    steps = [[(str(k), int(p)) for k, p in refs] for refs in reply["parts"]]
    if not steps:
        return reply, []
    data = await link.afetch([ref for refs in steps for ref in refs], reply["who_has"])
    got = []
    for refs in steps:
        if not all(ref in data for ref in refs):
            break
        got.append([data[ref] for ref in refs])
    if not got:
        # Its worker left after the reply: the data plane recomputes the block (or finds its
        # standby copy) once the scheduler notices; ask again after a moment.
        await asyncio.sleep(LOST_RETRY)
    return reply, got


class StallWatch:
    """Warns when an agent has waited long for one step because other ranks never fetch.

    The data plane draws at most a window of steps past the slowest rank, and says in a reply
    that found nothing ready which ranks hold it there (``held_back``). A rank whose feeder
    never started stops the whole job at that step; after ``HELD_BACK_WARN`` seconds without
    a step the agent logs a warning naming those ranks (again every ``HELD_BACK_REPEAT`` s),
    so the job does not stop silently. ``last`` keeps the latest ``held_back`` seen.
    """

    def __init__(self, who: str) -> None:
        self.who = who
        self.last: dict[str, Any] | None = None
        self.warnings = 0
        self._step: int | None = None
        self._since = 0.0
        self._warned = float("-inf")

    def note(self, start: int, reply: dict[str, Any]) -> None:
        """Look at the reply to a request for the steps from ``start`` on."""
        now = time.monotonic()
        if reply.get("parts"):
            self._step, self.last = None, None
            return
        if self._step != start:
            self._step, self._since, self._warned = start, now, float("-inf")
        held = reply.get("held_back")
        self.last = held
        waited = now - self._since
        if held and waited >= HELD_BACK_WARN and now - self._warned >= HELD_BACK_REPEAT:
            self._warned = now
            self.warnings += 1
            logger.warning(
                "omniload %s: no batch for step %d for %.0f s: the job is %s. Every rank of "
                "the layout needs a running Feeder (or a fanout agent serving it).",
                self.who,
                start,
                waited,
                held_back_text(held),
            )


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

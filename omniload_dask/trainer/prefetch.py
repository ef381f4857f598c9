"""Keeps the next steps fetched ahead of the one who consumes them.

A :class:`Prefetcher` wraps a ``fetch(start, count)`` round trip (to the data plane and the
workers, or to a node agent) that returns the items of the steps ``start, start + 1, ...``
that are ready (maybe none) and where the stream ends, if known. It refills with hysteresis::

    prefetch 8, refill 4:   buffered 8 7 6 5 4 -> ask for 4 more -> 8 7 6 ...
                            (one round trip per 4 steps; prefetch 2 asks every step)

It runs where its round trip runs: a plain ``fetch`` in a thread of its own; a coroutine
``fetch`` (a fetching agent's :mod:`.fetch` round trip) as a task on the event loop given as
``loop`` (the links' loop), so that a refill costs one wake-up of that loop (when the consumer
moves on and a refill is due) and one of the consumer (when the items are in), with no thread
in between::

    consumer      done(4) --call_soon_threadsafe--> loop: ask + fetch steps 9.. --notify--> take(5)

Lost connections and a job not (yet) restarted are retried with backoff for
``reconnect_timeout`` seconds (the scheduler may be restarting); other errors reach the
consumer at its next :meth:`Prefetcher.take`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import random
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from omniload_dask.errors import JobError, OmniloadError
from omniload_dask.trainer.fetch import retryable

__all__ = ["AsyncFetch", "Fetch", "Prefetcher"]

# fetch(start, count) -> (items of the ready steps from start on, the stream's end or None)
Fetch = Callable[[int, int], tuple[list[Any], int | None]]
# the same as a coroutine, run on the Prefetcher's ``loop``
AsyncFetch = Callable[[int, int], Awaitable[tuple[list[Any], int | None]]]


MAX_BACKOFF = 1.0  # seconds between retries at most: a restarted scheduler is found soon


def _backoff(attempt: int) -> float:
    """Seconds before retry ``attempt`` (1, 2, ...): doubling from 0.1 s up to MAX_BACKOFF,
    with jitter so that many ranks do not knock on a new scheduler at the same instant."""
    return min(MAX_BACKOFF, 0.05 * 2 ** min(attempt, 6)) * random.uniform(0.5, 1.0)


class Prefetcher:
    """Keeps up to ``prefetch`` steps' items fetched ahead of the consumer's step.

    ``refill`` steps are consumed before it asks again (default: half the prefetch). With
    ``loop`` (a running event loop in another thread), ``fetch`` is a coroutine function
    (:data:`AsyncFetch`) and the prefetching runs as a task there; without, ``fetch`` is
    plain (:data:`Fetch`) and runs in a thread named ``name``.
    """

    def __init__(
        self,
        fetch: Fetch | AsyncFetch,
        start: int,
        prefetch: int,
        *,
        refill: int | None = None,
        max_steps: int | None = None,
        reconnect_timeout: float = 300.0,
        name: str = "omniload-prefetch",
        describe: str = "fetching",
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        if prefetch < 1:
            raise JobError(f"prefetch must be >= 1, got {prefetch}")
        self.prefetch = prefetch
        self.refill = refill if refill is not None else max(1, prefetch // 2)
        self.max_steps = max_steps
        self.reconnect_timeout = reconnect_timeout
        self.reconnects = 0
        self.calls = 0
        self.end: int | None = None  # the stream ends before this step
        self._fetch = fetch
        self._name = name
        self._describe = describe
        self._lock = threading.Condition()
        self._buffer: deque[tuple[int, Any]] = deque()
        self._error: BaseException | None = None
        self._step = start  # the consumer's step
        self._fetch_from = start
        self._generation = 0
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._loop = loop
        self._task: concurrent.futures.Future[None] | None = None
        self._wake: asyncio.Event | None = None  # the task's, set from the consumer's thread
        self._idle = False  # the task waits for a refill to be due
        self._failing_since: float | None = None  # since the first failed round trip in a row
        self._attempt = 0  # retries with backoff since the last good round trip

    def buffered(self) -> int:
        """Steps fetched ahead of the consumer's step."""
        return max(0, self._fetch_from - self._step)

    def take(self, step: int) -> Any:
        """The item of ``step`` (waits for it); StopIteration where the stream ends."""
        self._ensure_started()
        with self._lock:
            if step != self._step:
                self._reset_locked(step)
            while True:
                if self._buffer and self._buffer[0][0] == step:
                    return self._buffer[0][1]
                if self._error is not None:
                    raise self._error
                if self.end is not None and step >= self.end:
                    raise StopIteration
                self._lock.wait(0.5)

    def done(self, step: int) -> None:
        """The consumer is through ``step``: its item may go, the consumer moves on."""
        with self._lock:
            while self._buffer and self._buffer[0][0] <= step:
                self._buffer.popleft()
            self._step = max(self._step, step + 1)
            # The task on the loop waits for a refill to be due and nothing else (or a stop):
            # woken at every step it would cost each rank a hand-off to the loop, a wake-up
            # and a new timed wait there per step, to find nothing due.
            self._notify_locked(wake_loop=self._due_locked() is not None)

    def reset(self, step: int) -> None:
        """Continue from ``step`` (items fetched so far are dropped)."""
        with self._lock:
            self._reset_locked(step)

    def close(self) -> None:
        """Stop prefetching (it ends within one round trip)."""
        with self._lock:
            self._stopped = True
            self._notify_locked()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._task is not None and not _on_loop(self._loop):
            try:
                self._task.result(timeout=10)
            except concurrent.futures.TimeoutError:
                self._task.cancel()
            except BaseException:  # its error went to the consumer already
                pass

    # ------------------------------------------------------------------ shared by both ways
    def _reset_locked(self, step: int) -> None:
        self._generation += 1
        self._buffer.clear()
        self._error = None
        self._step = self._fetch_from = step
        self._notify_locked()

    def _notify_locked(self, wake_loop: bool = True) -> None:
        """Wake whoever waits: the consumer, the thread, or (``wake_loop``) the task on the
        loop."""
        self._lock.notify_all()
        if wake_loop and self._idle and self._wake is not None and self._loop is not None:
            self._idle = False
            with contextlib.suppress(RuntimeError):  # the loop closed (the process exits)
                self._loop.call_soon_threadsafe(self._wake.set)

    def _ensure_started(self) -> None:
        """Start on first use (not before: one never used asks for nothing)."""
        if self._loop is not None:
            if self._task is None:
                self._task = asyncio.run_coroutine_threadsafe(self._run_on_loop(), self._loop)
                self._task.add_done_callback(self._task_ended)
        elif self._thread is None:
            self._thread = threading.Thread(target=self._run_thread, daemon=True, name=self._name)
            self._thread.start()

    def _due_locked(self) -> tuple[int, int, int] | None:
        """``(start, count, generation)`` of the refill due now, or None."""
        if self._fetch_from - self._step > self.prefetch - self.refill:
            return None
        start = self._fetch_from
        count = self.prefetch - (start - self._step)
        if self.max_steps is not None:
            count = min(count, self.max_steps - start)
        if self.end is not None:
            count = min(count, self.end - start)
        return (start, count, self._generation) if count > 0 else None

    def _failed(self, exc: BaseException, start: int) -> float | None:
        """After a failed round trip: seconds to wait before the next one, None to stop."""
        now = time.monotonic()
        self._failing_since = self._failing_since or now
        if retryable(exc) and now - self._failing_since < self.reconnect_timeout:
            self.reconnects += 1
            self._attempt += 1
            return _backoff(self._attempt)
        with self._lock:
            self._error = (
                exc
                if isinstance(exc, OmniloadError)
                else JobError(f"{self._describe} step {start} failed: {type(exc).__name__}: {exc}")
            )
            self._lock.notify_all()
            if isinstance(exc, OmniloadError):
                self._stopped = True
                return None
        return 1.0

    def _got(self, start: int, generation: int, items: list[Any], end: int | None) -> None:
        """After a good round trip: buffer its items (unless reset meanwhile); wake the
        consumer."""
        self._failing_since, self._attempt = None, 0
        with self._lock:
            if end is not None:
                self.end = end
            if generation != self._generation:
                return  # reset while fetching
            for offset, item in enumerate(items):
                self._buffer.append((start + offset, item))
            self._fetch_from = start + len(items)
            self._lock.notify_all()

    # ------------------------------------------------------------------ in a thread
    def _want(self) -> tuple[int, int, int] | None:
        """Wait until a refill is due; ``(start, count, generation)``, None once stopped."""
        with self._lock:
            while not self._stopped:
                if (want := self._due_locked()) is not None:
                    return want
                self._lock.wait(0.5)
            return None

    def _run_thread(self) -> None:
        fetch: Any = self._fetch
        while (want := self._want()) is not None:
            start, count, generation = want
            try:
                self.calls += 1
                items, end = fetch(start, count)
            except BaseException as exc:  # retried while the scheduler may come back, else raised
                if (pause := self._failed(exc, start)) is None:
                    return
                time.sleep(pause)
                continue
            self._got(start, generation, items, end)

    # ------------------------------------------------------------------ on the event loop
    async def _next_due(self) -> tuple[int, int, int] | None:
        """The refill due (waits for the consumer to move on); None once stopped."""
        assert self._wake is not None
        while True:
            with self._lock:
                if self._stopped:
                    return None
                if (want := self._due_locked()) is not None:
                    return want
                self._wake.clear()
                self._idle = True  # the consumer's next done() sets _wake
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 0.5)

    async def _run_on_loop(self) -> None:
        fetch: Any = self._fetch
        self._wake = asyncio.Event()
        while (want := await self._next_due()) is not None:
            start, count, generation = want
            try:
                self.calls += 1
                items, end = await fetch(start, count)
            except BaseException as exc:  # retried while the scheduler may come back, else raised
                if isinstance(exc, asyncio.CancelledError) and _cancelled():
                    raise  # this task is cancelled (close), not a call inside it
                if (pause := self._failed(exc, start)) is None:
                    return
                await asyncio.sleep(pause)
                continue
            self._got(start, generation, items, end)

    def _task_ended(self, task: concurrent.futures.Future[None]) -> None:
        """A task that ended by itself with an unexpected error: the consumer gets it."""
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        with self._lock:
            if self._error is None and not self._stopped:
                self._error = JobError(f"{self._describe} stopped: {type(exc).__name__}: {exc}")
                self._lock.notify_all()


def _cancelled() -> bool:
    """Whether the running task is being cancelled."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _on_loop(loop: asyncio.AbstractEventLoop | None) -> bool:
    """Whether this thread runs ``loop`` (then nothing may block waiting for it)."""
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False

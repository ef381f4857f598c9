"""A background thread that keeps the next steps fetched ahead of the one who consumes them.

A :class:`Prefetcher` wraps a ``fetch(start, count)`` round trip (to the data plane and the
workers, or to a node agent) that returns the items of the steps ``start, start + 1, ...``
that are ready (maybe none) and where the stream ends, if known. It refills with hysteresis::

    prefetch 8, refill 4:   buffered 8 7 6 5 4 -> ask for 4 more -> 8 7 6 ...
                            (one round trip per 4 steps; prefetch 2 asks every step)

Lost connections and a job not (yet) restarted are retried with backoff for
``reconnect_timeout`` seconds (the scheduler may be restarting); other errors reach the
consumer at its next :meth:`Prefetcher.take`.
"""

from __future__ import annotations

import random
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from omniload_dask.errors import JobError, OmniloadError
from omniload_dask.trainer.fetch import retryable

__all__ = ["Fetch", "Prefetcher"]

# fetch(start, count) -> (items of the ready steps from start on, the stream's end or None)
Fetch = Callable[[int, int], tuple[list[Any], int | None]]


MAX_BACKOFF = 1.0  # seconds between retries at most: a restarted scheduler is found soon


def _backoff(attempt: int) -> float:
    """Seconds before retry ``attempt`` (1, 2, ...): doubling from 0.1 s up to MAX_BACKOFF,
    with jitter so that many ranks do not knock on a new scheduler at the same instant."""
    return min(MAX_BACKOFF, 0.05 * 2 ** min(attempt, 6)) * random.uniform(0.5, 1.0)


class Prefetcher:
    """Keeps up to ``prefetch`` steps' items fetched ahead of the consumer's step.

    ``refill`` steps are consumed before it asks again (default: half the prefetch).
    """

    def __init__(
        self,
        fetch: Fetch,
        start: int,
        prefetch: int,
        *,
        refill: int | None = None,
        max_steps: int | None = None,
        reconnect_timeout: float = 300.0,
        name: str = "omniload-prefetch",
        describe: str = "fetching",
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

    def buffered(self) -> int:
        """Steps fetched ahead of the consumer's step."""
        return max(0, self._fetch_from - self._step)

    def take(self, step: int) -> Any:
        """The item of ``step`` (waits for it); StopIteration where the stream ends."""
        self._ensure_thread()
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
            self._lock.notify_all()

    def reset(self, step: int) -> None:
        """Continue from ``step`` (items fetched so far are dropped)."""
        with self._lock:
            self._reset_locked(step)

    def close(self) -> None:
        """Stop the thread (it ends within one round trip)."""
        with self._lock:
            self._stopped = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)

    # ------------------------------------------------------------------ the thread
    def _reset_locked(self, step: int) -> None:
        self._generation += 1
        self._buffer.clear()
        self._error = None
        self._step = self._fetch_from = step
        self._lock.notify_all()

    def _ensure_thread(self) -> None:
        """Start the thread on first use (not before: one never used asks for nothing)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, daemon=True, name=self._name)
            self._thread.start()

    def _want(self) -> tuple[int, int, int] | None:
        """Wait until a refill is due; ``(start, count, generation)``, None once stopped."""
        with self._lock:
            while True:
                low = self.prefetch - self.refill
                while not self._stopped and self._fetch_from - self._step > low:
                    self._lock.wait(0.5)
                if self._stopped:
                    return None
                start = self._fetch_from
                count = self.prefetch - (start - self._step)
                if self.max_steps is not None:
                    count = min(count, self.max_steps - start)
                if self.end is not None:
                    count = min(count, self.end - start)
                if count > 0:
                    return start, count, self._generation
                self._lock.wait(0.5)

    def _loop(self) -> None:
        failing_since: float | None = None
        attempt = 0
        while (want := self._want()) is not None:
            start, count, generation = want
            try:
                self.calls += 1
                items, end = self._fetch(start, count)
                failing_since, attempt = None, 0
            except BaseException as exc:  # retried while the scheduler may come back, else raised
                now = time.monotonic()
                failing_since = failing_since or now
                if retryable(exc) and now - failing_since < self.reconnect_timeout:
                    self.reconnects += 1
                    attempt += 1
                    time.sleep(_backoff(attempt))
                    continue
                with self._lock:
                    self._error = (
                        exc
                        if isinstance(exc, OmniloadError)
                        else JobError(
                            f"{self._describe} step {start} failed: {type(exc).__name__}: {exc}"
                        )
                    )
                    self._lock.notify_all()
                    if isinstance(exc, OmniloadError):
                        self._stopped = True
                        return
                time.sleep(1.0)
                continue
            with self._lock:
                if end is not None:
                    self.end = end
                if generation != self._generation:
                    continue  # reset while fetching
                for offset, item in enumerate(items):
                    self._buffer.append((start + offset, item))
                self._fetch_from = start + len(items)
                self._lock.notify_all()

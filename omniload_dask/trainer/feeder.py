"""The trainer side: a Feeder per trainer rank yields its micro-batches, prefetched.

A background thread asks the data plane for the keys of the next ``prefetch`` steps (one RPC
for several steps, which also reports how far this rank has fetched), gathers those batches
straight from the workers that built them (one round trip: :mod:`.fetch`), and keeps them in a
small local buffer; iterating only takes from that buffer. Each item is one micro-batch in the
packed layout (see :mod:`omniload_dask.batching.formats`), as torch tensors when torch is
installed, else numpy arrays::

    feeder = job.feeder(dp_rank=0)
    for mb in feeder:
        loss = model(mb["input_ids"], position_ids=mb["position_ids"], ...)
        if mb["micro_step"] == mb["num_micro_steps"] - 1:
            optimizer.step()

``state_dict()`` is two numbers (step and micro-step), because the data plane can rebuild any
recent step exactly; ``load_state_dict()`` resumes there.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import numpy as np
from distributed import Client

from omniload_dask.batching.formats import GroupBatch, expand
from omniload_dask.cluster import internals as _dask
from omniload_dask.errors import JobError, OmniloadError
from omniload_dask.plan import parse_plan
from omniload_dask.trainer.fetch import ask_for_steps, gather_batches, retryable, wait_report
from omniload_dask.trainer.ranks import resolve_rank, torch_available

__all__ = ["Feeder", "resolve_rank"]

STATE_VERSION = 1
REPORT_WAITS = 1024  # recent waits behind the p50/p99 a feeder reports to the data plane


class Feeder:
    """Iterator over one trainer rank's micro-batches of a running job.

    Give the rank as ``rank`` (global), as ``dp_rank`` (+ ``tp_rank``/``pp_rank``/``cp_rank``),
    or neither, to read it from torch.distributed or the ``RANK``/``WORLD_SIZE`` environment.
    """

    def __init__(
        self,
        job: str,
        *,
        client: Client | None = None,
        address: str | None = None,
        rank: int | None = None,
        dp_rank: int | None = None,
        dp_size: int | None = None,
        tp_rank: int = 0,
        pp_rank: int = 0,
        cp_rank: int = 0,
        prefetch: int | None = None,
        output: str | None = None,
        max_steps: int | None = None,
        start_step: int | None = None,
        reconnect_timeout: float = 300.0,
    ) -> None:
        if client is None:
            if address is None:
                raise JobError("Feeder: give a client or a scheduler address")
            client = Client(address, set_as_default=False)
            self._owns_client = True
        else:
            self._owns_client = False
            address = _dask.scheduler_address(client)
        self.client = client
        self._address = address
        self.reconnect_timeout = reconnect_timeout
        self.reconnects = 0
        self.job = job
        info = _dask.call(client, "info", job=job)
        self.plan = parse_plan(info["plan"])
        if start_step is None:  # a resumed job starts where it was resumed
            start_step = int(info.get("start_step") or 0)
        self.source_names: list[str] = list(info["sources"])
        self.layout = self.plan.layout
        self.rank = resolve_rank(
            self.layout,
            rank=rank,
            dp_rank=dp_rank,
            dp_size=dp_size,
            tp_rank=tp_rank,
            pp_rank=pp_rank,
            cp_rank=cp_rank,
        )
        coords = self.layout.coords(self.rank)
        self.dp_rank, self.cp_rank = coords["dp"], coords["cp"]
        self.prefetch = prefetch or self.plan.loader.prefetch
        if self.prefetch < 1:
            raise JobError(f"Feeder: prefetch must be >= 1, got {self.prefetch}")
        self.output = output or ("torch" if torch_available() else "numpy")
        if self.output not in ("torch", "numpy"):
            raise JobError(f"Feeder: output must be 'torch' or 'numpy', got {self.output!r}")
        self.max_steps = max_steps
        self._end: int | None = None  # the job's stream ends before this step
        self._lock = threading.Condition()
        self._buffer: deque[tuple[int, GroupBatch]] = deque()
        self._error: BaseException | None = None
        self._step = start_step
        self._micro = 0
        self._fetch_from = start_step
        self._generation = 0
        self._stopped = False
        self._thread: threading.Thread | None = None
        self.waits: deque[float] = deque(maxlen=100_000)
        self._recent_waits: deque[float] = deque(maxlen=REPORT_WAITS)
        self.micro_batches = 0
        self.tokens = 0

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self

    def __next__(self) -> dict[str, Any]:
        if self.max_steps is not None and self._step >= self.max_steps:
            raise StopIteration
        self._ensure_thread()
        t0 = time.perf_counter()
        with self._lock:
            while True:
                if self._buffer and self._buffer[0][0] == self._step:
                    batch = self._buffer[0][1]
                    break
                if self._error is not None:
                    raise self._error
                if self._end is not None and self._step >= self._end:
                    raise StopIteration
                self._lock.wait(0.5)
        waited = time.perf_counter() - t0
        self.waits.append(waited)
        self._recent_waits.append(waited)
        mb = batch.micro_batches[self._micro]
        self._micro += 1
        if self._micro >= len(batch.micro_batches):
            with self._lock:
                self._buffer.popleft()
                self._step += 1
                self._micro = 0
                self._lock.notify_all()
        self.micro_batches += 1
        self.tokens += int(mb["num_tokens"])
        return self._convert(mb)

    def steps(self) -> Iterator[list[dict[str, Any]]]:
        """Iterate whole steps: the list of this rank's micro-batches of each step."""
        while True:
            try:
                first = next(self)
            except StopIteration:
                return
            out = [first]
            while out[-1]["micro_step"] < out[-1]["num_micro_steps"] - 1:
                out.append(next(self))
            yield out

    def as_torch_dataset(self) -> Any:
        """This feeder as a ``torch.utils.data.IterableDataset`` (use ``batch_size=None``)."""
        from omniload_dask.trainer.torch_dataset import FeederDataset

        return FeederDataset(self)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Where this rank is: the next step and micro-step it will yield."""
        return {
            "version": STATE_VERSION,
            "job": self.job,
            "rank": self.rank,
            "step": self._step,
            "micro_step": self._micro,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state``'s step and micro-step (batches already fetched are dropped)."""
        for key in ("version", "step", "micro_step"):
            if key not in state:
                raise JobError(f"Feeder.load_state_dict: state has no {key!r}")
        if state["version"] != STATE_VERSION:
            raise JobError(f"Feeder.load_state_dict: unknown state version {state['version']!r}")
        step, micro = int(state["step"]), int(state["micro_step"])
        if step < 0 or micro < 0:
            raise JobError(
                f"Feeder.load_state_dict: step and micro_step must be >= 0, got {step}, {micro}"
            )
        with self._lock:
            self._generation += 1
            self._buffer.clear()
            self._error = None
            self._step, self._micro, self._fetch_from = step, micro, step
            self._lock.notify_all()

    # ------------------------------------------------------------------ figures
    def stats(self) -> dict[str, Any]:
        """This rank's wait times and counts, plus the job's counters (records skipped...)."""
        waits = np.asarray(self.waits, dtype=np.float64)
        job = _dask.call(self.client, "stats", job=self.job)
        return {
            "rank": self.rank,
            "step": self._step,
            "micro_batches": self.micro_batches,
            "tokens": self.tokens,
            "wait_p50_ms": float(np.percentile(waits, 50) * 1e3) if len(waits) else None,
            "wait_p99_ms": float(np.percentile(waits, 99) * 1e3) if len(waits) else None,
            "skipped": {s["name"]: s["skipped"] for s in job["sources"]},
            "job": job,
        }

    def close(self) -> None:
        """Stop fetching (the thread ends within one poll) and close a client of our own."""
        with self._lock:
            self._stopped = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._owns_client:
            self.client.close()

    def __enter__(self) -> Feeder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ fetching
    def _ensure_thread(self) -> None:
        """Start the fetching thread on first use (not in ``__init__``: a feeder made and
        never iterated asks the data plane for nothing)."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._fetch_loop, daemon=True, name=f"omniload-feeder-{self.rank}"
            )
            self._thread.start()

    def _reconnect(self) -> None:
        """Replace an owned client that gave up on a lost scheduler (same address)."""
        if self._owns_client and self.client.status in ("closed", "closing", "failed"):
            with contextlib.suppress(Exception):
                self.client.close()
            with contextlib.suppress(OSError, TimeoutError):
                self.client = Client(self._address, set_as_default=False, timeout=5)

    def _fetch_loop(self) -> None:
        """The fetching thread: keep up to ``prefetch`` steps ahead of the trainer.

        Lost connections and a missing job are retried with backoff for
        ``reconnect_timeout`` seconds (the scheduler may be restarting); a job failure is
        raised to the trainer at its next ``next()``.
        """
        failing_since: float | None = None
        attempt = 0
        while True:
            with self._lock:
                while not self._stopped and self._fetch_from - self._step >= self.prefetch:
                    self._lock.wait(0.5)
                if self._stopped:
                    return
                start, generation = self._fetch_from, self._generation
                count = self.prefetch - (start - self._step)
                if self.max_steps is not None:
                    count = min(count, self.max_steps - start)
                if self._end is not None:
                    count = min(count, self._end - start)
            if count <= 0:
                with self._lock:
                    self._lock.wait(0.5)
                continue
            try:
                got = self._fetch(start, count)
                failing_since, attempt = None, 0
            except BaseException as exc:  # retried while the scheduler may come back, else raised
                now = time.monotonic()
                failing_since = failing_since or now
                if retryable(exc) and now - failing_since < self.reconnect_timeout:
                    self.reconnects += 1
                    attempt += 1
                    time.sleep(min(5.0, 0.1 * 2 ** min(attempt, 6)))
                    self._reconnect()
                    continue
                with self._lock:
                    self._error = (
                        exc
                        if isinstance(exc, OmniloadError)
                        else JobError(
                            f"rank {self.rank}: fetching step {start} failed: {type(exc).__name__}: "
                            f"{exc}"
                        )
                    )
                    self._lock.notify_all()
                    if isinstance(exc, OmniloadError):
                        self._stopped = True
                        return
                time.sleep(1.0)
                continue
            with self._lock:
                if generation != self._generation:
                    continue  # load_state_dict moved us while fetching
                for offset, batch in enumerate(got):
                    self._buffer.append((start + offset, batch))
                self._fetch_from = start + len(got)
                self._lock.notify_all()

    def _fetch(self, start: int, count: int) -> list[GroupBatch]:
        """One round trip: the ready steps from ``start`` on (possibly none)."""
        report = wait_report(self._recent_waits, max(0, start - self._step), self.prefetch)
        reply = ask_for_steps(self.client, self.job, self.rank, start, count, report)
        if reply.get("end") is not None:
            with self._lock:
                self._end = int(reply["end"])
                self._lock.notify_all()
        return gather_batches(self.client, reply)

    # ------------------------------------------------------------------ output
    def _convert(self, mb: dict[str, Any]) -> dict[str, Any]:
        """A micro-batch as the trainer gets it: full form, source names, torch or numpy."""
        mb = expand(mb)  # the wire form carries neither labels nor position_ids
        sources = mb["doc_source"]
        if len(sources) and int(sources.max()) >= len(self.source_names):  # a source joined
            self.source_names = list(_dask.call(self.client, "info", job=self.job)["sources"])
        return _output(mb, self.source_names, self.output)


def _output(mb: dict[str, Any], source_names: list[str], output: str) -> dict[str, Any]:
    """``mb`` with each document's source name, its arrays as torch tensors for "torch"."""
    out = dict(mb)
    out["doc_source_name"] = [source_names[int(s)] for s in mb["doc_source"]]
    if output == "torch":
        import torch

        for key, value in mb.items():
            if isinstance(value, np.ndarray):
                out[key] = torch.from_numpy(value)
    return out

"""A rank's steps from its node's agent (:mod:`.node`), over a Unix socket and shared memory.

The rank connects to the agent of its node (the node's first rank starts the agent when none
listens), attaches at its start step, and then asks for steps like any fetching agent would,
with hysteresis (:mod:`.prefetch`); each step arrives as the name of a shared-memory segment,
which it copies out (:mod:`.shm`)::

    steps = NodeSupply.for_rank("job", "tcp://scheduler:8786", rank=5, report=...)
    batch = steps.take(12)      # step 12 of rank 5's part, from the agent
    steps.done(12)              # the agent may free step 12 once every rank is past it

A lost agent (it died) is a retried error: the next call connects again, to a new agent if
need be, and attaches again.
"""

from __future__ import annotations

import contextlib
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Client as Connect
from multiprocessing.connection import Connection
from typing import Any

from omniload_dask.errors import JobError
from omniload_dask.trainer.node import (
    AGENT_START_TIMEOUT,
    agent_socket,
    authkey,
    node_ranks_from_env,
)
from omniload_dask.trainer.prefetch import Prefetcher
from omniload_dask.trainer.shm import read_segment

__all__ = ["NodeSupply"]


class NodeSupply:
    """A rank's steps from its node's agent (started by the node's first rank if needed)."""

    def __init__(
        self,
        job: str,
        address: str,
        rank: int,
        node_ranks: Sequence[int],
        start: int | None,
        report: Any,
        *,
        security: Any = None,
        prefetch: int = 8,
        max_steps: int | None = None,
        reconnect_timeout: float = 300.0,
    ) -> None:
        self.rank = rank
        self.path = agent_socket(job, address, node_ranks)
        self._first = rank == min(node_ranks)
        self._spawn = (job, address, list(node_ranks), security, prefetch)
        self._report = report
        self._lock = threading.Lock()
        self._conn: Connection | None = self._connect()
        _, self.job_info, start = self._call(("attach", rank, start))
        self.start = int(start)  # where this rank starts
        self.prefetcher = Prefetcher(
            self._fetch,
            start,
            prefetch,
            max_steps=max_steps,
            reconnect_timeout=reconnect_timeout,
            name=f"omniload-feeder-{rank}",
            describe=f"rank {rank}: fetching from its node agent",
        )

    @classmethod
    def for_rank(
        cls,
        job: str,
        address: str,
        rank: int | None,
        report: Any,
        *,
        node_ranks: Sequence[int] | None = None,
        prefetch: int | None = None,
        start: int | None = None,
        **kwargs: Any,
    ) -> NodeSupply:
        """Steps for global ``rank`` of a node (``node_ranks``, default from the
        environment); prefetch 8 unless given."""
        if rank is None:  # from torch.distributed or $RANK, as resolve_rank does
            from omniload_dask.trainer.ranks import distributed_rank

            rank = distributed_rank()[0]
        if rank is None:
            raise JobError(
                "Feeder: fanout 'node' needs the global rank (rank=..., torch.distributed or RANK)"
            )
        ranks = list(node_ranks) if node_ranks is not None else node_ranks_from_env(int(rank))
        return cls(job, address, int(rank), ranks, start, report, prefetch=prefetch or 8, **kwargs)

    @property
    def calls(self) -> int:
        """Round trips to the agent."""
        return self.prefetcher.calls

    @property
    def reconnects(self) -> int:
        """Round trips to the agent retried."""
        return self.prefetcher.reconnects

    def _connect(self) -> Connection:
        """Connect to the agent; the node's first rank starts it when none listens."""
        deadline = time.monotonic() + AGENT_START_TIMEOUT
        started = False
        while True:
            try:
                return Connect(self.path, family="AF_UNIX", authkey=authkey(self.path))
            except (OSError, EOFError):
                if self._first and not started:
                    self._start_agent()
                    started = True
                if time.monotonic() > deadline:
                    raise JobError(
                        f"rank {self.rank}: no node agent answers at {self.path} after "
                        f"{AGENT_START_TIMEOUT:.0f}s (the node's first rank starts it)"
                    ) from None
                time.sleep(0.1)

    def _start_agent(self) -> None:
        job, address, ranks, security, prefetch = self._spawn
        proc = subprocess.Popen(  # it outlives this rank's pipes: none of them
            [sys.executable, "-m", "omniload_dask.trainer.node"],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        assert proc.stdin is not None
        proc.stdin.write(pickle.dumps((job, address, ranks, self.path, security, prefetch)))
        proc.stdin.close()

    def _call(self, message: tuple[Any, ...]) -> tuple[Any, ...]:
        """One request to the agent; a lost agent is a ConnectionError (retried: the next
        call connects again, and attaches again, to a new agent if need be)."""
        with self._lock:
            if self._conn is None:
                self._conn = self._connect()
                if message[0] == "get":  # a new agent knows nothing of this rank yet
                    self._conn.send(("attach", self.rank, message[2]))
                    self._conn.recv()
            try:
                self._conn.send(message)
                reply: tuple[Any, ...] = self._conn.recv()
            except (OSError, EOFError):
                self._conn.close()
                self._conn = None
                raise ConnectionError(f"rank {self.rank}: lost its node agent") from None
        if reply[0] == "error":
            raise JobError(reply[1])
        return reply

    def _fetch(self, start: int, count: int) -> tuple[list[Any], int | None]:
        report = self._report(self.prefetcher.buffered())
        _, ready, end = self._call(("get", self.rank, start, count, report))
        items = []
        for _, name in ready:
            try:
                items.append(read_segment(name))
            except FileNotFoundError:
                break  # gone meanwhile (the rank moved): asked again
        return items, end

    def take(self, step: int) -> Any:
        """This rank's batch of ``step``."""
        return self.prefetcher.take(step)

    def done(self, step: int) -> None:
        """The rank is through ``step``."""
        self.prefetcher.done(step)

    def reset(self, step: int) -> None:
        """Continue from ``step``."""
        self.prefetcher.reset(step)

    def buffered(self) -> int:
        """Steps held ahead."""
        return self.prefetcher.buffered()

    def info(self) -> dict[str, Any]:
        """The job's info now (from the agent)."""
        return dict(self._call(("info",))[1])

    def close(self) -> None:
        """Stop, and tell the agent this rank is gone."""
        self.prefetcher.close()
        with contextlib.suppress(OSError, JobError):
            self._call(("detach", self.rank))
        if self._conn is not None:
            self._conn.close()

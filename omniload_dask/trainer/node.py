"""A node-local agent: one fetching agent for the trainer ranks of a node, over shared memory.

With ``fanout: node`` the ranks of a node do not connect to the data plane or the workers at
all. One agent process per node does: it asks for the steps of every part its ranks need (one
request for all of them), fetches each part once, writes it into a shared-memory segment
(:mod:`.shm`), and hands the segment's name to each local rank that asks; the rank copies the
batch out. The agent is started by the node's first rank (``python -m
omniload_dask.trainer.node``; the rank side is :mod:`.node_supply`) and talks to its ranks over
a Unix socket::

    rank -> agent   ("attach", rank, start)                -> ("ok", job info)
                    ("get", rank, start, count, report)    -> ("steps", [(step, segment)], end)
                                                              (long-polls; or ("error", text))
                    ("info",) / ("detach", rank)
    agent -> data plane   batches(ranks=attached ranks, parts=their parts, start=fetched...)

A rank's ``get`` from ``start`` says it is done with every step below it; a step's segments
go once every attached rank is past it. A rank behind the agent's buffer (restarted from a
saved state), or with a part the buffer lacks, is served by a fetch of its own. The agent
keeps at most ``prefetch`` steps ahead of its slowest rank, and exits once no rank has been
connected for ``linger`` seconds; a fatal error reaches the ranks as the answer to their
next request.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection, Listener
from typing import Any

from omniload_dask.errors import JobError, OmniloadError
from omniload_dask.trainer.fetch import POLL_TIMEOUT, fetch_steps, retryable
from omniload_dask.trainer.link import Link
from omniload_dask.trainer.shm import Segment, write_segment

__all__ = ["AGENT_START_TIMEOUT", "NodeAgent", "agent_socket", "authkey", "node_ranks_from_env"]

AGENT_START_TIMEOUT = 60.0  # seconds a rank waits for its node's agent to listen
LINGER = 30.0  # seconds an agent stays up with no rank attached


def agent_socket(job: str, address: str, node_ranks: Sequence[int]) -> str:
    """Where the agent of ``node_ranks`` of ``job`` on the scheduler ``address`` listens."""
    tag = hashlib.sha256(f"{job}|{address}|{list(node_ranks)}".encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), f"omniload-{tag}.sock")


def authkey(path: str) -> bytes:
    """The key a node agent and its ranks share (made from the socket path)."""
    return hashlib.sha256(f"omniload-node-agent|{path}".encode()).digest()


def node_ranks_from_env(rank: int) -> list[int]:
    """The ranks of this rank's node from ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` (torchrun)."""
    try:
        local, size = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        raise JobError(
            "fanout 'node': give node_ranks, or set LOCAL_RANK and LOCAL_WORLD_SIZE "
            "(torchrun does) so the feeder knows the ranks of its node"
        ) from None
    return list(range(rank - local, rank - local + size))


class NodeAgent:
    """The agent of one node (see the module docstring); :meth:`serve` runs it."""

    def __init__(
        self,
        job: str,
        address: str,
        node_ranks: Sequence[int],
        path: str,
        *,
        security: Any = None,
        prefetch: int = 8,
        linger: float = LINGER,
    ) -> None:
        self.job = job
        self.path = path
        self.node_ranks = list(node_ranks)
        self.prefetch = prefetch
        self.refill = max(1, prefetch // 2)
        self.linger = linger
        self.link = Link(address, security, salt=self.node_ranks[0])
        self.info = self.link.call("info", job=job)
        from omniload_dask.plan import parse_plan

        self.layout = parse_plan(self.info["plan"]).layout
        self.calls = 0
        self._cond = threading.Condition()
        self._positions: dict[int, int] = {}  # attached ranks: every step below is taken
        self._reports: dict[int, dict[str, Any]] = {}
        self._buffer: dict[int, dict[tuple[int, int], Segment]] = {}
        self._private: dict[int, list[Segment]] = {}  # a rank's own fetches, until its next get
        self._fetch_from: int | None = None
        self._end: int | None = None
        self._error: str | None = None
        self._stopped = False
        self._connections = 0  # ranks' connections open now
        self._idle_since = time.monotonic()

    def need(self, rank: int) -> tuple[int, int]:
        """The part ``rank`` fetches: (DP group, cp rank)."""
        c = self.layout.coords(rank)
        return c["dp"], c["cp"]

    # ------------------------------------------------------------------ running
    def serve(self) -> None:
        """Listen on the socket, fetch, and hand out until idle for ``linger`` seconds."""
        if os.path.exists(self.path):
            os.unlink(self.path)
        listener = Listener(self.path, family="AF_UNIX", authkey=authkey(self.path))
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        fetcher = threading.Thread(target=self._fetch_loop, daemon=True, name="omniload-agent")
        fetcher.start()
        try:
            with self._cond:
                while not self._stopped:
                    idle = time.monotonic() - self._idle_since
                    if not self._connections and idle > self.linger:
                        break
                    self._cond.wait(min(1.0, self.linger))
        finally:
            self._stop()
            listener.close()
            if os.path.exists(self.path):
                os.unlink(self.path)

    def _stop(self) -> None:
        with self._cond:
            self._stopped = True
            for segments in self._buffer.values():
                for seg in segments.values():
                    seg.unlink()
            for segs in self._private.values():
                for seg in segs:
                    seg.unlink()
            self._buffer.clear()
            self._private.clear()
            self._cond.notify_all()
        self.link.close()

    def _accept(self, listener: Listener) -> None:
        while not self._stopped:
            try:
                conn = listener.accept()
            except OSError:
                return
            threading.Thread(target=self._talk, args=(conn,), daemon=True).start()

    def _talk(self, conn: Connection) -> None:
        """Serve one rank's connection until it closes (a rank that died keeps its place:
        the job waits for it, and says so, until it comes back)."""
        with self._cond:
            self._connections += 1
        try:
            while not self._stopped:
                message = conn.recv()
                conn.send(self._handle(message))
        except (EOFError, OSError):
            pass
        finally:
            conn.close()
            with self._cond:
                self._connections -= 1
                if not self._connections:
                    self._idle_since = time.monotonic()
                self._cond.notify_all()

    def _handle(self, message: tuple[Any, ...]) -> tuple[Any, ...]:
        kind = message[0]
        if kind == "attach":
            _, rank, start = message
            if start is None:  # where the job starts (a resumed job: where it resumed)
                start = int(self.info.get("start_step") or 0)
            with self._cond:
                self._positions[int(rank)] = int(start)
                self._moved()
            return ("ok", self.info, int(start))
        if kind == "get":
            _, rank, start, count, report = message
            return self._get(int(rank), int(start), int(count), report)
        if kind == "info":
            self.info = self.link.call("info", job=self.job)
            return ("ok", self.info)
        if kind == "detach":
            with self._cond:
                self._positions.pop(int(message[1]), None)
                self._reports.pop(int(message[1]), None)
                self._moved()
            return ("ok", None)
        return ("error", f"node agent: unknown request {kind!r}")

    # ------------------------------------------------------------------ ranks
    def _get(self, rank: int, start: int, count: int, report: Any) -> tuple[Any, ...]:
        """The segments of ``rank``'s part from ``start`` on that are ready (long-poll)."""
        need = self.need(rank)
        deadline = time.monotonic() + POLL_TIMEOUT
        with self._cond:
            for seg in self._private.pop(rank, []):
                seg.unlink()
            self._positions[rank] = start
            if isinstance(report, dict):
                self._reports[rank] = report
            self._moved()
            while True:
                if self._error is not None:
                    return ("error", self._error)
                low = min(self._buffer, default=self._fetch_from)
                if low is not None and start < low:
                    break  # behind the buffer: a fetch of its own
                ready = []
                for step in range(start, start + count):
                    segments = self._buffer.get(step)
                    if segments is None or need not in segments:
                        break
                    ready.append((step, segments[need].name))
                if ready:
                    return ("steps", ready, self._end)
                if start in self._buffer:
                    break  # the buffer lacks this rank's part (it attached late)
                if self._end is not None and start >= self._end:
                    return ("steps", [], self._end)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return ("steps", [], self._end)
                self._cond.wait(remaining)
        return self._own_fetch(rank, need, start, count)

    def _own_fetch(
        self, rank: int, need: tuple[int, int], start: int, count: int
    ) -> tuple[Any, ...]:
        """Fetch ``rank``'s part of the steps from ``start`` for it alone."""
        try:
            reply, parts = fetch_steps(self.link, self.job, [rank], [need], start, count, {})
        except OmniloadError as exc:
            return ("error", str(exc))
        except Exception as exc:
            if retryable(exc):
                return ("steps", [], None)
            return ("error", f"{type(exc).__name__}: {exc}")
        segments = [write_segment(p[0]) for p in parts]
        with self._cond:
            self._private[rank] = segments
        ready = [(start + i, seg.name) for i, seg in enumerate(segments)]
        return ("steps", ready, reply.get("end"))

    def _moved(self) -> None:
        """Ranks moved: free the steps every attached rank is past; wake the fetcher."""
        if self._positions:
            slowest = min(self._positions.values())
            for step in [s for s in self._buffer if s < slowest]:
                for seg in self._buffer.pop(step).values():
                    seg.unlink()
            if self._fetch_from is None or self._fetch_from < slowest:
                self._fetch_from = slowest
        self._cond.notify_all()

    # ------------------------------------------------------------------ fetching
    def _want(self) -> tuple[list[int], list[tuple[int, int]], int, int] | None:
        with self._cond:
            while not self._stopped:
                if self._positions and self._fetch_from is not None and self._error is None:
                    slowest = min(self._positions.values())
                    ahead = self._fetch_from - slowest
                    count = slowest + self.prefetch - self._fetch_from
                    if self._end is not None:
                        count = min(count, self._end - self._fetch_from)
                    if ahead <= self.prefetch - self.refill and count > 0:
                        ranks = sorted(self._positions)
                        needs = sorted({self.need(r) for r in ranks})
                        return ranks, needs, self._fetch_from, count
                self._cond.wait(0.5)
        return None

    def _fetch_loop(self) -> None:
        attempt = 0
        while (want := self._want()) is not None:
            ranks, needs, start, count = want
            report = self._report()
            try:
                self.calls += 1
                reply, parts = fetch_steps(
                    self.link, self.job, ranks, needs, start, count, report, self.refill
                )
                attempt = 0
            except BaseException as exc:
                if retryable(exc):
                    attempt += 1
                    time.sleep(min(5.0, 0.1 * 2 ** min(attempt, 6)))
                    continue
                with self._cond:
                    self._error = str(exc) if isinstance(exc, OmniloadError) else repr(exc)
                    self._cond.notify_all()
                return
            segments = [
                {need: write_segment(b) for need, b in zip(needs, p, strict=True)} for p in parts
            ]
            with self._cond:
                if reply.get("end") is not None:
                    self._end = int(reply["end"])
                if self._fetch_from != start:  # ranks jumped meanwhile: drop what came
                    for segs in segments:
                        for seg in segs.values():
                            seg.unlink()
                    continue
                for i, segs in enumerate(segments):
                    self._buffer[start + i] = segs
                self._fetch_from = start + len(segments)
                self._cond.notify_all()

    def _report(self) -> dict[str, Any]:
        """What the data plane's monitoring gets for the node's ranks: the worst of theirs
        (longest waits, fewest steps held)."""
        with self._cond:
            reports = list(self._reports.values())
        if not reports:
            return {}
        waits = {
            k: max((r[k] for r in reports if r.get(k) is not None), default=None)
            for k in ("wait_p50", "wait_p99")
        }
        return {
            **waits,
            "buffered": min(int(r.get("buffered") or 0) for r in reports),
            "prefetch": max(int(r.get("prefetch") or 0) for r in reports),
            "samples": sum(int(r.get("samples") or 0) for r in reports),
        }


def main() -> None:
    """Run an agent from the pickled arguments on stdin (what :class:`NodeSupply` starts)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # clean up: socket, segments
    job, address, ranks, path, security, prefetch = pickle.loads(sys.stdin.buffer.read())
    linger = float(os.environ.get("OMNILOAD_AGENT_LINGER", LINGER))
    agent = NodeAgent(
        job, address, ranks, path, security=security, prefetch=prefetch, linger=linger
    )
    agent.serve()


if __name__ == "__main__":
    main()

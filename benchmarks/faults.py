"""Faults on an external cluster: worker processes killed, a feeder killed, the scheduler killed.

    python benchmarks/faults.py [--quick] [--step-ms 100] [--ranks 2] [--workers 3]

The cluster is the one the README documents: ``dask scheduler --preload omniload_dask.preload``
and ``--workers`` ``dask worker ADDRESS --nthreads 3 --resources omniload-read=2
--preload-nanny omniload_dask.rejoin`` processes. A driver process starts the job (demo text
data, a checkpoint in a temp folder); each of ``--ranks`` trainer ranks is a process of its
own (``--rank-process``) with a Feeder that takes one step, spends ``--step-ms`` on it (a
stand-in for training) and reports the step's micro-batch digests, its wait and its
``state_dict()`` to the driver. While the ranks run, the driver

1. kills a worker *process* (SIGKILL; its nanny starts a new one) three times, ``--gap`` steps
   apart: every upcoming batch and shard has a standby copy on another worker;
2. kills the last rank's process and starts it again from the state it last reported;
3. kills the scheduler (SIGKILL), starts a new one at the same address at once, and calls
   ``Job.start(plan, address=..., resume=True)``: the workers rejoin by themselves (the nanny
   preload), the feeders reconnect by themselves.

Afterwards every rank's stream is compared with an undisturbed run of the same plan (the
in-process data plane, which the stream contract says gives the same batches). Reported per
fault: the longest stall of any rank (its wait for a step, in seconds and in steps of
``--step-ms``), and for the scheduler and feeder restarts the time from the kill to the first
batch after it. The last line is ``RESULT {json}`` with ``worker_kill_max_stall_steps``,
``worker_kill_max_stall_s``, ``scheduler_restart_s``, ``feeder_restart_s``,
``stream_identical``, ``lost``, ``repeated`` and the figures behind them.

Targets (DESIGN.md): a worker kill stalls no rank more than one step at a 0.1 s step; the
first batch within 10 s of a scheduler kill, no worker restarted by hand.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

DASK_ENV = {
    "DASK_DISTRIBUTED__SCHEDULER__WORKER_SATURATION": "inf",
    "DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED": "False",
    "DASK_DISTRIBUTED__ADMIN__SYSTEM_MONITOR__DISK": "False",
}


def digest(mb: dict[str, Any]) -> str:
    """A micro-batch's identity: its tokens, documents and boundaries."""
    h = hashlib.sha1()
    for key in ("input_ids", "doc_id", "doc_offset", "cu_seqlens"):
        h.update(key.encode())
        h.update(mb[key].tobytes())
    return h.hexdigest()[:16]


def make_plan(data: Path, checkpoint: str | None, ranks: int, name: str = "faults") -> dict:
    from omniload_dask.demo import demo_sources, demo_tokenizer

    plan: dict[str, Any] = {
        "version": 1,
        "name": name,
        "seed": 11,
        "tokenizer": demo_tokenizer(data),
        "batch": {"seq_len": 1024, "micro_batches": 2, "global_tokens": 1024 * 2 * ranks},
        "layout": {"dp": ranks},
        "on_error": "skip",
        "loader": {"prefetch": 2},
        "sources": demo_sources(data, web_unit_bytes="256KiB"),
    }
    if checkpoint:
        plan["checkpoint"] = {"url": checkpoint, "flush_seconds": 0.5}
    return plan


# ---------------------------------------------------------------------- a trainer rank
def rank_process(args: argparse.Namespace) -> int:
    """One trainer rank: take a step, spend ``step_ms``, report it (one JSON line a step)."""
    from omniload_dask import Feeder

    feeder = Feeder(
        args.job,
        address=args.address,
        dp_rank=args.rank,
        output="numpy",
        max_steps=args.steps,
        reconnect_timeout=120,
    )
    if args.state:
        feeder.load_state_dict(json.loads(args.state))
    print(json.dumps({"ready": time.time()}), flush=True)
    steps = feeder.steps()
    while True:
        t0 = time.perf_counter()
        try:
            mbs = next(steps)
        except StopIteration:
            break
        wait = time.perf_counter() - t0
        line = {
            "step": int(mbs[0]["step"]),
            "t": time.time(),
            "wait": wait,
            "digests": [digest(mb) for mb in mbs],
            "state": feeder.state_dict(),
            "failed_fetches": feeder._link.failed_fetches if feeder._link is not None else 0,
        }
        print(json.dumps(line), flush=True)
        time.sleep(args.step_ms / 1e3)
    feeder.close()
    print(json.dumps({"done": True}), flush=True)
    return 0


class Rank:
    """The driver's side of one rank process: its lines arrive on a queue."""

    def __init__(self, rank: int, args: argparse.Namespace, address: str, state: Any = None):
        self.rank = rank
        cmd = [sys.executable, __file__, "--rank-process", "--rank", str(rank)]
        cmd += ["--address", address, "--job", "faults", "--steps", str(args.steps)]
        cmd += ["--step-ms", str(args.step_ms)]
        if state is not None:
            cmd += ["--state", json.dumps(state)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        self.lines: queue.Queue[dict[str, Any]] = queue.Queue()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.lines.put(json.loads(line))
        self.lines.put({"exit": self.proc.wait()})

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)


# ---------------------------------------------------------------------- the cluster
class Cluster:
    """The README's external cluster: a preloaded scheduler and nanny-run workers."""

    def __init__(self, workers: int, logs: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.address = f"tcp://127.0.0.1:{self.port}"
        self.env = {**os.environ, **DASK_ENV}
        self.dask = str(Path(sys.executable).parent / "dask")
        self.logs = logs
        self.schedulers = 0
        self._logs: list[Any] = []
        self.scheduler = self.start_scheduler()
        self.workers = [
            subprocess.Popen(
                [
                    self.dask,
                    "worker",
                    self.address,
                    "--nthreads",
                    "3",
                    "--resources",
                    "omniload-read=2",
                    "--preload-nanny",
                    "omniload_dask.rejoin",
                    "--no-dashboard",
                ],
                stdout=self._log(f"worker-{i}.log"),
                stderr=subprocess.STDOUT,
                env=self.env,
            )
            for i in range(workers)
        ]

    def start_scheduler(self) -> subprocess.Popen[bytes]:
        self.schedulers += 1
        log = self._log(f"scheduler-{self.schedulers}.log")
        return subprocess.Popen(
            [self.dask, "scheduler", "--host", "127.0.0.1", "--port", str(self.port),
             "--no-dashboard", "--preload", "omniload_dask.preload"],
            stdout=log, stderr=subprocess.STDOUT, env=self.env)  # fmt: skip

    def _log(self, name: str) -> Any:
        handle = (self.logs / name).open("w")
        self._logs.append(handle)
        return handle

    def close(self) -> None:
        from support.accounting import stop_processes

        stop_processes([*self.workers, self.scheduler])
        for handle in self._logs:
            handle.close()


def wait_for_workers(client: Any, count: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while len(client.scheduler_info()["workers"]) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"fewer than {count} workers joined within {timeout:.0f}s")
        time.sleep(0.1)


def wait_for_port(port: int, timeout: float = 120.0) -> None:
    """Until something listens at ``port`` (a new scheduler is up)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1.0):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def worker_pids(client: Any) -> dict[str, int]:
    return dict(client.run(os.getpid))


# ---------------------------------------------------------------------- the run
def reference(plan: dict[str, Any], steps: int) -> dict[tuple[int, int], list[str]]:
    """Every (step, rank)'s micro-batch digests in an undisturbed run (in process)."""
    from omniload_dask import parse_plan
    from omniload_dask.batching.wire import expand
    from omniload_dask.testing import InlineDataPlane

    out = {}
    for t, groups in InlineDataPlane(parse_plan(plan)).stream(steps):
        for g, batch in groups.items():
            out[(t, g)] = [digest(expand(mb)) for mb in batch.micro_batches]
    return out


class Run:
    """The driver: the rank processes' lines, and where each rank is."""

    def __init__(self, ranks: list[Rank]) -> None:
        self.ranks = ranks
        self.delivered: dict[tuple[int, int], list[list[str]]] = {}
        self.events: list[tuple[int, float, int, float]] = []  # (rank, t, step, wait)
        self.step = {r.rank: -1 for r in ranks}
        self.state: dict[int, Any] = {}
        self.done: set[int] = set()
        self.failed: dict[int, int] = {}  # each rank's fetches that failed (a dead holder)

    def pump(self, until: float) -> None:
        """Take the ranks' lines until ``until`` (monotonic seconds)."""
        while time.monotonic() < until:
            got = False
            for r in self.ranks:
                try:
                    line = r.lines.get_nowait()
                except queue.Empty:
                    continue
                got = True
                if "step" in line:
                    key = (line["step"], r.rank)
                    self.delivered.setdefault(key, []).append(line["digests"])
                    self.events.append((r.rank, line["t"], line["step"], line["wait"]))
                    self.step[r.rank] = line["step"]
                    self.failed[r.rank] = line["failed_fetches"]
                    self.state[r.rank] = line["state"]
                elif "done" in line:
                    self.done.add(r.rank)
                elif "exit" in line and line["exit"] not in (0, -signal.SIGKILL):
                    raise RuntimeError(f"rank {r.rank} exited with {line['exit']}")
            if not got:
                time.sleep(0.01)

    def wait_step(self, step: int, timeout: float = 300.0) -> None:
        """Until every rank passed ``step``."""
        deadline = time.monotonic() + timeout
        while min(self.step.values()) < step and len(self.done) < len(self.ranks):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the ranks did not reach step {step} within {timeout:.0f}s")
            self.pump(time.monotonic() + 0.05)

    def first_batch_after(self, t: float, end: float, rank: int | None = None) -> float | None:
        """When the ranks had their first batch after an outage that began at ``t``: per rank,
        the end of its longest wait in ``[t, end)``; the latest of the ranks (None: none)."""
        out = None
        for r in {r for r, *_ in self.events}:
            if rank is not None and r != rank:
                continue
            mine = [(w, when) for q, when, _, w in self.events if q == r and t < when < end]
            if mine:
                when = max(mine)[1]
                out = when if out is None else max(out, when)
        return out

    def max_stall(self, start: float, end: float) -> float:
        """The longest wait of any rank for a step it asked for within ``[start, end)``."""
        return max(
            (w for _, when, _, w in self.events if start <= when - w < end or start <= when < end),
            default=0.0,
        )


def driver(args: argparse.Namespace) -> int:
    from distributed import Client

    from omniload_dask import Job, parse_plan
    from omniload_dask.demo import make_demo_data

    tmp = Path(tempfile.mkdtemp(prefix="omniload-faults-"))
    data = make_demo_data(tmp / "data", scale=0.5 if args.quick else 1.0)
    plan = make_plan(data, str(tmp / "ckpt"), args.ranks)
    t0 = time.perf_counter()
    expected = reference(make_plan(data, None, args.ranks), args.steps)
    print(f"undisturbed run: {args.steps} steps in {time.perf_counter() - t0:.1f}s (in process)")
    cluster = Cluster(args.workers, tmp)
    client = Client(cluster.address, timeout=60, set_as_default=False)
    wait_for_workers(client, args.workers)
    job = Job.start(parse_plan(plan), client=client)
    ranks = [Rank(r, args, cluster.address) for r in range(args.ranks)]
    run = Run(ranks)
    faults: list[dict[str, Any]] = []
    gap = args.gap
    try:
        # 1. three worker processes killed, gap steps apart
        at = gap
        for _ in range(3 if "worker" in args.faults else 0):
            run.wait_step(at)
            wait_for_workers(client, args.workers)
            pids = worker_pids(client)
            victim = sorted(pids)[len(faults) % len(pids)]
            t = time.time()
            os.kill(pids[victim], signal.SIGKILL)
            faults.append({"fault": "worker_kill", "t": t, "step": at})
            at += gap
        # 2. the last rank's process killed and started again from its last state
        if "feeder" in args.faults:
            run.wait_step(at)
            victim_rank = ranks[-1]
            victim_rank.kill()
            run.pump(time.monotonic() + 0.2)  # lines already written
            t = time.time()
            state = run.state[victim_rank.rank]
            ranks[-1] = Rank(victim_rank.rank, args, cluster.address, state)
            run.ranks = ranks
            faults.append({"fault": "feeder_restart", "t": t, "step": at})
            at += gap
        # 3. the scheduler killed; a new one at the same address; the job resumed
        run.wait_step(at)
        plane = job.stats()  # the data plane's figures before the scheduler goes
        failed_before = sum(run.failed.values())
        if "scheduler" in args.faults:
            job.flush_checkpoint()
            client.close(timeout=5)  # the driver's own client would log its reconnects
            t = time.time()
            cluster.scheduler.send_signal(signal.SIGKILL)
            cluster.scheduler.wait(30)
            cluster.scheduler = cluster.start_scheduler()
            wait_for_port(cluster.port)  # (Dask's connect backs off to seconds while refused)
            up_s = time.time() - t
            client = Client(cluster.address, timeout=60, set_as_default=False)
            job = Job.start(parse_plan(plan), client=client, resume=True)
            resumed_s = time.time() - t
            faults.append(
                {
                    "fault": "scheduler_restart",
                    "t": t,
                    "step": at,
                    "resumed_s": resumed_s,
                    "up_s": up_s,
                }
            )
        run.wait_step(args.steps - 1)
        run.pump(time.monotonic() + 1.0)
    finally:
        for r in run.ranks:
            if r.proc.poll() is None:
                r.proc.terminate()
                r.proc.wait(30)
        try:
            job.close()
            client.close(timeout=10)
        finally:
            cluster.close()

    # the stream against the undisturbed run
    lost = sum(1 for key in expected if key not in run.delivered)
    repeated = sum(len(v) - 1 for v in run.delivered.values())
    wrong = sum(1 for key, v in run.delivered.items() if any(d != expected.get(key) for d in v))
    identical = lost == 0 and repeated == 0 and wrong == 0
    step_s = args.step_ms / 1e3
    ends = [f["t"] for f in faults[1:]] + [float("inf")]
    for f, end in zip(faults, ends, strict=True):
        f["max_stall_s"] = run.max_stall(f["t"], end)
        f["max_stall_steps"] = f["max_stall_s"] / step_s
    warm = min(when for _, when, step, _ in run.events if step >= 10)
    baseline = run.max_stall(warm, faults[0]["t"]) if faults else None
    kills = [f for f in faults if f["fault"] == "worker_kill"] or [
        {"max_stall_s": None, "max_stall_steps": None}
    ]
    none = {"t": float("inf"), "max_stall_s": None, "resumed_s": None, "up_s": None}
    feeder = next((f for f in faults if f["fault"] == "feeder_restart"), none)
    sched = next((f for f in faults if f["fault"] == "scheduler_restart"), none)
    victim = ranks[-1].rank
    feeder_first = min(
        (when for r, when, _, _ in run.events if r == victim and when > feeder["t"]), default=None
    )
    sched_first = run.first_batch_after(sched["t"], float("inf"))
    result = {
        "benchmark": "faults",
        "quick": args.quick,
        "steps": args.steps,
        "step_ms": args.step_ms,
        "ranks": args.ranks,
        "workers": args.workers,
        "load_average": round(os.getloadavg()[0], 2),
        "baseline_max_stall_s": _round(baseline, 3),
        "worker_kills": len(kills),
        "worker_kill_max_stall_steps": _round(max(f["max_stall_steps"] for f in kills), 2),
        "worker_kill_max_stall_s": _round(max(f["max_stall_s"] for f in kills), 3),
        "worker_kill_stalls_s": [_round(f["max_stall_s"], 3) for f in kills],
        "feeder_restart_s": round(feeder_first - feeder["t"], 3) if feeder_first else None,
        "feeder_restart_max_stall_s": _round(feeder["max_stall_s"], 3),
        "scheduler_restart_s": round(sched_first - sched["t"], 3) if sched_first else None,
        "scheduler_restart_listening_s": _round(sched["up_s"], 3),
        "scheduler_restart_resume_s": _round(sched["resumed_s"], 3),
        "scheduler_restart_max_stall_s": _round(sched["max_stall_s"], 3),
        "batches_recomputed": plane["batches_recomputed"],
        "reads_recomputed": plane["reads_recomputed"],
        "failed_fetches": failed_before,
        "stream_identical": identical,
        "lost": lost,
        "repeated": repeated,
        "wrong": wrong,
    }
    print(f"undisturbed stretch (step 10 to the first fault): longest stall {baseline:.3f} s")
    for f in faults:
        print(
            f"{f['fault']:<18} at step {f['step']:>4}: longest stall of any rank "
            f"{f['max_stall_s']:.3f} s = {f['max_stall_steps']:.2f} steps"
        )
    print(
        f"feeder restart: kill to first batch {result['feeder_restart_s']} s; scheduler "
        f"restart: kill to first batch {result['scheduler_restart_s']} s (the new scheduler "
        f"listened after {result['scheduler_restart_listening_s']} s, Job.start resumed "
        f"after {result['scheduler_restart_resume_s']} s)"
    )
    print(
        f"before the scheduler restart: {plane['batches_recomputed']} batches and "
        f"{plane['reads_recomputed']} reads recomputed (lost with no standby copy yet), "
        f"{failed_before} fetches from a dead worker (then the standby copy)"
    )
    print(f"stream identical: {identical} (lost {lost}, repeated {repeated}, wrong {wrong})")
    if args.keep:
        print(f"logs and data kept in {tmp}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    print("RESULT " + json.dumps(result))
    return 0


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--gap", type=int, default=None, help="steps between faults")
    parser.add_argument("--step-ms", type=float, default=100.0)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument(
        "--faults", default="worker,feeder,scheduler", help="which faults, comma-separated"
    )
    parser.add_argument("--keep", action="store_true", help="keep the logs and data folder")
    parser.add_argument("--rank-process", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--address", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--job", default="faults", help=argparse.SUPPRESS)
    parser.add_argument("--state", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.gap is None:
        args.gap = 25 if args.quick else 60
    if args.steps is None:
        kinds = args.faults.split(",")
        events = 3 * ("worker" in kinds) + ("feeder" in kinds) + ("scheduler" in kinds)
        args.steps = args.gap * (events + 1)
    if args.rank_process:
        return rank_process(args)
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())

"""Scheduler cost, connections and bytes at thousands of trainer ranks.

    python benchmarks/scale.py --quick          # 1,024 ranks tp 1 and 4,096 ranks tp 8
    python benchmarks/scale.py                  # up to 16,384 ranks, tp 1 and tp 8
    python benchmarks/scale.py --points 4096x8,16384x8 --real 256 --memory 100000

Each point runs the real plugin on a real scheduler: ``dask scheduler --preload
omniload_dask.preload`` in its own process (so its CPU-seconds and RSS can be read) and
``--workers`` ``dask worker`` processes. N trainer ranks are simulated by fetching agents, one
per node of ``--ranks-per-node`` ranks (with tp 8 a node is one model-parallel group: what a
broadcast leader or a node agent fetches for; with tp 1 it holds 8 DP groups, which a node
agent fetches in one request). Every agent is a ``trainer.fanout.DirectSupply``, the code path
of a real feeder, a broadcast leader and a node agent alike: its own connections (a ``Link``:
Dask comms, no ``Client``), its own prefetch thread with hysteresis, one request for all its
ranks and parts. Agents share a few host processes (``--hosts``). Each host consumes one step
every ``--step-seconds`` (paced): for every agent, take the step's parts, then mark it done;
the time a take blocks is the fetch wait.

Batches are tiny (``--seq-len`` 64 tokens a rank, one micro-batch, byte tokenizer): on a
2-core machine the workers could not build thousands of real batches a second, and the
scheduler's work per step does not depend on batch size (bytes do, and are reported). Per
point: scheduler CPU-s per step (over ``--steps`` steps after ``--warmup``), its share of a
core, scheduler RSS, established connections per worker process, bytes workers sent to agents
per step (parts served) and to each other (shards for constructions, standby copies), fetch
wait p50/p99, and the agents' requests per step.

``--real N`` also runs N real ``Feeder`` threads (tp 1, fanout none: every rank fetches) and the
same layout simulated, to check the simulation. ``--memory STEPS`` runs a one-rank job for
STEPS steps as fast as it goes, with and without a checkpoint, and reports the scheduler's RSS
growth per 100,000 steps (the slope after step 5,000, when the job's rings are full).
``planning_ms`` times the balance of one global batch per case.

The last line is ``RESULT {json}`` with ``points`` (ranks, tp, dp, scheduler_cpu_s_per_step,
worker_connections_max, worker_bytes_per_step, fetch_wait_p99_ms, ...), ``planning_ms``, and
``real`` / ``memory`` when asked.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np
import psutil

QUICK_POINTS = "1024x1,4096x8"
FULL_POINTS = "256x1,1024x1,4096x1,4096x8,16384x8,16384x1"
PLANNING_CASES = ((512, 8192), (1024, 16384), (2048, 16384))
MEMORY_SETTLED = 5000  # steps after which a memory run's RSS counts (the rings are full)
DASK_ENV = {
    "DASK_DISTRIBUTED__SCHEDULER__WORKER_SATURATION": "inf",
    "DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED": "False",
    "DASK_DISTRIBUTED__ADMIN__SYSTEM_MONITOR__DISK": "False",
    "DASK_DISTRIBUTED__DASHBOARD__EXPORT_TOOL": "False",
}


# ---------------------------------------------------------------------- the cluster
class Cluster:
    """``dask scheduler --preload omniload_dask.preload`` and worker processes, each its own."""

    def __init__(self, workers: int, threads: int) -> None:
        from distributed import Client

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.address = f"tcp://127.0.0.1:{port}"
        env = {**os.environ, **DASK_ENV}
        bindir = Path(sys.executable).parent
        quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "env": env}
        self.scheduler = subprocess.Popen(
            [
                str(bindir / "dask"),
                "scheduler",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--no-dashboard",
                "--preload",
                "omniload_dask.preload",
                *(
                    ["--preload", os.environ["SCALE_PRELOAD"]]
                    if "SCALE_PRELOAD" in os.environ
                    else []
                ),
            ],
            **quiet,
        )
        self.workers = [
            subprocess.Popen(
                [
                    str(bindir / "dask"),
                    "worker",
                    self.address,
                    "--nthreads",
                    str(threads + 1),
                    "--resources",
                    f"omniload-read={threads}",
                    "--no-nanny",
                    "--no-dashboard",
                ],
                **quiet,
            )
            for _ in range(workers)
        ]
        deadline = time.monotonic() + 120
        while True:
            try:
                self.client = Client(self.address, timeout=5, set_as_default=False)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        self.client.wait_for_workers(workers, timeout=120)
        self.proc = psutil.Process(self.scheduler.pid)
        self.worker_procs = [psutil.Process(p.pid) for p in self.workers]

    def cpu(self) -> float:
        """CPU-seconds the scheduler process used so far (all its threads)."""
        t = self.proc.cpu_times()
        return float(t.user + t.system)

    def rss(self) -> int:
        """The scheduler's resident memory now."""
        return int(self.proc.memory_info().rss)

    def worker_connections(self) -> list[int]:
        """Established TCP connections of each worker process."""
        return [
            sum(1 for c in p.net_connections("tcp") if c.status == psutil.CONN_ESTABLISHED)
            for p in self.worker_procs
        ]

    def worker_sent(self) -> tuple[int, int, int]:
        """Bytes and parts workers served to agents, and bytes they sent each other."""

        def sent(dask_worker: Any) -> tuple[int, int, int]:
            plugin = dask_worker.plugins.get("omniload-parts")
            parts = (plugin.sent_bytes, plugin.sent_parts) if plugin is not None else (0, 0)
            return (*parts, int(dask_worker.transfer_outgoing_bytes_total))

        rows = self.client.run(sent).values()
        return tuple(int(sum(r[i] for r in rows)) for i in range(3))  # type: ignore[return-value]

    def plane_figures(self, job: str) -> tuple[float, int]:
        """CPU-seconds the job's data plane spent dealing steps, and agents' requests."""

        def figures(dask_scheduler: Any) -> tuple[float, int]:
            run = dask_scheduler.plugins["omniload"].jobs[job]
            return float(run.dealing.cpu_s), int(run.requests)

        cpu, requests = self.client.run_on_scheduler(figures)
        return float(cpu), int(requests)

    def close(self) -> None:
        """Stop everything (workers first)."""
        try:
            self.client.close(timeout=10)
        finally:
            from support.accounting import stop_processes

            stop_processes([*self.workers, self.scheduler])


# ---------------------------------------------------------------------- data and plans
def write_data(root: Path, megabytes: int = 12) -> Path:
    """Short JSON Lines documents (tens of tokens), about ``megabytes`` MB."""
    rng = np.random.default_rng(7)
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "tau", "rho", "mu"]
    path = root / "tiny.jsonl"
    with path.open("w") as f:
        size = 0
        while size < megabytes << 20:
            n = int(rng.integers(4, 14))
            line = json.dumps({"text": " ".join(rng.choice(words, n))}) + "\n"
            f.write(line)
            size += len(line)
    return path


def scale_plan(name: str, data: Path, dp: int, tp: int, seq_len: int, prefetch: int) -> dict:
    return {
        "version": 1,
        "name": name,
        "seed": 1,
        "tokenizer": {"kind": "byte"},
        "batch": {"seq_len": seq_len, "micro_batches": 1, "global_tokens": dp * seq_len},
        "layout": {"dp": dp, "tp": tp},
        "on_error": "skip",
        "loader": {"prefetch": prefetch, "lookahead": 2, "retain_steps": 16},
        "sources": [{"name": "tiny", "format": "jsonl", "path": str(data), "unit_bytes": "1MiB"}],
    }


# ---------------------------------------------------------------------- agent hosts
def host_main() -> None:
    """A host process of simulated agents (config as JSON on stdin); prints ``TICK step``
    after each step, then ``HOST {json}``."""
    from omniload_dask.plan import parse_plan
    from omniload_dask.trainer.fanout import DirectSupply
    from omniload_dask.trainer.fetch import wait_report
    from omniload_dask.trainer.link import Link

    cfg = json.loads(sys.stdin.read())
    layout = parse_plan(cfg["plan"]).layout
    recent: deque[float] = deque(maxlen=64)
    agents = []
    for ranks in cfg["nodes"]:
        coords = [layout.coords(r) for r in ranks]
        needs = sorted({(c["dp"], c["cp"]) for c in coords})
        link = Link(cfg["address"], salt=ranks[0])
        report = wait_report(recent, 0, cfg["prefetch"])
        agents.append(
            DirectSupply(
                link,
                cfg["job"],
                ranks,
                needs,
                0,
                cfg["prefetch"],
                lambda _b, rep=report: rep,
                pick=None,
                max_steps=cfg["steps"],
                reconnect_timeout=60,
            )
        )
    waits: list[float] = []
    start, step_s = wait_for_go(cfg, lambda: [a.take(0) for a in agents]), cfg["step_seconds"]
    for step in range(cfg["steps"]):
        delay = start + step * step_s - time.time()
        if delay > 0:
            time.sleep(delay)
        for agent in agents:
            t0 = time.perf_counter()
            agent.take(step)
            waits.append(time.perf_counter() - t0)
            agent.done(step)
        print(f"TICK {step}", flush=True)
    out = {
        "waits": waits[len(agents) * cfg["warmup"] :],
        "calls": sum(a.calls for a in agents),
        "connections": [a.link.connections() for a in agents],
    }
    for agent in agents:
        agent.close()
    print("HOST " + json.dumps(out), flush=True)


def real_host_main() -> None:
    """A host process of real Feeder threads, one per rank (config as JSON on stdin)."""
    from omniload_dask import Feeder

    cfg = json.loads(sys.stdin.read())
    feeders = [
        Feeder(
            cfg["job"],
            address=cfg["address"],
            rank=r,
            prefetch=cfg["prefetch"],
            max_steps=cfg["steps"],
            output="numpy",
        )
        for r in cfg["ranks"]
    ]
    done = [0] * len(feeders)
    waits: list[list[float]] = [[] for _ in feeders]
    first = [next(f.steps()) for f in feeders]  # step 0 of every rank: warm
    start, step_s = wait_for_go(cfg, lambda: None), cfg["step_seconds"]
    del first

    def rank_loop(i: int) -> None:
        for step in range(1, cfg["steps"]):
            delay = start + step * step_s - time.time()
            if delay > 0:
                time.sleep(delay)
            t0 = time.perf_counter()
            next(feeders[i])
            waits[i].append(time.perf_counter() - t0)
            done[i] = step + 1

    threads = [threading.Thread(target=rank_loop, args=(i,)) for i in range(len(feeders))]
    for t in threads:
        t.start()
    printed = 0
    done[:] = [1] * len(feeders)
    while printed < cfg["steps"]:
        low = min(done)
        while printed < low:
            print(f"TICK {printed}", flush=True)
            printed += 1
        time.sleep(0.01)
    for t in threads:
        t.join()
    out = {
        "waits": [w for ws in waits for w in ws[cfg["warmup"] :]],
        "calls": sum(f.calls for f in feeders),
        "connections": [f._link.connections() if f._link else 0 for f in feeders],
    }
    for f in feeders:
        f.close()
    print("HOST " + json.dumps(out), flush=True)


def wait_for_go(cfg: dict, warm: Any) -> float:
    """Warm up (``warm()``: step 0), say READY, and wait for the common start time the
    harness writes to ``cfg["go"]``; returns it (step 1 starts there, one step a tick)."""
    warm()
    print("READY", flush=True)
    go = Path(cfg["go"])
    while not go.exists() or not go.read_text().strip():
        time.sleep(0.05)
    return float(go.read_text()) - cfg["step_seconds"]


class Hosts:
    """Host processes and their progress (the last step each has finished)."""

    def __init__(self, mode: str, configs: list[dict]) -> None:
        self.procs = []
        self.ticks = [-1] * len(configs)
        self.ready = [False] * len(configs)
        self.results: list[dict | None] = [None] * len(configs)
        self.errors: list[str] = []
        for cfg in configs:
            proc = subprocess.Popen(
                [sys.executable, __file__, mode],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(cfg))
            proc.stdin.close()
            self.procs.append(proc)
        self._threads = [
            threading.Thread(target=self._read, args=(i,), daemon=True)
            for i in range(len(self.procs))
        ]
        for t in self._threads:
            t.start()

    def _read(self, i: int) -> None:
        proc = self.procs[i]
        assert proc.stdout is not None and proc.stderr is not None
        for line in proc.stdout:
            if line.startswith("READY"):
                self.ready[i] = True
            elif line.startswith("TICK "):
                self.ticks[i] = int(line.split()[1])
            elif line.startswith("HOST "):
                self.results[i] = json.loads(line[5:])
        err = proc.stderr.read()
        if proc.wait() != 0:
            self.errors.append(err[-3000:])

    def start(self, go: Path, timeout: float) -> None:
        """Once every host is warm, have them all start in a second."""
        deadline = time.monotonic() + timeout
        while not all(self.ready):
            if self.errors:
                raise RuntimeError("an agent host failed:\n" + self.errors[0])
            if time.monotonic() > deadline:
                raise TimeoutError("agent hosts did not get ready")
            time.sleep(0.05)
        tmp = go.with_suffix(".tmp")
        tmp.write_text(str(time.time() + 1.0))
        tmp.rename(go)

    def wait_step(self, step: int, timeout: float) -> float:
        """Wait until every host finished ``step``; the time then (monotonic)."""
        deadline = time.monotonic() + timeout
        while min(self.ticks) < step:
            if self.errors:
                raise RuntimeError("an agent host failed:\n" + self.errors[0])
            if time.monotonic() > deadline:
                raise TimeoutError(f"hosts did not reach step {step}: at {self.ticks}")
            time.sleep(0.01)
        return time.monotonic()

    def finish(self, timeout: float) -> list[dict]:
        for t in self._threads:
            t.join(timeout)
        if self.errors:
            raise RuntimeError("an agent host failed:\n" + self.errors[0])
        return [r for r in self.results if r is not None]


# ---------------------------------------------------------------------- one point
def run_point(
    args: argparse.Namespace,
    data: Path,
    ranks: int,
    tp: int,
    *,
    real: bool = False,
    per_node: int | None = None,
) -> dict[str, Any]:
    """One layout on a fresh cluster: simulated agents (or real feeders); its figures."""
    from omniload_dask import Job, parse_plan

    per_node = per_node or (1 if real else args.ranks_per_node)
    dp = ranks // tp
    name = f"{'real' if real else 'scale'}{ranks}x{tp}"
    plan = scale_plan(name, data, dp, tp, args.seq_len, args.prefetch)
    step_s = args.step_seconds or max(0.5, round(dp / args.groups_per_second, 2))
    total = args.warmup + args.steps + 2
    cluster = Cluster(args.workers, args.threads)
    try:
        t_start = time.monotonic()
        job = Job.start(parse_plan(plan), client=cluster.client)
        nodes = [list(range(r, min(r + per_node, ranks))) for r in range(0, ranks, per_node)]
        hosts = min(args.hosts, len(nodes))
        go = Path(tempfile.mkdtemp()) / "go"
        common = {
            "address": cluster.address,
            "job": name,
            "plan": plan,
            "steps": total,
            "warmup": args.warmup,
            "prefetch": args.prefetch,
            "step_seconds": step_s,
            "go": str(go),
        }
        if real:
            configs = [
                {**common, "ranks": [r for n in nodes[h::hosts] for r in n]} for h in range(hosts)
            ]
        else:
            configs = [{**common, "nodes": nodes[h::hosts]} for h in range(hosts)]
        group = Hosts("--real-host" if real else "--agent-host", configs)
        timeout = 300 + 4 * total * step_s
        group.start(go, timeout)
        group.wait_step(args.warmup - 1, timeout)
        sent0, (plan0, req0) = cluster.worker_sent(), cluster.plane_figures(name)
        t0, cpu0 = time.monotonic(), cluster.cpu()
        group.wait_step(args.warmup + args.steps - 1, timeout)
        t1, cpu1 = time.monotonic(), cluster.cpu()
        sent1, (plan1, req1) = cluster.worker_sent(), cluster.plane_figures(name)
        connections = cluster.worker_connections()
        rss = cluster.rss()
        results = group.finish(timeout)
        sent_all = cluster.worker_sent()
        stats = job.stats()
        job.stop()
    finally:
        cluster.close()
    steps = args.steps
    waits = np.asarray([w for r in results for w in r["waits"]]) * 1e3
    calls = sum(r["calls"] for r in results)
    cpu = (cpu1 - cpu0) / steps
    dealing = (plan1 - plan0) / steps
    in_process = stats.get("planning_in") == "process"
    return {
        "ranks": ranks,
        "tp": tp,
        "dp": dp,
        "agents": len(nodes),
        "ranks_per_agent": per_node,
        "step_seconds": step_s,
        "seconds_per_step": round((t1 - t0) / steps, 3),
        "scheduler_cpu_s_per_step": round(cpu, 4),
        "planning_cpu_s_per_step": round(dealing, 4),
        "planning_in": stats.get("planning_in"),
        "scheduler_cpu_s_per_step_without_planning": round(cpu if in_process else cpu - dealing, 4),
        "data_plane_cpu_s_per_step": round(cpu + dealing if in_process else cpu, 4),
        "scheduler_cpu_share": round((cpu1 - cpu0) / (t1 - t0), 3),
        "scheduler_rss_mb": round(rss / 2**20, 1),
        "worker_connections": connections,
        "worker_connections_max": max(connections),
        "worker_bytes_per_step": int(sent_all[0] / total),
        "worker_parts_per_step": round(sent_all[1] / total, 1),
        "worker_peer_bytes_per_step": int(sent_all[2] / total),
        "worker_bytes_per_step_window": int((sent1[0] - sent0[0]) / steps),
        "fetch_wait_p50_ms": round(float(np.percentile(waits, 50)), 3) if len(waits) else None,
        "fetch_wait_p99_ms": round(float(np.percentile(waits, 99)), 3) if len(waits) else None,
        "agent_requests_per_step": round((req1 - req0) / steps, 1),
        "agent_calls_per_run": calls,
        "agent_connections_max": max(c for r in results for c in r["connections"]),
        "steps_planned_off_loop": stats.get("steps_planned_off_loop"),
        "planning_ms_p50": stats.get("planning_ms_p50"),
        "setup_s": round(t0 - t_start, 1),
    }


# ---------------------------------------------------------------------- dealing
def measure_planning(dp: int, docs: int, repeats: int = 5) -> tuple[float, float]:
    """Median ms to split one global batch of ``docs`` documents among ``dp`` groups (the
    data plane's own dealer, synthetic lengths), and its balance efficiency."""
    from omniload_dask.core.dealer import StepDealer
    from omniload_dask.plan import parse_plan

    seq = 8192
    plan = parse_plan(
        {
            "version": 1,
            "name": "p",
            "tokenizer": {"kind": "byte"},
            "batch": {"seq_len": seq, "micro_batches": 1, "global_tokens": dp * seq},
            "layout": {"dp": dp},
            "sources": [{"name": "a", "format": "jsonl", "path": "x.jsonl"}],
        }
    )
    dealer = StepDealer(plan)
    rng = np.random.default_rng(3)
    lengths = rng.lognormal(0, 1, docs)
    lengths = np.maximum(1, (lengths / lengths.sum() * dp * seq * 0.97).astype(np.int64))
    lengths = np.minimum(lengths, seq)
    src = np.zeros(docs, dtype=np.int64)
    times, eff = [], 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        split = dealer.assign(src, lengths)
        times.append((time.perf_counter() - t0) * 1e3)
        eff = float(split.efficiency)
    return float(np.median(times)), eff


def planning_figures() -> tuple[dict[str, float], dict[str, float]]:
    """``planning_ms`` (and balance efficiency) per case: ``benchmarks/dealing.py``'s
    measurement (the whole drawn step in the real coordinator) where it can be imported,
    else the split alone (:func:`measure_planning`)."""
    try:
        sys.path.insert(0, str(Path(__file__).parent))
        from dealing import measure as external  # type: ignore[import-not-found]
    except ImportError:
        external = None
    ms, eff = {}, {}
    for dp, docs in PLANNING_CASES:
        key = f"dp{dp}_docs{docs}"
        if external is not None:
            point = external(dp, docs, "balance", 4, 3)
            ms[key], eff[key] = point["step_ms"], point["efficiency_mean"]
        else:
            ms[key], eff[key] = measure_planning(dp, docs)
        ms[key], eff[key] = round(ms[key], 2), round(eff[key], 4)
    return ms, eff


# ---------------------------------------------------------------------- memory
def run_memory(args: argparse.Namespace, data: Path, steps: int, checkpoint: Path | None) -> dict:
    """Scheduler RSS over ``steps`` steps of a one-rank job, as fast as it goes.

    RSS is sampled 40 times; the growth is the least-squares slope of the samples from step
    ``MEMORY_SETTLED`` on (half the run if it is shorter): the job's rings of 4,096 steps
    fill before that, and Dask's logs of 1,000 messages even sooner. At the end the scheduler
    hands its free heap back to the system (``malloc_trim``), and RSS is read again: what
    that takes off is memory freed but kept by the allocator, not live data.
    """
    from omniload_dask import Feeder, Job, parse_plan

    name = "memck" if checkpoint is not None else "mem"
    plan = scale_plan(name, data, 1, 1, args.seq_len, 2)
    if checkpoint is not None:
        plan["checkpoint"] = {"url": str(checkpoint), "flush_seconds": 1, "compact_every": 1000}
    every = max(steps // 40, 1)
    settled = min(MEMORY_SETTLED, steps // 2)
    cluster = Cluster(2, 1)
    try:
        job = Job.start(parse_plan(plan), client=cluster.client)
        feeder = Feeder(name, address=cluster.address, rank=0, output="numpy")
        samples: list[tuple[int, int]] = []
        tasks: list[int] = []  # the scheduler's tasks once settled and at the end
        t0 = time.monotonic()
        for step, _ in enumerate(feeder.steps()):
            if step % every == 0 or step == steps - 1:
                samples.append((step, cluster.rss()))
            if step == settled:
                tasks.append(job.client.run_on_scheduler(_tasks))
            if step >= steps - 1:
                break
        seconds = time.monotonic() - t0
        tasks.append(job.client.run_on_scheduler(_tasks))
        job.client.run_on_scheduler(_malloc_trim)
        trimmed = cluster.rss()
        feeder.close()
        job.stop()
    finally:
        cluster.close()
    late = np.array([(s, r) for s, r in samples if s >= settled], dtype=np.float64)
    slope = float(np.polyfit(late[:, 0], late[:, 1], 1)[0])  # bytes a step
    return {
        "steps": steps,
        "checkpoint": checkpoint is not None,
        "steps_per_second": round(steps / seconds, 1),
        "load_average": round(os.getloadavg()[0], 1),
        "from_step": settled,
        "rss_mb_from": round(late[0, 1] / 2**20, 1),
        "rss_mb_end": round(samples[-1][1] / 2**20, 1),
        "rss_mb_end_after_trim": round(trimmed / 2**20, 1),
        "rss_growth_mb_per_100k_steps": round(slope * 100_000 / 2**20, 1),
        "scheduler_tasks": tasks,
    }


def _malloc_trim(dask_scheduler: Any) -> bool:
    import ctypes

    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except OSError:  # not glibc
        return False


def _tasks(dask_scheduler: Any) -> int:
    return len(dask_scheduler.tasks)


# ---------------------------------------------------------------------- main
def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--agent-host":
        return host_main()
    if len(sys.argv) > 1 and sys.argv[1] == "--real-host":
        return real_host_main()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--points", help="RANKSxTP,... or none (default: by --quick)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="read slots per worker")
    parser.add_argument("--hosts", type=int, default=4, help="processes the agents share")
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--prefetch", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--step-seconds", type=float, help="pace (default: by DP size)")
    parser.add_argument(
        "--groups-per-second", type=float, default=400, help="default pace: DP groups a second"
    )
    parser.add_argument("--real", type=int, default=0, help="also N real feeder threads")
    parser.add_argument("--memory", type=int, default=0, help="also a memory run of N steps")
    args = parser.parse_args()
    if args.quick:
        args.steps = min(args.steps, 8)
        args.warmup = min(args.warmup, 3)
    chosen = args.points or (QUICK_POINTS if args.quick else FULL_POINTS)
    points = (
        [] if chosen == "none" else [tuple(int(x) for x in p.split("x")) for p in chosen.split(",")]
    )
    result: dict[str, Any] = {
        "benchmark": "scale",
        "quick": args.quick,
        "workers": args.workers,
        "seq_len": args.seq_len,
        "cpu_count": os.cpu_count(),
    }
    result["planning_ms"], result["planning_efficiency"] = planning_figures()
    print("planning_ms", result["planning_ms"], flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        data = write_data(Path(tmp))
        result["points"] = []
        for ranks, tp in points:
            point = run_point(args, data, ranks, tp)
            print(json.dumps(point), flush=True)
            result["points"].append(point)
        if args.real:
            result["real"] = {
                "feeders": run_point(args, data, args.real, 1, real=True),
                "simulated": run_point(args, data, args.real, 1, per_node=1),
            }
            print(json.dumps(result["real"]), flush=True)
        if args.memory:
            result["memory"] = [
                run_memory(args, data, args.memory, None),
                run_memory(args, data, args.memory, Path(tmp) / "ckpt"),
            ]
            print(json.dumps(result["memory"]), flush=True)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()

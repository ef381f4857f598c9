"""What a Dask scheduler costs by itself: the floor under omniload-dask's scheduler CPU per step.

    python benchmarks/scheduler_floor.py [--quick] [--tasks 400] [--calls 2000] [--idle 20]

Starts a cluster the way the README does (``dask scheduler --preload omniload_dask.preload``
and two ``dask worker ... --preload omniload_dask.preload``, this tree on their PYTHONPATH)
and measures the scheduler process's CPU (user + system, all its threads):

- **idle**: no job, no client work, per second of wall time (heartbeats, periodic callbacks);
- **per task**: a client *inside the scheduler process* (as the data plane's is) submits tiny
  tasks one at a time, waits for each and releases it: what one task costs the scheduler
  end to end (update_graph, transitions, the messages to and from the worker and the client),
  the idle rate taken out;
- **per call**: a plain RPC (``omniload_jobs``, a handler that does next to nothing) from
  another process over TCP, as a fetching agent asks: what one request costs, idle taken out.

A step of the data plane costs at least ``tasks/step x per task + calls/step x per call +
idle / steps per second``. Prints one line per figure and, last, ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


async def _tasks_here(dask_scheduler: Any, n: int) -> float:
    """On the scheduler: submit ``n`` tiny tasks one at a time from a client in this process;
    the scheduler process's CPU seconds over them."""
    from operator import neg  # pickled by reference, as the loader's task functions are

    from distributed import Client

    client = await Client(dask_scheduler.address, asynchronous=True, set_as_default=False)
    try:
        for i in range(20):  # warm up (imports, first messages)
            await client.submit(neg, i, key=f"floor-warm-{i}", pure=False)
        start = time.process_time()
        for i in range(n):
            fut = client.submit(neg, i, key=f"floor-{i}", pure=False)
            await fut
            fut.release()
        return time.process_time() - start
    finally:
        await client.close()


def _cpu(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=400)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--idle", type=float, default=20.0, help="seconds of idle measured")
    parser.add_argument("--quick", action="store_true", help="100 tasks, 500 calls, 5 s idle")
    args = parser.parse_args()
    if args.quick:
        args.tasks, args.calls, args.idle = 100, 500, 5.0

    from distributed import Client
    from distributed.core import rpc
    from head_to_head import ReadmeCluster

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get(
        "PYTHONPATH", "")])}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="omniload-floor-") as logs:
        cluster = ReadmeCluster(2, Path(logs), env)
        try:
            pid = cluster.scheduler.pid
            time.sleep(3)
            a, t0 = _cpu(pid), time.monotonic()
            time.sleep(args.idle)
            idle = (_cpu(pid) - a) / (time.monotonic() - t0)
            print(f"idle: {idle * 1e3:.2f} ms of scheduler CPU per second", flush=True)

            with Client(cluster.address, timeout=60) as client:
                t0 = time.monotonic()
                cpu = client.run_on_scheduler(_tasks_here, n=args.tasks)
                wall = time.monotonic() - t0
            per_task = (cpu - idle * wall) / args.tasks
            print(f"per task: {per_task * 1e3:.3f} ms ({args.tasks} tasks, {wall:.1f} s)")

            async def calls() -> float:
                r = rpc(cluster.address)
                try:
                    for _ in range(20):
                        await r.omniload_jobs()
                    a, t0 = _cpu(pid), time.monotonic()
                    for _ in range(args.calls):
                        await r.omniload_jobs()
                    return (_cpu(pid) - a - idle * (time.monotonic() - t0)) / args.calls
                finally:
                    await r.close_rpc()

            per_call = asyncio.run(calls())
            print(f"per call: {per_call * 1e3:.3f} ms ({args.calls} calls)")
        finally:
            cluster.close()
    out = {
        "benchmark": "scheduler_floor",
        "quick": args.quick,
        "idle_ms_per_s": round(idle * 1e3, 3),
        "task_ms": round(per_task * 1e3, 4),
        "call_ms": round(per_call * 1e3, 4),
        "load": os.getloadavg(),
    }
    print("RESULT " + json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

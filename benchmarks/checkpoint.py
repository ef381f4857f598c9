"""Checkpoint cost, restart time, and feeder stall when a worker dies.

    python benchmarks/checkpoint.py [--quick]

1. Delta size and save time: the demo plan (3 sources, DP 4) runs on an embedded cluster with a
   checkpoint in a temp folder, feeders consuming as fast as they can; reported: bytes per step
   (deltas, plus bases and manifests amortised), flush time per step (in a thread, off the data
   plane's loop), and the feeders' wait p50/p99 with and without checkpointing.
   The same delta size is also measured for 300 synthetic sources (no I/O).
2. Restart: time from ``Job.start(resume=True)`` (a fresh cluster) to the first micro-batch,
   against a fresh job's time to first batch.
3. Worker loss: 3 workers, ranks that spend ``--step-ms`` per step (a stand-in for training),
   one worker killed with SIGKILL; reported: the longest wait for a step after the kill, in ms
   and in steps, and whether the delivered stream equals the uninterrupted one.

Targets (DESIGN.md): <= 1 KiB delta per step, <= 5 ms save per step, never blocking a feeder;
feeders stall at most one step when a worker dies. Ends with ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from omniload_dask import Job, parse_plan
from omniload_dask.checkpoint import Checkpoint
from omniload_dask.core.events import ReadReported, StepsRequested
from omniload_dask.demo import demo_sources, demo_tokenizer, make_demo_data
from omniload_dask.testing import InlineDataPlane


def demo_plan(data: Path, name: str, checkpoint: str | None, dp: int = 4) -> dict:
    plan = {
        "version": 1,
        "name": name,
        "seed": 5,
        "tokenizer": demo_tokenizer(data),
        "batch": {"seq_len": 2048, "micro_batches": 2, "global_tokens": 2048 * 2 * dp},
        "layout": {"dp": dp},
        "on_error": "skip",
        "loader": {"prefetch": 2},
        "sources": demo_sources(data, web_unit_bytes="1MiB"),
    }
    if checkpoint:
        plan["checkpoint"] = {"url": checkpoint, "flush_seconds": 1.0}
    return plan


def consume(job: Job, steps: int, step_ms: float = 0.0, kill_at: int | None = None) -> dict:
    """All ranks in lockstep threads; optional per-step sleep and a worker kill."""
    ranks = job.plan.layout.world_size
    feeders = [job.feeder(rank=r, output="numpy") for r in range(ranks)]
    waits: list[list[float]] = [[] for _ in range(ranks)]
    digests: list[list[tuple]] = [[] for _ in range(ranks)]
    barrier = threading.Barrier(ranks)
    killed: list[float] = []

    def run(r: int) -> None:
        it = feeders[r].steps()
        for t in range(steps):
            t0 = time.perf_counter()
            step = next(it)
            waits[r].append(time.perf_counter() - t0)
            digests[r].append(tuple(int(x) for mb in step for x in mb["doc_id"]))
            if step_ms:
                time.sleep(step_ms / 1e3)
            barrier.wait()
            if r == 0 and kill_at is not None and t == kill_at:
                pids = job.client.run(os.getpid)
                victim = sorted(pids)[0]
                os.kill(pids[victim], signal.SIGKILL)
                killed.append(time.perf_counter())
            barrier.wait()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(ranks)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    all_waits = np.concatenate([np.asarray(w[2:]) for w in waits])
    out = {
        "seconds": elapsed,
        "wait_p50_ms": float(np.percentile(all_waits, 50) * 1e3),
        "wait_p99_ms": float(np.percentile(all_waits, 99) * 1e3),
        "digests": digests,
    }
    if kill_at is not None:
        after = np.concatenate([np.asarray(w[kill_at + 1 :]) for w in waits])
        before = np.concatenate([np.asarray(w[2 : kill_at + 1]) for w in waits])
        out.update(
            max_wait_after_kill_ms=float(after.max() * 1e3),
            max_wait_before_kill_ms=float(before.max() * 1e3),
        )
    for f in feeders:
        f.close()
    return out


def delta_size_300_sources(steps: int) -> float:
    """Compressed delta bytes per step of a 300-source mix (synthetic lengths, no I/O)."""
    sys.path.insert(0, str(Path(__file__).parent))
    import mixing  # the synthetic 300-source data plane of the mixing benchmark

    plan, catalogs, medians = mixing.synthetic_plan(
        300, 8, {"global_tokens": 8 * 4 * 8192}, "tokens"
    )
    from omniload_dask.core.coordinator import Coordinator, SubmitRead

    coord = Coordinator(plan, catalogs, "bench")
    rng = np.random.default_rng(1)
    sizes = []
    for t in range(steps):
        for r in range(plan.layout.world_size):
            coord.handle(StepsRequested(r, t, 1))
        for _ in range(50):
            for a in coord.advance(max_steps=1):
                if isinstance(a, SubmitRead):
                    lengths = np.clip(
                        rng.lognormal(np.log(medians[a.read.source]), 0.9, 400), 8, 60000
                    ).astype(np.int32)
                    coord.handle(ReadReported(a.read.key, lengths, 0))
            if coord.view.next_step > t:
                break
        sizes += [
            json.dumps(d, separators=(",", ":")).encode() + b"\n"
            for d in coord.take_deltas()
            if "step" in d
        ]
    # as the writer stores them: zstd-compressed segments (here one per 10 steps)
    import zstandard

    packed = sum(
        len(zstandard.ZstdCompressor(level=3).compress(b"".join(sizes[i : i + 10])))
        for i in range(0, len(sizes), 10)
    )
    return packed / len(sizes)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--step-ms",
        type=float,
        default=100.0,
        help="simulated training time per step in the worker-loss run",
    )
    args = parser.parse_args()
    steps = 60 if args.quick else 300
    root = Path(tempfile.mkdtemp(prefix="omniload-ckpt-bench-"))
    data = make_demo_data(Path(tempfile.gettempdir()) / "omniload-bench" / "scale1", scale=1.0)

    # 1. delta size and save time, and feeder waits with / without checkpointing
    url = str(root / "ckpt")
    with Job.start(parse_plan(demo_plan(data, "ckpt", url)), dashboard_address=None) as job:
        on = consume(job, steps)
        job.flush_checkpoint()
        stats = job.stats()["checkpoint"]
    saved = Checkpoint(url)
    delta_bytes = sum(s["bytes"] for s in saved.manifest.segments)
    with Job.start(parse_plan(demo_plan(data, "plain", None)), dashboard_address=None) as job:
        off = consume(job, steps)

    # 2. restart from the checkpoint vs a fresh start, to the first batch
    t0 = time.perf_counter()
    with Job.start(
        parse_plan(demo_plan(data, "ckpt", url)), resume=True, dashboard_address=None
    ) as job:
        next(job.feeder(rank=0, output="numpy"))
        restart_s = time.perf_counter() - t0
        resumed_at = job.info["start_step"]
    t0 = time.perf_counter()
    with Job.start(parse_plan(demo_plan(data, "fresh", None)), dashboard_address=None) as job:
        next(job.feeder(rank=0, output="numpy"))
        fresh_s = time.perf_counter() - t0

    # 3. a worker killed mid-run, ranks spending step_ms per step
    kill_steps = 30 if args.quick else 60
    ref = InlineDataPlane(parse_plan(demo_plan(data, "kill", None, dp=2)))
    expected = [
        [
            tuple(int(x) for mb in bs[g].micro_batches for x in mb["doc_id"])
            for _, bs in ref.stream(kill_steps)
        ]
        for g in range(2)
    ]
    expected = [[e[t] for t in range(kill_steps)] for e in expected]
    with Job.start(
        parse_plan(demo_plan(data, "kill", None, dp=2)), workers=3, dashboard_address=None
    ) as job:
        kill = consume(job, kill_steps, step_ms=args.step_ms, kill_at=kill_steps // 3)
    exact = kill["digests"] == expected

    per_step = stats["bytes_per_step"]
    result = {
        "benchmark": "checkpoint",
        "quick": args.quick,
        "steps": steps,
        "load_average": round(os.getloadavg()[0], 2),
        "delta_bytes_per_step": round(delta_bytes / stats["steps_written"], 1),
        "delta_bytes_per_step_300_sources": round(
            delta_size_300_sources(20 if args.quick else 60), 1
        ),
        "all_bytes_per_step": round(per_step, 1),
        "save_ms_per_step": round(stats["flush_seconds_per_step"] * 1e3, 4),
        "wait_p50_ms_with_checkpoint": round(on["wait_p50_ms"], 3),
        "wait_p99_ms_with_checkpoint": round(on["wait_p99_ms"], 3),
        "wait_p50_ms_without": round(off["wait_p50_ms"], 3),
        "wait_p99_ms_without": round(off["wait_p99_ms"], 3),
        "restart_to_first_batch_s": round(restart_s, 3),
        "resumed_at_step": resumed_at,
        "fresh_start_to_first_batch_s": round(fresh_s, 3),
        "step_ms": args.step_ms,
        "max_wait_after_kill_ms": round(kill["max_wait_after_kill_ms"], 1),
        "max_wait_before_kill_ms": round(kill["max_wait_before_kill_ms"], 1),
        "stall_steps": round(kill["max_wait_after_kill_ms"] / args.step_ms, 2),
        "stream_exact_after_kill": exact,
    }
    print(
        f"delta per step: {result['delta_bytes_per_step']} B (3 sources), "
        f"{result['delta_bytes_per_step_300_sources']} B (300 sources); all files "
        f"{result['all_bytes_per_step']} B/step; save {result['save_ms_per_step']} ms/step "
        "(in a thread)"
    )
    print(
        f"feeder wait p50/p99: {result['wait_p50_ms_with_checkpoint']}/"
        f"{result['wait_p99_ms_with_checkpoint']} ms with checkpoints, "
        f"{result['wait_p50_ms_without']}/{result['wait_p99_ms_without']} ms without"
    )
    print(f"restart to first batch: {restart_s:.2f} s (fresh start: {fresh_s:.2f} s)")
    print(
        f"worker killed: longest wait {result['max_wait_after_kill_ms']} ms "
        f"({result['stall_steps']} steps of {args.step_ms:g} ms; before the kill "
        f"{result['max_wait_before_kill_ms']} ms); stream exact: {exact}"
    )
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Delivered tokens/s through feeders vs the read+tokenize limit of plain processes.

    python benchmarks/throughput.py [--quick] [--workers 2] [--ranks 4] [--tokenizer words|bpe]

In one run, on the same data and tokenizer:

1. the limit: P plain processes (P = 1 and P = workers) that only read and tokenize every read
   unit of the data once (the same reader and tokenizer code the loader's tasks run), no
   mixing, packing or transport; tokens/s = all tokens / the slowest process's time;
2. omniload-dask: an embedded LocalCluster with ``workers`` worker processes and ``ranks``
   simulated trainer ranks (feeder threads consuming as fast as they can) drawing about the same
   number of tokens (twice that without ``--quick``); tokens/s from the first batch to the last,
   over the second half of the delivered tokens (once every source's read-ahead window is full:
   the start fills windows of whole read units, work that later steps consume), and overall.
   Also the tokens the workers read against the tokens delivered (read-ahead still held at
   the end of the run is read but not delivered).

Also: time to first batch from launch (cluster start included) and the feeders' wait per
micro-batch (p50/p99, warm: after the first 10% of micro-batches). Ends with ``RESULT {json}``.

Tokenizer (``--tokenizer``): ``bpe`` (the default), a byte-level BPE trained on the demo data
and padded to Llama 3's 128,256 ids, the kind of tokenizer LLMs are trained with (about 1.6x
the CPU per token of the other here, and the same token counts); or ``words``, the demo data's
word-level tokenizer (a lookup in a 4k-word vocabulary: so cheap per token that everything
besides tokenizing weighs more).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from omniload_dask import Job, parse_plan
from omniload_dask.cluster import tasks
from omniload_dask.demo import demo_sources, demo_tokenizer, make_demo_data


def bench_plan(
    data: Path, ranks: int, workers: int, seq_len: int = 8192, micro_batches: int = 8
) -> dict:
    return {
        "version": 1,
        "name": "bench",
        "seed": 1,
        "tokenizer": demo_tokenizer(data),
        "batch": {"seq_len": seq_len, "micro_batches": micro_batches},
        "layout": {"dp": ranks},
        "on_error": "skip",
        "loader": {"workers": workers, "prefetch": 4, "lookahead": 4},
        "sources": demo_sources(data, web_unit_bytes="2MiB"),
    }


def _read_units(args: tuple[dict, list[tuple[int, int, str, int, int]]]) -> tuple[int, float]:
    plan_data, units = args
    plan = parse_plan(plan_data)
    tasks.read_unit(plan.sources[0], 0, plan.tokenizer, "skip", 0, *units[0][2:])  # warm
    t0 = time.perf_counter()
    total = 0
    for src, fidx, url, lo, hi in units:
        shard = tasks.read_unit(plan.sources[src], src, plan.tokenizer, "skip", fidx, url, lo, hi)
        total += len(shard.tokens)
    return total, time.perf_counter() - t0


def read_limit(plan_data: dict, processes: int) -> dict:
    """Tokens/s of ``processes`` plain processes reading+tokenizing every unit once."""
    plan = parse_plan(plan_data)
    units = []
    for i, spec in enumerate(plan.sources):
        cat = tasks.discover(spec)
        units += [(i, int(f), cat.files[f], int(lo), int(hi)) for f, lo, hi in cat.units]
    units.sort(key=lambda u: (u[2], u[3]))
    parts = [units[p::processes] for p in range(processes)]
    with mp.get_context("spawn").Pool(processes) as pool:
        results = pool.map(_read_units, [(plan_data, part) for part in parts])
    tokens = sum(r[0] for r in results)
    seconds = max(r[1] for r in results)
    return {
        "processes": processes,
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
    }


def bpe_tokenizer(data: Path, plan_data: dict) -> Path:
    """A byte-level BPE trained on the data's first units (every source), padded to 128,256
    ids (``manysources.bpe_from_texts``); written once next to the data."""
    path = data / "tokenizer-bpe.json"
    if path.exists():
        return path
    from support.manysources import (
        bpe_from_texts,  # benchmarks/ is on the path: this script's folder
    )

    from omniload_dask.sources.registry import read_unit_records

    sample: list[str] = []
    for spec in parse_plan(plan_data).sources:
        cat = tasks.discover(spec)
        chars = 0
        for f, lo, hi in cat.units.tolist():
            texts = read_unit_records(spec, cat.files[f], lo, hi).texts
            sample += texts
            chars += sum(map(len, texts))
            if chars > 3_000_000:
                break
    bpe_from_texts(path, sample)
    return path


def _cpu_seconds() -> tuple[float, float]:
    """CPU seconds so far of this process and of its child processes (the workers)."""
    import psutil

    me = psutil.Process()
    own = me.cpu_times()
    children = 0.0
    for child in me.children(recursive=True):
        try:
            t = child.cpu_times()
            children += t.user + t.system
        except psutil.Error:
            pass
    return own.user + own.system, children


def _rank_process(job: str, address: str, rank: int, steps: int, out: Any) -> None:
    """A trainer rank of its own (``--rank-processes``): consume, then report marks and waits."""
    from omniload_dask import Feeder

    feeder = Feeder(job, address=address, rank=rank, max_steps=steps, output="numpy")
    marks = []
    for mb in feeder:
        marks.append((time.time(), int(mb["num_tokens"])))
        if len(marks) == 1:
            out.put(("first", rank, marks[0][0]))
    out.put(("done", rank, (marks, list(feeder.waits))))
    feeder.close()


def run_loader(plan_data: dict, target_tokens: int, rank_processes: bool = False) -> dict:
    plan = parse_plan(plan_data)
    budget = plan.batch.global_tokens or 1
    steps = max(8, int(target_tokens / budget))
    t_launch = time.time()
    job = Job.start(plan, dashboard_address=None)
    started = time.time() - t_launch
    ranks = plan.layout.world_size
    first: list[float | None] = [None] * ranks
    tokens = np.zeros(ranks, dtype=np.int64)
    marks: list[list[tuple[float, int]]] = [[] for _ in range(ranks)]
    cpu_at_first: list[tuple[float, float, float]] = []
    lock = threading.Lock()
    if rank_processes:
        # Each rank in its own process, as trainers are: their CPU counts with the workers'
        # (children of this process); the first batch's CPU mark is taken when it is reported.
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        address = job.client.scheduler_info()["address"]
        procs = [
            ctx.Process(target=_rank_process, args=(job.name, address, r, steps, queue))
            for r in range(ranks)
        ]
        for proc in procs:
            proc.start()
        all_waits: list[list[float]] = [[] for _ in range(ranks)]
        done = 0
        while done < ranks:
            kind, r, payload = queue.get()
            if kind == "first":
                if not cpu_at_first:  # the first batch of any rank: start the CPU count
                    cpu_at_first.append((payload, *_cpu_seconds()))
                continue
            marks[r], all_waits[r] = payload
            first[r] = marks[r][0][0] if marks[r] else None
            tokens[r] = sum(n for _, n in marks[r])
            done += 1
        end = max(m[-1][0] for m in marks if m)
        cpu_end = _cpu_seconds()
        for proc in procs:
            proc.join()
        waits = np.concatenate([np.asarray(w) for w in all_waits])
        warm = np.concatenate([np.asarray(w)[len(w) // 10 :] for w in all_waits])
    else:
        feeders = [job.feeder(rank=r, max_steps=steps, output="numpy") for r in range(ranks)]

        def consume(r: int) -> None:
            for mb in feeders[r]:
                now = time.time()
                if first[r] is None:
                    first[r] = now
                    with lock:
                        if not cpu_at_first:
                            cpu_at_first.append((now, *_cpu_seconds()))
                tokens[r] += int(mb["num_tokens"])
                marks[r].append((now, int(mb["num_tokens"])))

        threads = [threading.Thread(target=consume, args=(r,)) for r in range(ranks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        end = time.time()
        cpu_end = _cpu_seconds()
        waits = np.concatenate([np.asarray(f.waits) for f in feeders])
        warm = np.concatenate([np.asarray(f.waits)[len(f.waits) // 10 :] for f in feeders])
    stats = job.stats()
    job.close()
    first_batch = min(t for t in first if t is not None)
    assert first_batch is not None
    total = int(tokens.sum())
    timeline = np.array(sorted(m for rank in marks for m in rank))
    cum = np.cumsum(timeline[:, 1])
    half = int(np.searchsorted(cum, total / 2))
    t_half = float(timeline[half, 0])
    second_half = total - int(cum[half])
    tokens_read = sum(int(s.get("tokens_read") or 0) for s in stats["sources"])
    return {
        "steps": steps,
        "ranks": ranks,
        "tokens": total,
        "startup_s": started,
        "first_batch_s": first_batch - t_launch,
        "steady_s": end - first_batch,
        "total_s": end - t_launch,
        "tokens_per_s_steady": total / (end - first_batch),
        "tokens_per_s_total": total / (end - t_launch),
        "tokens_per_s_second_half": second_half / max(end - t_half, 1e-9),
        "tokens_read": tokens_read,
        # CPU cores busy from the first batch to the end: this process (scheduler, data plane,
        # feeders: the control plane shares the 2 cores with the workers here) and the workers.
        "driver_cpu_cores": (cpu_end[0] - cpu_at_first[0][1]) / (end - cpu_at_first[0][0]),
        "workers_cpu_cores": (cpu_end[1] - cpu_at_first[0][2]) / (end - cpu_at_first[0][0]),
        "wait_p50_ms": float(np.percentile(warm, 50) * 1e3),
        "wait_p99_ms": float(np.percentile(warm, 99) * 1e3),
        "wait_p50_ms_all": float(np.percentile(waits, 50) * 1e3),
        "efficiency_mean": stats["efficiency_mean"],
        "extra_micro_steps": stats["extra_micro_steps"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small data, under a minute")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--data", help="folder for the generated data (default: a temp dir)")
    parser.add_argument("--seq-len", type=int, default=8192, help="tokens per sequence")
    parser.add_argument(
        "--tokenizer",
        choices=("bpe", "words"),
        default="bpe",
        help="bpe (default): byte-level BPE of Llama 3's size; words: the demo's word-level one",
    )
    parser.add_argument(
        "--rank-processes",
        action="store_true",
        help="each simulated rank in its own process (default: threads of this process)",
    )
    parser.add_argument(
        "--micro-batches", type=int, default=8, help="micro-batches per rank and step"
    )
    args = parser.parse_args()
    scale = 2.0 if args.quick else 8.0
    root = Path(args.data) if args.data else Path(tempfile.gettempdir()) / "omniload-bench"
    data = make_demo_data(root / f"scale{scale:g}", scale=scale)
    plan_data = bench_plan(data, args.ranks, args.workers, args.seq_len, args.micro_batches)
    if args.tokenizer == "bpe":
        plan_data["tokenizer"]["path"] = str(bpe_tokenizer(data, plan_data))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    one = read_limit(plan_data, 1)
    limit = read_limit(plan_data, args.workers)
    loader = run_loader(plan_data, limit["tokens"] * (1 if args.quick else 2), args.rank_processes)
    ratio = loader["tokens_per_s_steady"] / limit["tokens_per_s"]
    result = {
        "benchmark": "throughput",
        "quick": args.quick,
        "workers": args.workers,
        "ranks": args.ranks,
        "seq_len": args.seq_len,
        "micro_batches": args.micro_batches,
        "tokenizer": args.tokenizer,
        "rank_processes": args.rank_processes,
        "tokens_per_step": args.ranks * args.micro_batches * args.seq_len,
        "limit_1proc_tokens_per_s": round(one["tokens_per_s"]),
        "limit_tokens_per_s": round(limit["tokens_per_s"]),
        "loader_tokens_per_s_steady": round(loader["tokens_per_s_steady"]),
        "loader_tokens_per_s_total": round(loader["tokens_per_s_total"]),
        "ratio_vs_limit": round(ratio, 3),
        "ratio_total_vs_limit": round(loader["tokens_per_s_total"] / limit["tokens_per_s"], 3),
        "loader_tokens_per_s_second_half": round(loader["tokens_per_s_second_half"]),
        "ratio_second_half_vs_limit": round(
            loader["tokens_per_s_second_half"] / limit["tokens_per_s"], 3
        ),
        "driver_cpu_cores": round(loader["driver_cpu_cores"], 2),
        "workers_cpu_cores": round(loader["workers_cpu_cores"], 2),
        "tokens_read_per_delivered": round(loader["tokens_read"] / max(loader["tokens"], 1), 3),
        "first_batch_s": round(loader["first_batch_s"], 3),
        "startup_s": round(loader["startup_s"], 3),
        "wait_p50_ms": round(loader["wait_p50_ms"], 4),
        "wait_p99_ms": round(loader["wait_p99_ms"], 3),
        "tokens": loader["tokens"],
        "steps": loader["steps"],
        "efficiency_mean": round(loader["efficiency_mean"] or 0, 4),
        "cpu_count": os.cpu_count(),
    }
    print(f"read+tokenize limit, 1 process:        {one['tokens_per_s']:>12,.0f} tokens/s")
    print(
        f"read+tokenize limit, {args.workers} processes:      "
        f"{limit['tokens_per_s']:>12,.0f} tokens/s"
    )
    print(
        f"omniload-dask, {args.ranks} ranks, steady:        "
        f"{loader['tokens_per_s_steady']:>12,.0f} tokens/s  ({ratio:.2f} of the limit)"
    )
    half = loader["tokens_per_s_second_half"]
    print(
        f"omniload-dask, second half of tokens:  {half:>12,.0f} tokens/s  "
        f"({half / limit['tokens_per_s']:.2f} of the limit)"
    )
    print(f"omniload-dask, including start-up:     {loader['tokens_per_s_total']:>12,.0f} tokens/s")
    print(f"tokens read by workers per delivered:  {result['tokens_read_per_delivered']:>12.3f}")
    print(
        f"CPU cores busy (steady): driver {loader['driver_cpu_cores']:.2f} (scheduler, data "
        f"plane{'' if args.rank_processes else ', feeders'}), "
        f"workers {loader['workers_cpu_cores']:.2f}"
        + (" (and the rank processes)" if args.rank_processes else "")
    )
    print(f"first batch after launch:              {loader['first_batch_s']:>12.2f} s")
    print(
        f"feeder wait (warm) p50 / p99:          {loader['wait_p50_ms']:>9.3f} ms / "
        f"{loader['wait_p99_ms']:.2f} ms"
    )
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

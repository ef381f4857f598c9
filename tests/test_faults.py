"""Surviving worker loss, trainer rank restarts and scheduler loss; resuming from checkpoints."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from omniload_dask import Feeder, Job
from omniload_dask.cluster.standby import is_standby_key
from omniload_dask.core.blocks import block_of, steps_per_task
from omniload_dask.testing import InlineDataPlane

from .conftest import make_plan
from .test_checkpoint import pieces


def digest(mb) -> tuple:
    return (
        tuple(mb["input_ids"].tolist())
        + tuple(mb["doc_id"].tolist())
        + tuple(mb["cu_seqlens"].tolist())
    )


def reference(plan, steps):
    plane = InlineDataPlane(plan)
    return {
        t: {g: [digest(mb) for mb in b.micro_batches] for g, b in bs.items()}
        for t, bs in plane.stream(steps)
    }


def take(feeders, n, out, waits=None):
    """Advance every rank by ``n`` steps, ranks in lockstep (as trainer ranks are)."""
    for _ in range(n):
        for g, f in enumerate(feeders):
            t0 = time.perf_counter()
            step = next(f.steps())
            if waits is not None:
                waits.append(time.perf_counter() - t0)
            out.setdefault(step[0]["step"], {})[g] = [digest(mb) for mb in step]


def _settled(dask_scheduler, standby: bool = True) -> bool:
    """Every job's data plane at rest (nothing left to draw, no step dealing, no block of
    several steps being gathered), no task runs or waits, and (``standby``) every batch and
    shard in memory has two copies."""
    for run in dask_scheduler.plugins["omniload"].jobs.values():
        coord = run.coord
        if run._dealt_soon is not None or coord.components.delivery.offered_step is not None:
            return False  # a construction is still to come
        if (
            coord.view.end_step is None
            and coord.view.next_step < coord.components.delivery.draw_target()
        ):
            return False
    for key, ts in dask_scheduler.tasks.items():
        if ts.state in ("processing", "waiting", "queued", "no-worker"):
            return False
        if standby and is_standby_key(key) and ts.state == "memory" and len(ts.who_has or ()) < 2:
            return False
    return True


def wait_settled(job, timeout: float = 60.0, standby: bool = True) -> None:
    deadline = time.monotonic() + timeout
    while not job.client.run_on_scheduler(_settled, standby=standby):
        assert time.monotonic() < deadline, (
            "the job did not settle, or its standby copies did not land"
        )
        time.sleep(0.05)


@pytest.mark.slow
def test_killing_a_worker_process_costs_at_most_one_step(small_sources):
    # kill -9 of a worker process (its nanny starts a new one). Every upcoming batch and shard
    # has a standby copy by then, so nothing is recomputed, and each rank tries the dead
    # worker at most once before it takes the standby copy: at most one step waits on the
    # fault, and on a fetch retry, not on a rebuild.
    plan = make_plan(
        small_sources,
        name="kill",
        batch={"seq_len": 128, "global_tokens": 1024},
        loader={"prefetch": 2},
    )
    ref = reference(plan, 30)
    with Job.start(plan, workers=3, dashboard_address=None) as job:
        feeders = [job.feeder(dp_rank=g, output="numpy") for g in range(2)]
        got: dict = {}
        take(feeders, 8, got)
        wait_settled(job)
        pids = job.client.run(os.getpid)
        victim = sorted(pids)[0]
        os.kill(pids[victim], signal.SIGKILL)
        waits: list[float] = []
        take(feeders, 22, got, waits)
        stats = job.stats()
        failed = [f._link.failed_fetches for f in feeders]
    assert got == ref
    assert stats["batches_recomputed"] == 0
    assert stats["reads_recomputed"] == 0
    assert max(failed) <= 1, (failed, [list(f._link.fetch_errors) for f in feeders])
    print(f"longest wait for a step after the kill: {max(waits) * 1e3:.0f} ms")


async def _connect_after_drop(address: str, dask_worker=None) -> str:
    """Tell the worker ``address`` left, then start connecting there (nobody listens: Dask
    would retry until its 30 s connect timeout); say how the attempt ended."""
    dask_worker.plugins["omniload-parts"].peer_gone(address)
    await asyncio.sleep(0.05)  # the attempt starts after the word came (an older who_has)
    try:
        await asyncio.wait_for(dask_worker.rpc.connect(address), 20)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "connected"


def _peers_gone(dask_worker) -> list[str]:
    return list(dask_worker.plugins["omniload-parts"].peers_gone)


@pytest.mark.slow
def test_a_killed_worker_is_dropped_by_the_others_at_once(small_sources):
    # A construction fetching a shard from a worker that just died would retry the refused
    # connection for Dask's connect timeout (30 s) before asking where else the shard is. The
    # data plane tells every worker when one leaves, and that fails such attempts at once.
    plan = make_plan(small_sources, name="peers")
    with Job.start(plan, workers=3, dashboard_address=None) as job:
        with job.feeder(dp_rank=0, output="numpy", max_steps=1) as f:
            list(f)
        pids = job.client.run(os.getpid)
        victim, *others = sorted(pids)
        ended = job.client.run(_connect_after_drop, f"tcp://127.0.0.1:{free_port()}",
                               workers=[others[0]])  # fmt: skip
        assert "left the cluster" in ended[others[0]], ended
        os.kill(pids[victim], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while True:
            told = job.client.run(_peers_gone, workers=others)
            if all(victim in gone for gone in told.values()):
                break
            assert time.monotonic() < deadline, told
            time.sleep(0.05)


@pytest.mark.slow
def test_a_trainer_rank_that_restarts_gets_its_batches_from_its_saved_state(small_sources):
    plan = make_plan(small_sources, name="rankrestart")
    ref = reference(plan, 14)
    with Job.start(plan, workers=2, dashboard_address=None) as job:
        a = job.feeder(dp_rank=0, output="numpy")
        b = job.feeder(dp_rank=1, output="numpy")
        got: dict = {}
        take([a, b], 4, got)
        saved = b.state_dict()  # the trainer's checkpoint of rank 1
        take([a, b], 3, got)
        b.close()  # rank 1 dies; rank 0 runs on as far as the data plane lets it
        take([a], 3, got)
        again = job.feeder(dp_rank=1, output="numpy")
        again.load_state_dict(saved)
        redo: dict = {}
        take([again], 10, redo)
        take([a], 4, got)
    for t in range(14):
        assert got[t][0] == ref[t][0]
    for t, groups in redo.items():
        assert groups[0] == ref[t][1]  # rank 1 again, from its saved step on
    assert min(redo) == saved["step"]


@pytest.mark.slow
def test_resume_from_a_checkpoint_with_other_workers_and_dp_size(small_sources, tmp_path):
    url = str(tmp_path / "ckpt")
    plan = make_plan(
        small_sources, name="elastic", checkpoint={"url": url}, batch={"global_tokens": 2048}
    )
    ref = {
        t: pieces(bs)
        for t, bs in InlineDataPlane(
            make_plan(small_sources, name="elastic", batch={"global_tokens": 2048})
        ).stream(16)
    }
    with Job.start(plan, workers=2, dashboard_address=None) as job:
        feeders = [job.feeder(dp_rank=g, output="numpy") for g in range(2)]
        for _ in range(6):
            for f in feeders:
                next(f.steps())
        states = [f.state_dict() for f in feeders]
        job.flush_checkpoint()
    resume_at = min(s["step"] for s in states)
    with Job.start(plan, workers=3, dp=4, resume=resume_at, dashboard_address=None) as job:
        assert job.info["resumed"] and job.info["start_step"] == resume_at
        feeders = [job.feeder(dp_rank=g, output="numpy") for g in range(4)]
        for t in range(resume_at, 16):
            step = {}
            for g, f in enumerate(feeders):
                step[g] = next(f.steps())
            delivered = sorted(
                (int(d), tok)
                for g in step
                for mb in step[g]
                for d, o, n in zip(
                    mb["doc_id"],
                    mb["doc_offset"],
                    (mb["cu_seqlens"][1:] - mb["cu_seqlens"][:-1]),
                    strict=True,
                )
                for tok in range(int(o), int(o) + int(n))
            )
            assert delivered == ref[t], t


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_feeders_survive_the_scheduler_and_continue_exactly(small_sources, tmp_path):
    plan = make_plan(
        small_sources,
        name="schedloss",
        checkpoint={"url": str(tmp_path / "ckpt"), "flush_seconds": 0.2},
        layout={"dp": 1},
    )
    ref = reference(make_plan(small_sources, name="schedloss", layout={"dp": 1}), 16)
    port = free_port()
    job = Job.start(plan, workers=2, scheduler_port=port, dashboard_address=None)
    address = job.client.scheduler.address
    feeder = Feeder("schedloss", address=address, dp_rank=0, output="numpy", reconnect_timeout=120)
    got: dict = {}
    take([feeder], 5, got)
    job.flush_checkpoint()
    job.cluster.close()  # the scheduler and its workers are gone
    job.client.close()
    again = Job.start(plan, workers=2, scheduler_port=port, resume=True, dashboard_address=None)
    try:
        assert again.info["resumed"] and again.info["run_id"] != job.info["run_id"]
        take([feeder], 11, got)
    finally:
        feeder.close()
        again.close()
    assert got == {t: ref[t] for t in range(16)}


class Collect(logging.Handler):
    """Keeps the messages logged to it."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.slow
def test_a_rank_that_never_fetches_is_named_by_the_feeders_and_in_status(
    small_sources, monkeypatch
):
    # The data plane draws at most a window of steps past the slowest rank: a rank whose
    # feeder never starts holds the job there. The waiting feeders name it (after
    # HELD_BACK_WARN seconds; none here), and so do stats and `omniload status`.
    from omniload_dask.observe.status import format_status
    from omniload_dask.trainer import fetch

    monkeypatch.setattr(fetch, "HELD_BACK_WARN", 0.0)
    warnings = Collect()
    fetch.logger.addHandler(warnings)
    plan = make_plan(small_sources, name="missing", layout={"dp": 2, "tp": 2})
    try:
        with Job.start(plan, workers=2, dashboard_address=None) as job:
            feeders = [job.feeder(dp_rank=g, tp_rank=0, output="numpy") for g in range(2)]
            got: dict = {}
            take(feeders, 24, got)  # 4 * (prefetch + lookahead) + 8: the draw stops here
            deadline = time.monotonic() + 60
            while not all(f._supply.stalls.warnings for f in feeders):
                assert time.monotonic() < deadline, "no feeder warned"
                time.sleep(0.1)
            stats = job.stats()
            for f in feeders:
                f.close()
    finally:
        fetch.logger.removeHandler(warnings)
    assert stats["held_back"]["ranks"] == [1, 3]
    assert stats["held_back"]["never_seen"] == [1, 3]
    assert "never connected: 1, 3" in format_status(stats)
    # (the draw stops at the window, or at the end of a block of several steps it started)
    last = block_of(24, 0, steps_per_task(plan))[1]
    stops = "|".join(str(s) for s in range(24, last + 1))
    warned = [m for m in warnings.messages if re.search(rf"no batch for step ({stops})\b", m)]
    assert warned and "ranks 1, 3" in warned[0], warned


def _dask_command(*args: str) -> list[str]:
    exe = Path(sys.executable).parent / "dask"
    return [str(exe) if exe.exists() else shutil.which("dask") or "dask", *args]


def _closing_lines(folder: Path) -> list[str]:
    """What the workers' logs say about closing and rejoining (a failure's message)."""
    out = []
    for log in sorted(folder.glob("worker*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if any(w in line for w in ("Reason", "Closing", "rejoin", "Registered to")):
                out.append(f"{log.name}: {line[-160:]}")
    return out


@pytest.mark.slow
def test_dask_workers_rejoin_a_restarted_scheduler_by_themselves(small_sources, tmp_path):
    # The README's external cluster: `dask scheduler --preload omniload_dask.preload` and
    # `dask worker ... --preload-nanny omniload_dask.rejoin`. The scheduler is killed and a new
    # one started at the same address; nobody touches the workers: they rejoin, the job
    # resumes from its checkpoint, and the feeder goes on exactly where it was.
    plan = make_plan(
        small_sources,
        name="rejoin",
        checkpoint={"url": str(tmp_path / "ckpt"), "flush_seconds": 0.2},
        layout={"dp": 1},
    )
    ref = reference(make_plan(small_sources, name="rejoin", layout={"dp": 1}), 14)
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    scheduler_cmd = _dask_command(
        "scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard",
        "--preload", "omniload_dask.preload",
    )  # fmt: skip
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    procs = [subprocess.Popen(scheduler_cmd, **quiet)]
    workers = [
        subprocess.Popen(
            _dask_command(
                "worker",
                address,
                "--nthreads",
                "3",
                "--resources",
                "omniload-read=2",
                "--no-dashboard",
                "--preload-nanny",
                "omniload_dask.rejoin",
            ),
            stdout=subprocess.DEVNULL,
            stderr=(tmp_path / f"worker{i}.log").open("w"),  # why one left, if it does
        )
        for i in range(2)
    ]
    feeder = None
    try:
        job = Job.start(plan, address=address)

        # Both workers in, and both nannies done starting: a nanny whose scheduler dies before
        # it has told the scheduler it started gives up for good (Dask's own start path)
        def both_started(dask_scheduler) -> bool:  # (nested: sent by value to the scheduler)
            starting = getattr(dask_scheduler, "_starting_nannies", ())
            return len(dask_scheduler.workers) >= 2 and not starting

        deadline = time.monotonic() + 60
        while not job.client.run_on_scheduler(both_started):
            assert time.monotonic() < deadline, "the workers did not start"
            time.sleep(0.1)
        feeder = Feeder("rejoin", address=address, dp_rank=0, output="numpy",
                        reconnect_timeout=120)  # fmt: skip
        got: dict = {}
        take([feeder], 5, got)
        job.flush_checkpoint()
        job.close()
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait(30)
        procs.append(subprocess.Popen(scheduler_cmd, **quiet))
        again = Job.start(plan, address=address, resume=True)  # waits for the workers
        try:
            assert again.info["resumed"]
            take([feeder], 9, got)
            deadline = time.monotonic() + 60
            while len(again.client.scheduler_info()["workers"]) < 2:  # both came back
                assert time.monotonic() < deadline, _closing_lines(tmp_path)
                time.sleep(0.1)
        finally:
            again.close()
        assert all(w.poll() is None for w in workers)  # the same processes, never restarted
    finally:
        if feeder is not None:
            feeder.close()
        for proc in [*workers, *procs]:
            if proc.poll() is None:
                proc.terminate()
        for proc in [*workers, *procs]:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
    assert got == {t: ref[t] for t in range(14)}

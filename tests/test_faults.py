"""Surviving worker loss, trainer rank restarts and scheduler loss; resuming from checkpoints."""

from __future__ import annotations

import os
import signal
import socket
import time

import pytest

from omniload_dask import Feeder, Job
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


@pytest.mark.slow
def test_killing_a_worker_loses_and_repeats_nothing(small_sources):
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
        time.sleep(0.5)  # let the standby copies of the upcoming batches land
        pids = job.client.run(os.getpid)
        victim = sorted(pids)[0]
        os.kill(pids[victim], signal.SIGKILL)
        waits: list[float] = []
        take(feeders, 22, got, waits)
        assert len(job.client.scheduler_info()["workers"]) <= 3
    assert got == ref
    print(f"longest wait for a step after the kill: {max(waits) * 1e3:.0f} ms")


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

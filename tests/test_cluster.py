"""End to end on a real LocalCluster with worker processes (TCP, serialization, spawn)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from distributed import Client

from omniload_dask import Job, JobError, SourceError, TokenizerError, local_cluster
from omniload_dask.internals import comms as _comms
from omniload_dask.plan import parse_plan
from omniload_dask.testing import InlineDataPlane, assert_batches_equal
from omniload_dask.trainer.link import Link

from .conftest import make_plan
from .datagen import plan_dict, texts, write_jsonl

STEPS = 8


@pytest.fixture(scope="module")
def cluster():
    with local_cluster(2, dashboard_address=None) as c:
        yield c


def reference(plan, steps=STEPS):
    """Per rank, the micro-batches an in-process data plane produces (numpy)."""
    plane = InlineDataPlane(plan)
    out = {r: [] for r in range(plan.layout.world_size)}
    for _, batches in plane.stream(steps):
        for r in out:
            g = plan.layout.coords(r)["dp"]
            out[r] += batches[g].micro_batches
    return out


def collect(job: Job, steps=STEPS, **kw):
    out = {}
    for r in range(job.plan.layout.world_size):
        with job.feeder(rank=r, max_steps=steps, output="numpy", **kw) as f:
            out[r] = list(f)
    return out


def assert_same(ref, got):
    assert set(ref) == set(got)
    for r in ref:
        assert len(ref[r]) == len(got[r])
        for a, b in zip(ref[r], got[r], strict=True):
            b = {k: v for k, v in b.items() if k != "doc_source_name"}
            assert_batches_equal(a, b)


@pytest.mark.parametrize(("workers", "prefetch"), [(1, 1), (3, 3)])
def test_batches_are_bit_identical_for_any_worker_count_and_prefetch(small_plan, workers, prefetch):
    ref = reference(small_plan)
    with Job.start(small_plan, workers=workers, dashboard_address=None) as job:
        assert job.stats()["workers"] == workers
        got = collect(job, prefetch=prefetch)
    assert_same(ref, got)


def test_every_sample_goes_to_exactly_one_rank_once(small_sources, cluster):
    plan = make_plan(
        small_sources, name="once", batch={"seq_len": 128, "global_tokens": 1024}, layout={"dp": 3}
    )
    with Client(cluster) as client:
        job = Job.start(plan, client=client)
        feeders = [job.feeder(dp_rank=r, output="numpy") for r in range(3)]
        seen: dict[tuple[int, int], int] = {}
        rolled: set[int] = set()  # sources seen in epoch 1: their epoch 0 is complete
        while len(rolled) < len(plan.sources):
            for r, f in enumerate(feeders):
                for mb in next(f.steps()):
                    for d, e, o, s in zip(
                        mb["doc_id"],
                        mb["doc_epoch"],
                        mb["doc_offset"],
                        mb["doc_source"],
                        strict=True,
                    ):
                        if e == 0:
                            assert (int(d), int(o)) not in seen, "delivered twice"
                            seen[(int(d), int(o))] = r
                        else:
                            rolled.add(int(s))
        job.stop()
    expected = set()
    plane = InlineDataPlane(plan)
    for stream in plane.coord.view.streams:
        from omniload_dask.sources import encode_sample_ids
        from omniload_dask.sources.registry import read_unit_records

        cat = stream.catalog
        for f, lo, hi in cat.units.tolist():
            rec = read_unit_records(stream.spec, cat.files[f], lo, hi)
            expected |= set(encode_sample_ids(stream.index, f, rec.offsets).tolist())
    assert {d for d, _ in seen} == expected


def test_feeder_state_dict_resumes_exactly(small_sources, cluster):
    plan = make_plan(small_sources, name="resume")
    with Client(cluster) as client:
        job = Job.start(plan, client=client)
        first = job.feeder(dp_rank=1, output="numpy")
        others = [job.feeder(rank=r, output="numpy") for r in (0,)]
        for _ in range(5):
            next(others[0].steps())
        for _ in range(7):
            next(first)
        state = first.state_dict()
        assert state["step"] >= 2 and state["micro_step"] >= 0
        expected = [next(first) for _ in range(6)]
        first.close()
        again = job.feeder(dp_rank=1, output="numpy")
        again.load_state_dict(state)
        got = [next(again) for _ in range(6)]
        for a, b in zip(expected, got, strict=True):
            assert_batches_equal(a, b)
        with pytest.raises(JobError, match="unknown state version"):
            again.load_state_dict({**state, "version": 99})
        job.stop()


def test_feeder_is_a_torch_iterable_dataset(small_sources, cluster):
    import torch
    from torch.utils.data import DataLoader, IterableDataset

    plan = make_plan(small_sources, name="torchds", layout={"dp": 1})
    with Client(cluster) as client:
        job = Job.start(plan, client=client)
        ds = job.feeder(dp_rank=0, max_steps=3).as_torch_dataset()
        assert isinstance(ds, IterableDataset)
        items = list(DataLoader(ds, batch_size=None))
        assert len(items) == 3 * items[0]["num_micro_steps"]
        mb = items[0]
        assert mb["input_ids"].dtype == torch.int64 and mb["cu_seqlens"].dtype == torch.int32
        assert mb["input_ids"].shape == mb["labels"].shape == mb["position_ids"].shape
        job.stop()


def test_start_is_idempotent_and_a_different_plan_under_the_same_name_is_refused(
    small_sources, cluster
):
    plan = make_plan(small_sources, name="idem")
    with Client(cluster) as client:
        a = Job.start(plan, client=client)
        b = Job.start(plan, client=client)
        assert a.info["run_id"] == b.info["run_id"]
        other = make_plan(small_sources, name="idem", seed=99)
        with pytest.raises(JobError, match="already runs with another plan"):
            Job.start(other, client=client)
        a.stop()
        with pytest.raises(JobError, match="no omniload job named 'idem'"):
            a.stats()


def test_bad_input_fails_at_start_up_with_a_clear_error(tmp_path, cluster):
    write_jsonl(tmp_path / "a.jsonl", texts(10))
    good = {"name": "a", "format": "jsonl", "path": str(tmp_path / "a.jsonl")}
    with Client(cluster) as client:
        missing = parse_plan(
            plan_dict([good, {**good, "name": "b", "path": str(tmp_path / "none/*.jsonl")}])
        )
        with pytest.raises(SourceError, match=r"source 'b': glob .* matched no files"):
            Job.start(missing, client=client)
        tok = parse_plan(
            plan_dict(
                [good],
                tokenizer={
                    "kind": "huggingface",
                    "path": str(tmp_path / "tok.json"),
                    "add_bos": False,
                    "add_eos": False,
                },
            )
        )
        with pytest.raises(TokenizerError, match="does not exist"):
            Job.start(tok, client=client)
        assert list(client.sync(client.scheduler.omniload_jobs)) == []
        # the embedded cluster runs with the loader's settings (the preload's, see below)
        assert client.run_on_scheduler(
            lambda dask_scheduler: dask_scheduler.WORKER_SATURATION
        ) == float("inf")
        tuned = client.run(_worker_settings)
        assert all(
            t == {"profiler": False, "tick_ms": 200.0, "disk": False, "tokenizers": "false"}
            for t in tuned.values()
        )


def test_a_bad_record_mid_stream_fails_the_feeder_with_the_file_and_offset(tmp_path, cluster):
    write_jsonl(tmp_path / "a.jsonl", texts(200), raw_lines={150: "{oops"})
    plan = parse_plan(
        plan_dict(
            [
                {
                    "name": "a",
                    "format": "jsonl",
                    "unit_bytes": 2048,
                    "path": str(tmp_path / "a.jsonl"),
                }
            ],
            name="midstream",
            layout={"dp": 1},
            loader={"read_retries": 0},
        )
    )
    with Client(cluster) as client:
        job = Job.start(plan, client=client)
        feeder = job.feeder(dp_rank=0)
        with pytest.raises(
            JobError,
            match=r"failed: .*source 'a': file '.*a.jsonl': record at "
            r"offset \d+: malformed JSON",
        ):
            for _ in feeder:
                pass
        job.stop()


FEEDER_SCRIPT = textwrap.dedent("""
    import json, sys
    from omniload_dask import Feeder
    feeder = Feeder("attach", address=sys.argv[1], dp_rank=int(sys.argv[2]), max_steps=4,
                    output="numpy")
    print(json.dumps([mb["input_ids"].tolist() for mb in feeder]))
    feeder.close()
""")


def test_a_feeder_opens_its_comms_to_the_workers_before_its_first_fetch(small_sources, cluster):
    """On a small cluster the job's info names the workers, and a feeder connects to them
    while its first batch is built (its first fetch then finds the comms open)."""
    plan = make_plan(small_sources, name="warm")
    with Client(cluster) as client:
        job = Job.start(plan, client=client)
        try:
            info = job.attach(job.name, client=client).info
            assert sorted(info["workers"]) == sorted(cluster.scheduler_info["workers"])
            link = Link(cluster.scheduler_address)  # (a feeder's, before it fetched anything)
            try:
                assert link.connections() == 0
                link.warm(info["workers"])
                deadline = time.monotonic() + 30
                while link.connections() < len(info["workers"]) and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert all(_comms.pooled(link._workers, w) for w in info["workers"])
            finally:
                link.close()
            feeder = job.feeder(dp_rank=0, output="numpy")  # (the wiring warms its own link)
            assert next(iter(feeder))["input_ids"].size > 0
        finally:
            job.stop()


def test_feeders_in_other_processes_attach_by_address(small_sources, cluster, tmp_path):
    import json

    plan = make_plan(small_sources, name="attach")
    ref = reference(plan, steps=4)
    job = Job.start(plan, address=cluster.scheduler_address)
    try:
        procs = [
            subprocess.run(
                [sys.executable, "-c", FEEDER_SCRIPT, cluster.scheduler_address, str(r)],
                capture_output=True,
                text=True,
                timeout=120,
            )
            for r in range(2)
        ]
        for r, proc in enumerate(procs):
            assert proc.returncode == 0, proc.stderr[-2000:]
            got = json.loads(proc.stdout.strip().splitlines()[-1])
            assert got == [mb["input_ids"].tolist() for mb in ref[r]]
    finally:
        job.stop()
        job.close()


def _warm_modules() -> bool:
    """In a worker: whether the preload's background imports are all there."""
    import importlib.util

    from omniload_dask.preload import READER_MODULES

    installed = [n for n in READER_MODULES if importlib.util.find_spec(n.split(".")[0]) is not None]
    return all(name in sys.modules for name in installed)


def _worker_settings(dask_worker: Any) -> dict[str, Any]:
    """What the worker preload tuned, as seen inside a worker."""
    import os

    return {
        "profiler": "profile" in dask_worker.periodic_callbacks,
        "tick_ms": dask_worker.periodic_callbacks["tick"].callback_time,
        "disk": dask_worker.monitor.monitor_disk_io,
        "tokenizers": os.environ.get("TOKENIZERS_PARALLELISM"),
    }


def test_plugin_and_cluster_settings_preloaded_on_a_dask_scheduler_and_worker(
    small_sources, tmp_path
):
    import os
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"tcp://127.0.0.1:{port}"
    bindir = Path(sys.executable).parent
    env = {**os.environ, "DASK_DISTRIBUTED__DASHBOARD__EXPORT_TOOL": "False"}
    sched = subprocess.Popen(
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
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    worker = subprocess.Popen(
        [
            str(bindir / "dask"),
            "worker",
            address,
            "--nthreads",
            "1",
            "--no-dashboard",
            "--preload",
            "omniload_dask.preload",
        ],
        # The repository root on the path: the worker runs this module's _worker_settings,
        # which the client sends by reference.
        env={
            **{k: v for k, v in env.items() if k != "TOKENIZERS_PARALLELISM"},
            "DASK_OMNILOAD__WARM_IMPORTS": "readers",  # (opt-in: a cluster reading Arrow)
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(Path(__file__).resolve().parent.parent), env.get("PYTHONPATH")) if p
            ),
        },
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 60
        client = None
        while client is None:
            try:
                client = Client(address, timeout=5)
            except OSError:
                if time.time() > deadline:
                    raise
                time.sleep(0.5)
        client.wait_for_workers(1, timeout=60)
        assert client.run_on_scheduler(lambda dask_scheduler: "omniload" in dask_scheduler.plugins)
        assert list(client.sync(client.scheduler.omniload_jobs)) == []
        # the embedded cluster's settings reached both through the preload
        assert client.run_on_scheduler(
            lambda dask_scheduler: dask_scheduler.WORKER_SATURATION
        ) == float("inf")
        tuned = client.run(_worker_settings)
        assert list(tuned.values()) == [
            {"profiler": False, "tick_ms": 200.0, "disk": False, "tokenizers": "false"}
        ]
        # the readers' libraries are imported in the background before any job asks for them
        deadline = time.time() + 120
        while list(client.run(_warm_modules).values()) != [True] and time.time() < deadline:
            time.sleep(0.5)
        assert list(client.run(_warm_modules).values()) == [True]
        plan = make_plan(small_sources, name="preloaded", layout={"dp": 1})
        job = Job.start(plan, client=client)
        batch = next(job.feeder(dp_rank=0, output="numpy"))
        assert batch["num_tokens"] > 0
        job.stop()
        client.close()
    finally:
        worker.terminate()
        sched.terminate()
        worker.wait(30)
        sched.wait(30)


def test_input_ids_cover_the_token_budget(small_plan):
    ref = reference(small_plan, steps=3)
    total = sum(int(mb["num_tokens"]) for r in ref for mb in ref[r])
    assert total <= 3 * small_plan.batch.global_tokens
    assert total > 0.5 * 3 * small_plan.batch.global_tokens
    assert all(np.all(mb["input_ids"] < 258) for r in ref for mb in ref[r])


def test_a_2x2x1x2_layout_shares_batches_with_tp_peers_and_slices_them_for_cp_peers(
    small_sources, cluster
):
    from omniload_dask.batching.context_parallel import slice_micro_batch

    plan = make_plan(small_sources, name="hybrid", layout={"dp": 2, "tp": 2, "pp": 1, "cp": 2})
    layout = plan.layout
    steps = 4
    plane = InlineDataPlane(plan)
    whole = {t: plane.step(t) for t in range(steps)}  # the reference: each group's full batch
    with Client(cluster) as client:
        job = Job.start(plan, client=client)
        got = collect(job, steps=steps)
        job.stop()
    for r, mbs in got.items():
        c = layout.coords(r)
        peer = layout.rank(c["dp"], 1 - c["tp"], c["pp"], c["cp"])
        for x, y in zip(mbs, got[peer], strict=True):  # tensor-parallel peers: identical batches
            assert_batches_equal(x, y)
        expected = [
            slice_micro_batch(mb, 2, c["cp"])
            for t in range(steps)
            for mb in whole[t][c["dp"]].micro_batches
        ]
        assert_same({r: expected}, {r: mbs})  # cp rank c: exactly its zigzag slice
    for g in range(layout.dp):
        a, b = (got[layout.rank(g, 0, 0, c)] for c in range(2))
        for x, y in zip(a, b, strict=True):  # cp peers: complementary halves, equal work
            both = np.concatenate([x["input_ids"], y["input_ids"]])
            full = whole[x["step"]][g].micro_batches[x["micro_step"]]
            assert sorted(both.tolist()) == sorted(full["input_ids"].tolist())
            work = [int((s["position_ids"] + 1).sum()) for s in (x, y)]
            assert abs(work[0] - work[1]) <= 2 * int(np.diff(full["cu_seqlens"]).sum())
    for t in range(steps):  # each DP group's documents once: groups hold disjoint pieces
        pieces = [
            {
                (int(d), int(o))
                for mb in whole[t][g].micro_batches
                for d, o in zip(mb["doc_id"], mb["doc_offset"], strict=True)
            }
            for g in range(layout.dp)
        ]
        assert not pieces[0] & pieces[1]
        delivered = {
            (int(d), int(o))
            for r in range(layout.world_size)
            for mb in got[r]
            if mb["step"] == t
            for d, o in zip(mb["doc_id"], mb["doc_offset"], strict=True)
        }
        assert delivered == pieces[0] | pieces[1]


def test_bad_rpc_arguments_are_named(small_sources, cluster):
    from omniload_dask.internals import comms as _comms

    plan = make_plan(small_sources, name="badrpc")
    with Client(cluster) as client:
        job = Job.start(plan, client=client)
        cases = [
            ({"rank": "zero", "start": 0, "count": 1}, "rank must be an integer >= 0, got 'zero'"),
            ({"rank": 0, "start": -3, "count": 1}, "start must be an integer >= 0, got -3"),
            ({"rank": 0, "start": 0, "count": 0}, "start must be >= 0 and count >= 1"),
            ({"rank": 7, "start": 0, "count": 1}, "rank 7 is not in the layout"),
            ({"rank": 0, "start": 0, "count": 1, "timeout": "soon"}, "timeout must be a number"),
        ]
        for kwargs, message in cases:
            with pytest.raises(JobError, match=message):
                _comms.call(client, "batches", job="badrpc", **kwargs)
        with pytest.raises(JobError, match="window must be an integer >= 1"):
            _comms.call(client, "mixture", job="badrpc", window=0)
        with pytest.raises(JobError, match="no omniload job named 'nope'"):
            _comms.call(client, "stats", job="nope")
        job.stop()


def test_a_waiting_feeder_does_not_spin_the_data_plane(small_plan):
    # With no worker left nothing can change while a rank long-polls for a step that is not
    # read yet, so the data plane has nothing to do. It used to run once per wake-up of the
    # poll, which woke the poll again: thousands of runs a second, on the scheduler's loop.
    with Job.start(small_plan, workers=1, dashboard_address=None) as job:
        with job.feeder(rank=0, max_steps=1, output="numpy") as f:
            assert len(list(f)) > 0
        job.cluster.scale(0)
        deadline = time.monotonic() + 30
        while job.stats()["workers"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert job.stats()["workers"] == 0
        ask = dict(job=job.plan.name, rank=0, start=40, count=1)
        # The first requests draw what known lengths allow (on a loaded machine that can take
        # several polls); once a poll finds the data plane quiet, nothing can move any more.
        for _ in range(30):
            before = job.stats()["data_plane_runs"]
            _comms.call(job.client, "batches", **ask, timeout=0.5)
            if job.stats()["data_plane_runs"] == before:
                break
        before = job.stats()["data_plane_runs"]
        reply = _comms.call(job.client, "batches", **ask, timeout=1.5)  # then nothing can move
        runs = job.stats()["data_plane_runs"] - before
        assert reply["parts"] == []
        assert runs <= 1, runs  # (a request that moves nothing does not run it at all)


def test_the_embedded_cluster_skips_the_profiler_and_checks_less_often():
    """Its worker processes and scheduler get the embedded cluster's settings (job.py)."""
    with local_cluster(1, dashboard_address=None) as cluster, Client(cluster) as client:
        workers = client.run(
            lambda dask_worker: (
                sorted(dask_worker.periodic_callbacks),
                dask_worker.periodic_callbacks["tick"].callback_time,
                dask_worker.periodic_callbacks["memory_monitor"].callback_time,
            )
        )
        tick = client.run_on_scheduler(
            lambda dask_scheduler: dask_scheduler.periodic_callbacks["tick"].callback_time
        )
    ((callbacks, worker_tick, memory),) = workers.values()
    assert "profile" not in callbacks and "heartbeat" in callbacks
    assert (worker_tick, memory, tick) == (200.0, 500.0, 200.0)

"""The data plane at scale, on a real cluster: blocks of DP groups served part by part, agents
fetching for several ranks, dealing off the event loop, no per-step state piling up without a
checkpoint, and the data plane's own client surviving a lost connection."""

from __future__ import annotations

import time

import pytest
from distributed import Client

from omniload_dask import Job, local_cluster
from omniload_dask.cluster import dealing
from omniload_dask.testing import InlineDataPlane
from omniload_dask.trainer.fanout import DirectSupply
from omniload_dask.trainer.link import Link

from .conftest import make_plan
from .test_cluster import assert_same, collect


def reference(plan, steps):
    """Per rank, what an in-process data plane hands it (its part: with cp, its slice)."""
    plane = InlineDataPlane(plan)
    out = {r: [] for r in range(plan.layout.world_size)}
    for step in range(steps):
        for rank, ref in plane.fetch(step).items():
            out[rank] += plane.batches[ref].micro_batches
    return out


@pytest.fixture(scope="module")
def cluster():
    with local_cluster(2, dashboard_address=None) as c:
        yield c


def plugin_job(client: Client, name: str, what):
    """``what(running job)`` evaluated on the scheduler."""

    def probe(dask_scheduler):
        return what(dask_scheduler.plugins["omniload"].jobs[name])

    return client.run_on_scheduler(probe)


def test_blocks_of_dp_groups_hand_each_rank_its_own_part(small_sources, cluster):
    plan = make_plan(
        small_sources,
        name="blocks",
        layout={"dp": 4, "cp": 2},
        loader={"groups_per_task": 3},
        batch={"seq_len": 128, "global_tokens": 1024},
    )
    ref = reference(plan, steps=4)
    with Client(cluster) as client:
        job = Job.start(plan, client=client)
        got = collect(job, steps=4)
        keys = plugin_job(client, "blocks", lambda run: sorted(run.coord.components.delivery.steps))
        held = client.run(_block_parts)
        job.stop()
    assert_same(ref, got)
    assert keys  # steps were kept for rebuilds
    parts = [p for kinds in held.values() for p in kinds]
    assert parts and set(parts) == {"packed"}  # built packed, as served (batching.wire)


def _block_parts(dask_worker):
    """What the blocks in a worker's memory hold: ``"packed"`` parts or anything else."""
    from omniload_dask.batching.wire import is_packed
    from omniload_dask.core.keys import is_batch

    return [
        "packed" if is_packed(part) else type(part).__name__
        for key, block in list(dask_worker.data.items())
        if is_batch(key)
        for part in block.parts.values()
    ]


def test_one_agent_fetches_every_slice_of_a_dp_group_in_one_round_trip(small_sources, cluster):
    plan = make_plan(small_sources, name="agent", layout={"dp": 2, "tp": 2, "cp": 2})
    ref = reference(plan, steps=3)
    layout = plan.layout
    with Client(cluster) as client:
        job = Job.start(plan, client=client)
        ranks = layout.group_ranks(1)
        link = Link(cluster.scheduler_address)
        steps = DirectSupply(link, "agent", ranks, [(1, 0), (1, 1)], 0, 4, lambda b: {}, pick=None)
        try:
            got = {r: [] for r in ranks}
            for step in range(3):
                slices = steps.take(step)
                steps.done(step)
                for r in ranks:
                    got[r] += slices[layout.coords(r)["cp"]].micro_batches
            seen = plugin_job(
                client, "agent", lambda run: run.coord.components.delivery.where.last_seen.tolist()
            )
        finally:
            steps.close()
            job.stop()
    assert_same({r: ref[r] for r in ranks}, got)
    # The one agent's requests moved every rank of group 1 and none of group 0.
    assert all(seen[r] > 0 for r in ranks)
    assert all(seen[r] == 0 for r in layout.group_ranks(0))


def _guard_rank_arrays(dask_scheduler, name):
    """Make the job's per-rank arrays note every reduction or listing over all of them."""
    import numpy as np

    run = dask_scheduler.plugins["omniload"].jobs[name]
    where = run.coord.components.delivery.where
    world = len(where.position)
    run.scans = scans = []

    class Noted(np.ndarray):
        def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
            if method != "__call__" and any(
                isinstance(x, Noted) and x.size == world for x in inputs
            ):
                scans.append(f"{ufunc.__name__}.{method}")
            plain = [np.asarray(x) if isinstance(x, Noted) else x for x in inputs]
            return getattr(ufunc, method)(*plain, **kwargs)

        def tolist(self):
            if self.size == world:
                scans.append("tolist")
            return np.asarray(self).tolist()

    for field in ("position", "requested", "last_seen", "group_of", "cp_of"):
        setattr(where, field, getattr(where, field).view(Noted))
    return world


def test_no_request_scans_every_rank(small_sources, cluster):
    plan = make_plan(small_sources, name="noscan", layout={"dp": 4, "tp": 2})
    ref = reference(plan, steps=6)
    layout = plan.layout
    with Client(cluster) as client:
        job = Job.start(plan, client=client)
        world = client.run_on_scheduler(_guard_rank_arrays, name="noscan")
        agents = [
            DirectSupply(
                Link(cluster.scheduler_address), "noscan", layout.group_ranks(g), [(g, 0)],
                0, 2, lambda b: {}, pick=None, max_steps=6,
            )
            for g in range(layout.dp)
        ]  # fmt: skip
        try:
            got = {r: [] for r in range(world)}
            for step in range(6):
                for g, agent in enumerate(agents):
                    (batch,) = agent.take(step)
                    agent.done(step)
                    for r in layout.group_ranks(g):
                        got[r] += batch.micro_batches
            scans = plugin_job(client, "noscan", lambda run: list(run.scans))
            # the guard sees a scan when there is one
            check = plugin_job(client, "noscan", lambda run: run.coord.components.delivery.slowest() >= 0
                               and run.coord.components.delivery.where.position.min() >= 0
                               and list(run.scans))  # fmt: skip
        finally:
            for agent in agents:
                agent.close()
            job.stop()
    assert_same(ref, got)
    assert world == 8 and scans == []
    assert check == ["minimum.reduce"]


@pytest.mark.parametrize("where", ["thread", "process"])
def test_planning_off_the_loop_gives_the_same_stream(small_plan, monkeypatch, where):
    monkeypatch.setattr(dealing, "INLINE_MS", -1.0)  # every step off the loop
    if where == "process":
        monkeypatch.setattr(dealing, "PROCESS_MIN_GROUPS", 1)
    ref = reference(small_plan, 8)
    with Job.start(small_plan, workers=1, dashboard_address=None) as job:
        got = collect(job, steps=8)
        stats = job.stats()
        pending = plugin_job(
            job.client, small_plan.name, lambda run: len(run.coord.components.recorder.pending)
        )
    assert_same(ref, got)
    assert stats["planning_in"] == where
    assert stats["steps_planned_off_loop"] >= stats["next_step"] - 1
    assert 1 <= stats["planning_batches"] <= stats["steps_planned_off_loop"]
    assert pending == 0  # no checkpoint: no per-step deltas kept


@pytest.mark.slow
def test_the_data_plane_client_survives_a_lost_connection(small_sources):
    plan = make_plan(small_sources, name="reconnect", layout={"dp": 1})
    ref = reference(plan, steps=12)
    with Job.start(plan, workers=2, dashboard_address=None) as job:
        with job.feeder(dp_rank=0, output="numpy", max_steps=12) as feeder:
            got = [next(feeder) for _ in range(len(ref[0]) // 2)]

            def cut(dask_scheduler):
                from omniload_dask.internals import server as _server

                _server.break_connection(dask_scheduler.plugins["omniload"]._client.current)

            job.client.run_on_scheduler(cut)
            got += list(feeder)
        deadline = time.monotonic() + 30
        while job.stats()["resubmits"] < 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert job.stats()["resubmits"] >= 1
    assert_same(ref, {0: got})


@pytest.mark.slow
def test_the_job_fails_saying_so_when_its_client_cannot_connect_again(small_sources, monkeypatch):
    from omniload_dask.cluster import watchdog
    from omniload_dask.errors import JobError

    monkeypatch.setattr(watchdog, "RECONNECT_TIMEOUT", 10.0)
    plan = make_plan(small_sources, name="noreconnect", layout={"dp": 1})
    with Job.start(plan, workers=1, dashboard_address=None) as job:
        data_client = job.cluster.scheduler.plugins["omniload"]._client

        async def refuse():
            raise OSError("the scheduler takes no new clients (test)")

        with job.feeder(dp_rank=0, output="numpy", max_steps=100_000) as feeder:
            next(feeder)
            data_client._connect = refuse  # every new client fails to connect from now on

            def cut(dask_scheduler):
                from omniload_dask.internals import server as _server

                _server.break_connection(dask_scheduler.plugins["omniload"]._client.current)

            job.client.run_on_scheduler(cut)
            deadline = time.monotonic() + 120
            with pytest.raises(JobError, match="could not connect again"):
                for _ in feeder:  # what was fetched before comes out, then the error
                    assert time.monotonic() < deadline, "the feeder stalled without an error"


def test_the_planning_thread_plans_whole_blocks_of_steps(small_sources, monkeypatch):
    # A block of several steps is fetchable once its last step is drawn and built: its
    # steps wait for one another and go to the dealing thread together (whole blocks, up
    # to StepDealing's batch of steps).
    monkeypatch.setattr(dealing, "INLINE_MS", -1.0)  # every step off the loop
    # batches of 8 steps at most: the ranks fetch one after another here, so the job draws
    # only about 24 steps, and batches of 16 would be too few to tell anything
    monkeypatch.setattr(dealing, "STEPS_AT_ONCE", 8)
    batches: list[list[int]] = []
    start = dealing.StepDealing.start

    def recorded(self, drawn):
        batches.append([d.step for d in drawn])
        return start(self, drawn)

    monkeypatch.setattr(dealing.StepDealing, "start", recorded)
    plan = make_plan(small_sources, name="blocks", loader={"steps_per_task": 4})
    ref = reference(plan, 13)
    with Job.start(plan, workers=2, dashboard_address=None) as job:
        got = collect(job, steps=13)
        stats = job.stats()
    assert_same(ref, got)
    assert stats["planning_batches"] == len(batches) >= 4
    assert [s for b in batches for s in b] == list(range(batches[-1][-1] + 1))
    # step 0 is a block of its own, then blocks of 4 steps from step 1
    for batch in batches[:-1]:  # (drawn ahead until the job stopped: the last may be cut)
        assert batch[0] == 0 or batch[0] % 4 == 1
        assert batch[-1] == 0 or batch[-1] % 4 == 0
        assert len(batch) <= dealing.STEPS_AT_ONCE


def test_checkpoint_snapshots_are_taken_while_blocks_of_steps_are_drawn(
    small_sources, tmp_path, monkeypatch
):
    # Steps of a block drawn in part wait in flight, and a snapshot needs none in flight: when
    # one is due, the job lets them through, and the snapshot follows.
    monkeypatch.setattr(dealing, "INLINE_MS", -1.0)
    plan = make_plan(
        small_sources, name="snapshots", loader={"steps_per_task": 4},
        checkpoint={"url": str(tmp_path / "ckpt"), "flush_seconds": 0.05, "compact_every": 4,
                    "keep_bases": 50},
    )  # fmt: skip
    ref = reference(make_plan(small_sources, name="snapshots", loader={"steps_per_task": 4}), 20)
    with Job.start(plan, workers=2, dashboard_address=None) as job:
        got = collect(job, steps=20)  # (rank by rank: within the draw's window of 24 steps)
        job.flush_checkpoint()
        bases = job.stats()["checkpoint"]["bases"]
    assert_same(ref, got)
    assert len(bases) >= 2 and max(bases) > 0  # the first base, and snapshots after it

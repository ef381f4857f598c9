"""One fetch per model-parallel group or node, handed out locally: every rank still gets
exactly what its own fetch would give (real processes: gloo over loopback, a node agent over
shared memory)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from omniload_dask import Job, local_cluster
from omniload_dask.trainer.node import agent_socket
from omniload_dask.trainer.shm import read_segment, write_segment

from .conftest import make_plan
from .test_scale import reference

STEPS = 4

RANK_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    from omniload_dask import Feeder
    address, job, steps, fanout = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    kwargs = {}
    if fanout == "broadcast":
        import torch.distributed as dist
        dist.init_process_group("gloo")
    else:
        kwargs = {"rank": int(os.environ["RANK"]), "node_ranks": [0, 1, 2, 3]}
    feeder = Feeder(job, address=address, fanout=fanout, max_steps=steps, output="numpy",
                    **kwargs)
    mbs = [[mb["input_ids"].tolist(), mb["doc_id"].tolist(), mb["cu_seqlens"].tolist()]
           for mb in feeder]
    print(json.dumps({"rank": feeder.rank, "mbs": mbs, "own_link": feeder._link is not None}))
    feeder.close()
    if fanout == "broadcast":
        dist.destroy_process_group()
    """
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(address: str, job: str, fanout: str, world: int) -> dict[int, dict]:
    port = free_port()
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMNILOAD_AGENT_LINGER": "1",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", RANK_SCRIPT, address, job, str(STEPS), fanout],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    out = {}
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=240)
        assert proc.returncode == 0, stderr[-3000:]
        got = json.loads(stdout.strip().splitlines()[-1])
        out[got["rank"]] = got
    return out


def digests(mbs) -> list:
    return [
        [mb["input_ids"].tolist(), mb["doc_id"].tolist(), mb["cu_seqlens"].tolist()] for mb in mbs
    ]


def test_a_batch_survives_shared_memory_bit_for_bit(small_plan):
    from omniload_dask.testing import InlineDataPlane, assert_batches_equal

    batch = InlineDataPlane(small_plan).step(0)[0]
    segment = write_segment(batch)
    try:
        again = read_segment(segment.name)
    finally:
        segment.unlink()
    for a, b in zip(batch.micro_batches, again.micro_batches, strict=True):
        assert_batches_equal(a, b)
    with pytest.raises(FileNotFoundError):
        read_segment(segment.name)


READER = textwrap.dedent(
    """
    import sys
    from multiprocessing import resource_tracker
    from omniload_dask.trainer.shm import read_segment
    value = read_segment(sys.argv[1])
    tracker = resource_tracker._resource_tracker._pid  # set once a tracker process started
    print(value["ids"].tolist(), tracker is not None)
    """
)


def test_a_rank_reads_shared_memory_without_a_resource_tracker_of_its_own():
    # Each rank of a node reads the agent's segments; attaching through SharedMemory would
    # start a resource-tracker process in every rank (before Python 3.13), ~10 MiB each.
    import numpy as np

    segment = write_segment({"ids": np.arange(5, dtype=np.uint32)})
    try:
        out = subprocess.run([sys.executable, "-c", READER, segment.name], capture_output=True,
                             text=True, timeout=120, check=True).stdout.split()  # fmt: skip
    finally:
        segment.unlink()
    assert out == ["[0,", "1,", "2,", "3,", "4]", str(not Path("/dev/shm").is_dir())]


@pytest.mark.slow
def test_broadcast_within_the_dp_group_gives_tp_and_cp_ranks_their_own_batches(small_sources):
    plan = make_plan(small_sources, name="bcast", layout={"dp": 1, "tp": 2, "cp": 2})
    ref = reference(plan, STEPS)
    with local_cluster(1, dashboard_address=None) as cluster:
        job = Job.start(plan, address=cluster.scheduler_address)
        try:
            got = run_ranks(cluster.scheduler_address, "bcast", "broadcast", 4)
        finally:
            job.stop()
            job.close()
    for rank in range(4):
        assert got[rank]["mbs"] == digests(ref[rank])
    # only the group's lowest rank keeps a connection: it fetches for all four
    assert [got[r]["own_link"] for r in range(4)] == [True, False, False, False]


@pytest.mark.slow
def test_a_node_agent_fetches_once_for_the_node_and_hands_out_over_shared_memory(
    small_sources,
):
    plan = make_plan(small_sources, name="node", layout={"dp": 2, "tp": 2})
    ref = reference(plan, STEPS)
    with local_cluster(1, dashboard_address=None) as cluster:
        address = cluster.scheduler_address
        job = Job.start(plan, address=address)
        try:
            got = run_ranks(address, "node", "node", 4)
            stats = job.stats()
        finally:
            job.stop()
            job.close()
    for rank in range(4):
        assert got[rank]["mbs"] == digests(ref[rank])
        assert not got[rank]["own_link"]  # no rank connected to the data plane itself
    assert stats["agent_requests"] >= 1
    path = Path(agent_socket("node", address, [0, 1, 2, 3]))
    deadline = time.monotonic() + 60  # the agent leaves once no rank is attached
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not path.exists()

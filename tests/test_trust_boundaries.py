"""What comes from outside and must not be taken on trust: a checkpoint manifest without its own
digest (whatever format version it claims) is refused unless the user says so, and logged then;
every integer an RPC handler takes is range-checked with a typed error (no raw OverflowError)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from distributed import Client

from omniload_dask import CheckpointError, Job, JobError, local_cluster
from omniload_dask.internals import comms as _comms
from omniload_dask.plan import parse_plan
from omniload_dask.testing import InlineDataPlane

from .datagen import plan_dict, texts, write_jsonl

STEPS = 30


def small_plan(root: Path, name: str = "trust", **overrides: Any):
    write_jsonl(root / "web" / "a.jsonl", texts(300, seed=1))
    sources = [{"name": "web", "format": "jsonl", "path": str(root / "web"), "weight": 1}]
    return parse_plan(plan_dict(sources, name=name, layout={"dp": 1}, **overrides))


def checkpointed(root: Path):
    plan = small_plan(root, checkpoint={"url": str(root / "ckpt"), "compact_every": 8})
    run = InlineDataPlane(plan)
    list(run.stream(STEPS))
    run.checkpoint()
    return plan


def edit_manifest(root: Path, version: int) -> dict[str, Any]:
    """Claim ``version``, drop the digest, move every rank 7 steps ahead; the edited fields."""
    path = root / "ckpt" / "MANIFEST.json"
    data = json.loads(path.read_text())
    data.pop("manifest_sha256")
    data["version"] = version
    data["positions"] = {r: p + 7 for r, p in data["positions"].items()}
    path.write_text(json.dumps(data, indent=1))
    return data


@pytest.mark.parametrize("version", [1, 2])
def test_a_manifest_without_its_digest_is_refused_whatever_version_it_claims(tmp_path, version):
    plan = checkpointed(tmp_path)
    edit_manifest(tmp_path, version)
    with pytest.raises(CheckpointError, match=r"carries no manifest_sha256 .*resume_unverified"):
        InlineDataPlane(plan, resume=True)


def test_resume_unverified_takes_it_on_trust_and_logs_it(tmp_path, caplog):
    plan = checkpointed(tmp_path)
    data = edit_manifest(tmp_path, 1)
    with caplog.at_level(logging.WARNING, logger="omniload_dask.checkpoint.store"):
        again = InlineDataPlane(plan, resume=True, resume_unverified=True)
    assert again.coord.view.next_step == min(data["positions"].values())  # as the manifest says
    assert "without its manifest_sha256" in caplog.text and "resume_unverified" in caplog.text


HUGE = [2**63, 2**64, 2**100]


def bad_calls(job: str) -> list[tuple[str, dict[str, Any]]]:
    calls: list[tuple[str, dict[str, Any]]] = []
    for big in HUGE:
        calls += [
            ("batches", {"job": job, "rank": big, "start": 0, "count": 1}),
            ("batches", {"job": job, "rank": 0, "start": big, "count": 1}),
            ("batches", {"job": job, "rank": 0, "start": 0, "count": big}),
            ("batches", {"job": job, "ranks": [0, big], "start": 0, "count": 1}),
            ("batches", {"job": job, "rank": 0, "parts": [[big, 0]], "start": 0, "count": 1}),
            ("batches", {"job": job, "rank": 0, "start": 0, "count": 1, "timeout": big}),
            (
                "batches",
                {"job": job, "rank": 0, "start": 0, "count": 1, "report": {"samples": big}},
            ),
            ("set_weights", {"job": job, "weights": {"web": 1.0}, "at_step": big}),
            ("update_plan", {"job": job, "plan": {}, "at_step": big}),
            ("mixture", {"job": job, "window": big}),
            ("steps", {"job": job, "start": big}),
            ("start", {"plan": {}, "start_step": big}),
            ("start", {"plan": {}, "resume": big}),
        ]
    calls += [
        ("batches", {"job": job, "rank": 0, "start": 0, "count": 1, "timeout": float("inf")}),
        ("batches", {"job": job, "rank": 0, "start": 0, "count": 1, "timeout": float("nan")}),
        ("batches", {"job": job, "rank": 0, "start": 0, "count": 1, "report": {"buffered": 1e300}}),
        ("set_weights", {"job": job, "weights": {"web": 10**400}}),
        ("set_weights", {"job": job, "weights": {"web": float("inf")}}),
        ("start", {"plan": {}, "resume": True, "resume_unverified": "yes"}),
    ]
    return calls


def test_every_rpc_integer_is_range_checked_with_a_typed_error(tmp_path):
    plan = small_plan(tmp_path)
    with local_cluster(1, dashboard_address=None) as cluster, Client(cluster) as client:
        job = Job.start(plan, client=client)
        with job.feeder(rank=0, output="numpy", max_steps=1) as feeder:
            assert next(mb["step"] for mb in feeder) == 0
        for handler, kwargs in bad_calls("trust"):
            if handler == "start":  # the plan must parse before its arguments are read
                kwargs = {**kwargs, "plan": plan.to_dict()}
            if handler == "update_plan":
                kwargs = {**kwargs, "plan": plan.to_dict()}
            with pytest.raises(JobError) as err:
                _comms.call(client, handler, **kwargs)
            assert "must " in str(err.value), (handler, kwargs, err.value)
        # the data plane is unharmed: it still serves the job
        assert _comms.call(client, "stats", job="trust")["sources"][0]["name"] == "web"
        job.stop()

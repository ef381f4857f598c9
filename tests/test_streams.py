"""Further streams (validation): the plan section, and passes served beside training.

A pass over a validation stream gives the same batches every time (or the declared rotation),
split among the DP ranks as the stream's own data plane splits them, also after the job
resumed; interleaving passes leaves the training stream's batches and position as they were.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from distributed import Client

from omniload_dask import Feeder, Job, JobError, local_cluster
from omniload_dask.cluster.streams import stream_plan
from omniload_dask.errors import PlanError
from omniload_dask.plan import parse_plan
from omniload_dask.testing import InlineDataPlane, assert_batches_equal

from .datagen import plan_dict, texts, write_jsonl

STEPS = 3  # steps of a pass
FEEDER_ONLY = ("doc_source_name", "stage")  # what a feeder adds to a built micro-batch


@pytest.fixture(scope="module")
def cluster():
    with local_cluster(2, dashboard_address=None) as c:
        yield c


def _plan(root: Path, name: str = "v", checkpoint: bool = False, **stream: Any):
    write_jsonl(root / "train.jsonl", texts(200, seed=1, mean_words=30, prefix="tr"))
    write_jsonl(root / "val.jsonl", texts(40, seed=2, mean_words=30, prefix="va"))
    validation = {
        "sources": [{"name": "held", "format": "jsonl", "path": str(root / "val.jsonl")}],
        "batch": {"seq_len": 128, "micro_batches": 1},
        "steps": STEPS,
        **stream,
    }
    extra: dict[str, Any] = {"checkpoint": {"url": str(root / "ckpt")}} if checkpoint else {}
    sources = [{"name": "web", "format": "jsonl", "path": str(root / "train.jsonl")}]
    return parse_plan(plan_dict(sources, name=name, streams={"validation": validation}, **extra))


def _pass(job: Job, index: int, ranks=(0, 1)) -> dict[int, list[dict[str, Any]]]:
    out = {}
    for r in ranks:
        with job.feeder(rank=r, stream="validation", pass_index=index, output="numpy") as f:
            out[r] = list(f)
    return out


def _reference(plan, first: int, steps: int) -> dict[int, list[dict[str, Any]]]:
    plane = InlineDataPlane(plan, start_step=first)
    out: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
    for _, batches in plane.stream(steps, start=first):
        for r in out:
            out[r] += batches[r].micro_batches
    return out


def _same(a: dict[int, list[dict[str, Any]]], b: dict[int, list[dict[str, Any]]]) -> None:
    assert set(a) == set(b)
    for r in a:
        assert len(a[r]) == len(b[r]) > 0
        for x, y in zip(a[r], b[r], strict=True):
            x = {k: v for k, v in x.items() if k not in FEEDER_ONLY}
            y = {k: v for k, v in y.items() if k not in FEEDER_ONLY}
            assert_batches_equal(x, y)


# ---------------------------------------------------------------------- the plan section
def test_a_plan_with_streams_round_trips_and_names_bad_fields(tmp_path):
    plan = _plan(tmp_path)
    assert plan.stream_names == ["validation"]
    assert parse_plan(plan.to_dict()) == plan
    spec = plan.stream("validation")
    assert spec.pass_range(5) == (0, STEPS)
    passed = stream_plan(plan, "validation", 5)
    assert passed.name == "v.validation.p5" and passed.checkpoint is None
    assert [s.name for s in passed.sources] == ["held"] and passed.streams == ()
    assert passed.batch.seq_len == 128 and passed.layout == plan.layout
    # the training stream does not depend on the validation stream
    other = parse_plan({**plan.to_dict(), "streams": None})
    assert other.stream_fingerprint() == plan.stream_fingerprint()

    data = plan.to_dict()
    val = data["streams"]["validation"]
    bad = [
        ({"validation": {**val, "sources": []}}, "streams.validation.sources: must be a non"),
        ({"validation": {"steps": 2}}, "streams.validation.sources: a stream needs its own"),
        ({"train": val}, "streams.train: a stream name must"),
        ({"validation": {**val, "steps": None}}, "streams.validation.steps: a pass needs steps"),
        ({"validation": {**val, "rotaton": 2}}, "did you mean 'rotation'"),
        ({"validation": {**val, "steps": 0}}, "streams.validation.steps: must be >= 1"),
        ({"validation": {**val, "batch": {"seq_len": 4}}}, "streams.validation.batch.seq_len"),
        ({"x" * 30: val}, "too long together"),
    ]
    for streams, message in bad:
        with pytest.raises(PlanError, match=message.replace("(", r"\(")):
            parse_plan({**data, "name": "v" * 25, "streams": streams})
    with pytest.raises(PlanError, match="has no stream named 'test'"):
        plan.stream("test")


def test_a_stream_whose_sources_all_end_needs_no_steps(tmp_path):
    plan = _plan(tmp_path)
    data = plan.to_dict()
    val = data["streams"]["validation"]
    val["sources"][0]["epochs"] = 1
    del val["steps"]
    spec = parse_plan(data).stream("validation")
    assert spec.steps is None and spec.pass_range(3) == (0, None)
    with pytest.raises(PlanError, match="a rotation needs steps"):
        parse_plan({**data, "streams": {"validation": {**val, "rotation": 2}}})


# ---------------------------------------------------------------------- on a cluster
def test_passes_repeat_rotate_and_leave_training_untouched(tmp_path, cluster):
    plan = _plan(tmp_path, name="vt")
    train_ref = InlineDataPlane(plan)
    expected = {r: [] for r in (0, 1)}
    for _, batches in train_ref.stream(6):
        for r in expected:
            expected[r] += batches[r].micro_batches
    with Client(cluster) as client:
        job = Job.start(plan, client=client)
        trainers = {r: job.feeder(rank=r, output="numpy") for r in (0, 1)}
        got: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
        passes = []
        for step in range(6):
            for r, feeder in trainers.items():
                for mb in next(feeder.steps()):
                    got[r].append(mb)
            if step % 2 == 1:  # an evaluation every other step, as a trainer would
                passes.append(_pass(job, step // 2))
        _same(expected, got)  # training batches and position: as without passes
        assert trainers[0].state_dict()["step"] == 6
        _same(passes[0], passes[1])
        _same(passes[0], passes[2])
        _same(passes[0], _reference(stream_plan(plan, "validation", 0), 0, STEPS))
        # a pass whose job was stopped (old passes are) gives the same batches again
        running = client.run_on_scheduler(lambda dask_scheduler: sorted(
            dask_scheduler.plugins["omniload"].jobs))  # fmt: skip
        assert "vt.validation.p0" not in running and "vt.validation.p2" in running
        _same(passes[0], _pass(job, 0))
        for feeder in trainers.values():
            feeder.close()
        with pytest.raises(JobError, match="has no stream named 'test'"):
            Feeder(job.name, client=client, rank=0, stream="test")
        job.stop()
        running = client.run_on_scheduler(lambda dask_scheduler: sorted(
            dask_scheduler.plugins["omniload"].jobs))  # fmt: skip
        assert running == []  # the job's passes stop with it


def test_a_rotation_serves_its_slices_in_turn(tmp_path, cluster):
    plan = _plan(tmp_path, name="vr", rotation=2)
    with Client(cluster) as client:
        job = Job.start(plan, client=client)
        first, second, third = (_pass(job, k) for k in range(3))
        _same(second, _reference(stream_plan(plan, "validation", 1), STEPS, STEPS))
        _same(first, third)
        job.stop()


def test_a_pass_after_a_resume_gives_the_same_batches(tmp_path, cluster):
    plan = _plan(tmp_path, name="vc", checkpoint=True)
    with Client(cluster) as client:
        job = Job.start(plan, client=client)
        with (
            job.feeder(rank=0, output="numpy", max_steps=4) as f0,
            job.feeder(rank=1, output="numpy", max_steps=4) as f1,
        ):
            list(f0), list(f1)
        before = _pass(job, 0)
        job.flush_checkpoint()
        job.stop()
        again = Job.start(plan, client=client, resume=4)
        assert again.info["resumed"] and again.info["start_step"] == 4
        _same(before, _pass(again, 0))
        again.stop()

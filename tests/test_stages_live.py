"""Training stages changed live: ``update_plan`` with another batch budget or context.

The change takes effect at a step not built yet and is logged, so the stream after it equals
that of a plan that declared the merged stages from the start, a checkpoint taken after it
resumes exactly, and a change that would reach a built step (or break a stage's rules) is
refused with the field named.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from distributed import Client

from omniload_dask import Job, local_cluster
from omniload_dask.errors import JobError
from omniload_dask.plan import parse_plan
from omniload_dask.testing import InlineDataPlane, batch_digest, check_resume_equivalence

from .datagen import plan_dict, texts, write_jsonl

RAMP = {"at_step": 3, "global_tokens": 1024, "micro_batches": 4}
LONG = {"at_step": 9, "seq_len": 512, "micro_batches": 1, "global_tokens": 1024}


def _plan(root: Path, stages=(RAMP,), checkpoint: bool = False, **batch):
    if not (root / "a.jsonl").exists():
        write_jsonl(root / "a.jsonl", texts(300, seed=1, mean_words=60, prefix="a"))
        write_jsonl(root / "b.jsonl", texts(200, seed=2, mean_words=150, prefix="b"))
    sources = [
        {"name": "a", "format": "jsonl", "path": str(root / "a.jsonl"), "weight": 2},
        {"name": "b", "format": "jsonl", "path": str(root / "b.jsonl"), "weight": 1},
    ]
    extra = {"checkpoint": {"url": str(root / "ckpt")}} if checkpoint else {}
    shape = {"seq_len": 128, "micro_batches": 2, "global_tokens": 512}
    shape["stages"] = list(stages) or None
    return parse_plan(plan_dict(sources, batch={**shape, **batch}, **extra))


def _digests(run: InlineDataPlane, steps: int, start: int = 0) -> dict[int, dict]:
    return {t: {g: batch_digest(b) for g, b in bs.items()} for t, bs in run.stream(steps, start)}


def _long(at: int) -> dict:
    return {**LONG, "at_step": at}


def test_a_stage_added_live_gives_the_stream_of_a_plan_that_declared_it(tmp_path):
    run = InlineDataPlane(_plan(tmp_path))
    before = _digests(run, 5)
    floor = run.coord.view.earliest_change  # (the first step not built: drawn ahead of 5)
    stages = (RAMP, _long(floor + 2))
    assert run.update_plan(_plan(tmp_path, stages=stages)) == floor
    assert run.coord.view.batch.stages[-1].at_step == floor + 2
    after = _digests(run, floor, start=5)
    declared = _digests(InlineDataPlane(_plan(tmp_path, stages=stages)), floor + 5)
    assert {**before, **after} == declared
    entry = run.coord.view.log[-1]
    assert (entry["step"], entry["kind"], entry["stages"][0]["at_step"]) == (
        floor,
        "stages",
        floor + 2,
    )


def test_changing_the_stage_in_force_starts_a_stage_where_the_change_takes_effect(tmp_path):
    run = InlineDataPlane(_plan(tmp_path))
    before = _digests(run, 5)
    # the new version gives the batch without stages: from the change on it is 768 tokens
    step = run.update_plan(_plan(tmp_path, stages=(), global_tokens=768))
    after = _digests(run, step - 2, start=5)
    merged = [RAMP, {"at_step": step, "global_tokens": 768, "micro_batches": 2}]
    for t, batches in InlineDataPlane(_plan(tmp_path, stages=merged)).stream(step + 3):
        want = 768 if t >= step else 1024 if t >= 3 else 512
        assert sum(b.num_tokens for b in batches.values()) == want, t
        assert {g: batch_digest(b) for g, b in batches.items()} == {**before, **after}[t], t


def test_a_change_for_a_later_step_waits_for_it(tmp_path):
    run = InlineDataPlane(_plan(tmp_path))
    before = _digests(run, 4)
    at = run.coord.view.earliest_change + 3
    assert run.update_plan(_plan(tmp_path, stages=(), global_tokens=768), at_step=at) == at
    after = _digests(run, at, start=4)
    merged = [RAMP, {"at_step": at, "global_tokens": 768, "micro_batches": 2}]
    assert {**before, **after} == _digests(InlineDataPlane(_plan(tmp_path, stages=merged)), at + 4)


def test_the_micro_batches_carry_the_stage_they_were_built_in(tmp_path):
    run = InlineDataPlane(_plan(tmp_path, stages=()))
    list(run.stream(3))
    step = run.update_plan(_plan(tmp_path, stages=(), global_tokens=1024, micro_batches=4))
    for t, batches in run.stream(step, start=3):
        for batch in batches.values():
            assert {mb.get("stage", 0) for mb in batch.micro_batches} == {int(t >= step)}, t
            assert len(batch.micro_batches) >= (4 if t >= step else 2)


def test_a_checkpoint_after_a_live_stage_change_resumes_exactly(tmp_path):
    plan = _plan(tmp_path, checkpoint=True)
    run = InlineDataPlane(plan)
    list(run.stream(4))
    floor = run.coord.view.earliest_change
    stages = (RAMP, _long(floor + 2))
    assert run.update_plan(_plan(tmp_path, stages=stages, checkpoint=True)) == floor
    end = floor + 6
    ref = _digests(run, end - 4, start=4)
    run.checkpoint()
    for at in (floor, floor + 2, floor + 4):
        # the log replays the change over the plan of the start, or the version it led to
        for resume_plan in (plan, _plan(tmp_path, stages=stages, checkpoint=True)):
            again = InlineDataPlane(resume_plan, resume=at)
            assert again.coord.view.batch.stages[-1].at_step == floor + 2
            assert again.coord.view.stages_version == 1  # (the count its steps carry)
            assert _digests(again, end - at, start=at) == {t: ref[t] for t in range(at, end)}


def test_a_change_queued_for_a_later_step_is_replayed_by_a_resume(tmp_path):
    plan = _plan(tmp_path, checkpoint=True)
    later = _plan(tmp_path, stages=(), global_tokens=768, checkpoint=True)

    def changes(run):
        run.update_plan(later, at_step=6)

    assert check_resume_equivalence(plan, 10, [2, 6, 8], changes=changes) > 0
    assert InlineDataPlane(plan, resume=8).coord.view.batch.stages[-1].at_step == 6


def test_bad_live_stage_changes_are_refused_and_change_nothing(tmp_path):
    run = InlineDataPlane(_plan(tmp_path))
    list(run.stream(5))
    floor = run.coord.view.earliest_change
    early = {"at_step": 2, "global_tokens": 768}
    with pytest.raises(JobError, match=r"batch.stages\[0\] starts at step 2, which is already"):
        run.update_plan(_plan(tmp_path, stages=(early, RAMP)))
    with pytest.raises(JobError, match=f"step 1 is already built.*{floor}"):
        run.update_plan(_plan(tmp_path, global_tokens=768), at_step=1)
    with pytest.raises(JobError, match="batch.long_documents holds for the whole run"):
        run.update_plan(_plan(tmp_path, stages=(), long_documents="truncate"))
    # a stage given in tokens that starts before the change
    with pytest.raises(JobError, match=r"batch.stages\[1\] starts at step 4, which is already"):
        run.update_plan(
            _plan(tmp_path, stages=(RAMP, {"at_tokens": 2000, "seq_len": 256})), at_step=floor
        )
    assert run.coord.view.log == [] and run.coord.view.batch == _plan(tmp_path).batch


def test_a_live_change_under_one_documents_minimum_is_refused_naming_the_field(tmp_path):
    plan = _plan(tmp_path, stages=(), long_documents="truncate")
    bad = plan_dict(
        [{"name": "a", "format": "jsonl", "path": str(tmp_path / "a.jsonl")}],
        batch={"seq_len": 128, "micro_batches": 2, "global_tokens": 64,
               "long_documents": "truncate"},
    )  # fmt: skip
    with pytest.raises(Exception, match=r"batch.global_tokens: must be >= seq_len"):
        InlineDataPlane(plan).update_plan(parse_plan(bad))


def test_a_feeders_copy_of_the_job_is_read_again_once_per_change_of_the_stages_count(tmp_path):
    from dataclasses import replace

    from omniload_dask.trainer.jobcopy import JobCopy

    run = InlineDataPlane(_plan(tmp_path, stages=(_long(40),)))
    start = {"plan": run.plan.to_dict(), "sources": run.coord.view.names}
    list(run.stream(3))
    at = run.update_plan(_plan(tmp_path, stages=(_altered(40),)))
    reads: list[int] = []

    def info() -> dict:  # what the job's info handler gives now
        reads.append(1)
        batch = run.coord.view.batch
        return {**start, "plan": replace(run.plan, batch=batch).to_dict(), "stages_version": 1}

    # a feeder started before the change (count 0), and one started after it (count 1)
    copies = [JobCopy.of(start), JobCopy.of(info())]
    assert copies[1].plan.batch.at(40).seq_len == 256 and len(reads) == 1
    per_copy = []
    for i, copy in enumerate(copies):
        reads.clear()
        for t, batches in run.stream(at + 2 - 3, start=3):
            for mb in batches[0].micro_batches:
                assert mb.get("stages_version", 0) == int(t >= at), t
                copy = copy.seen(mb, info)
                # (a copy read again is the job's batch now: right for every step)
                assert copy.plan.batch.at(40).seq_len == (256 if t >= at or i else 512), t
                assert copy.stages_version == int(t >= at), t
        per_copy.append(len(reads))
    # read when the stream reaches the change; the later copy also where it meets older steps
    assert per_copy == [1, 2]


def merged_at(at: int) -> tuple[dict, ...]:
    """The stages the running job's change below leads to."""
    return ({"at_step": at, "global_tokens": 1024, "micro_batches": 4},)


@pytest.fixture(scope="module")
def cluster():
    with local_cluster(1, dashboard_address=None) as c:
        yield c


def test_a_running_job_changes_its_stages_and_the_feeders_follow(tmp_path, cluster, capsys):
    import yaml

    from omniload_dask.cli import main

    plan = _plan(tmp_path, stages=())
    with Client(cluster) as client:
        job = Job.start(plan, client=client)
        feeders = [job.feeder(rank=r, output="numpy") for r in (0, 1)]
        got: dict[int, list] = {
            r: [next(f.steps()) for _ in range(3)] for r, f in enumerate(feeders)
        }
        # the version gives the ramp-up's budget: from the first step not built on
        reply = job.update_plan(_plan(tmp_path, stages=(), global_tokens=1024, micro_batches=4))
        at = reply["step"]
        assert reply["stages"] == [
            {"at_step": at, "global_tokens": 1024, "global_documents": None, "seq_len": 128,
             "micro_batches": 4}
        ]  # fmt: skip
        with pytest.raises(Exception, match="already built"):
            job.update_plan(_plan(tmp_path, stages=(), global_tokens=768), at_step=1)
        # the same from the command line: a long-context stage far ahead
        later = _plan(tmp_path, stages=(*merged_at(at), _long(at + 60)), global_tokens=1024)
        (tmp_path / "v3.yaml").write_text(yaml.safe_dump(later.to_dict()))
        address = client.scheduler.address
        assert (
            main(["update-plan", "--address", address, "--job", "t", str(tmp_path / "v3.yaml")])
            == 0
        )
        assert f"{{'at_step': {at + 60}, 'global_tokens': 1024" in capsys.readouterr().out
        for t in range(3, at + 3):  # (ranks in step: a block waits for every rank)
            for r, f in enumerate(feeders):
                if t == at + 1:  # (the step at the change told the feeder)
                    assert (f.stage["stage"], f.stage["micro_batches"]) == (1, 4)
                got[r].append(next(f.steps()))
        for f in feeders:
            f.close()
        job.stop()
    merged = merged_at(at)
    declared = dict(InlineDataPlane(_plan(tmp_path, stages=merged)).stream(at + 3))
    for r in (0, 1):
        for t, micro in enumerate(got[r]):
            assert {mb.get("stage", 0) for mb in micro} == {int(t >= at)}, t
            want = [np.asarray(mb["input_ids"]).tolist() for mb in declared[t][r].micro_batches]
            assert [np.asarray(mb["input_ids"]).tolist() for mb in micro] == want, (r, t)


def _ids(micro: list) -> list:
    return [np.asarray(mb["input_ids"]).tolist() for mb in micro]


def _altered(at: int) -> dict:
    """The long-context stage of :func:`_long` with other values, its start kept."""
    return {"at_step": at, "seq_len": 256, "micro_batches": 2, "global_tokens": 768}


def test_a_change_of_a_later_stage_alone_reaches_feeder_stage_before_that_stage(tmp_path, cluster):
    # The stage numbers do not change (the later stage keeps its start): the feeder learns
    # of the change from the count of stage changes its micro-batches carry.
    far = 70
    plan = _plan(tmp_path, stages=(_long(far),), checkpoint=True)
    new = {"stage": 1, "at_step": far, "seq_len": 256, "micro_batches": 2, "global_tokens": 768}

    def seen(f) -> dict:
        return {k: f.stage[k] for k in new}

    with Client(cluster) as client:
        job = Job.start(plan, client=client)
        feeders = [job.feeder(rank=r, output="numpy") for r in (0, 1)]
        for _ in range(3):
            for f in feeders:
                next(f.steps())
        reply = job.update_plan(_plan(tmp_path, stages=(_altered(far),), checkpoint=True))
        at = reply["step"]
        assert reply["stages"] == [{**_altered(far), "global_documents": None}]
        assert at + 2 < far, f"the change takes effect at {at}: too close to step {far}"
        got: dict[int, dict[int, list]] = {0: {}, 1: {}}
        for t in range(3, far + 1):
            for r, f in enumerate(feeders):
                if t == far:  # the next step is the altered stage's first: seen before it
                    assert seen(f) == new
                micro = next(f.steps())
                got[r][t] = _ids(micro)
                assert {mb.get("stages_version", 0) for mb in micro} == {int(t >= at)}, t
                if t >= at:  # (a step cut after the change told the feeder)
                    assert f.plan.batch.at(far).seq_len == 256, t
                if t == far:
                    assert {
                        (mb["stage"], mb["seq_len"], mb["num_micro_steps"]) for mb in micro
                    } == {(1, 256, 2)}
        states = [f.state_dict() for f in feeders]
        job.flush_checkpoint()
        for f in feeders:
            f.close()
        job.stop()
        # a resume after the change (from the plan of the start: the log replays it)
        resume_at = far - 4
        again = Job.start(plan, client=client, resume=resume_at)
        try:
            feeders = [again.feeder(rank=r, output="numpy") for r in (0, 1)]
            for f, state in zip(feeders, states, strict=True):
                f.load_state_dict({**state, "step": resume_at})
                assert seen(f) == {**new, "stage": 0, "at_step": 0, "seq_len": 128,
                                   "global_tokens": 512}  # fmt: skip
                assert f.plan.batch.at(far).seq_len == 256  # (read with the job's log)
            for t in range(resume_at, far + 1):
                for r, f in enumerate(feeders):
                    if t == far:
                        assert seen(f) == new
                    assert _ids(next(f.steps())) == got[r][t], (r, t)
        finally:
            for f in feeders:
                f.close()
            again.stop()


def test_a_change_that_drops_the_steps_being_dealt_off_the_loop_leaves_the_job_drawing(
    tmp_path, cluster, monkeypatch
):
    # A live change draws again from the first step not built, dropping the steps the dealing
    # thread is dealing. When that dealing ends, nothing it dealt is committed and nothing
    # moved: the data plane must still draw on, since the ranks already asked for those steps
    # and no request would wake it again.
    import threading

    from omniload_dask.cluster import dealing

    entered, release, armed = threading.Event(), threading.Event(), threading.Event()
    deal_together = dealing.StepDealing.deal_together

    def held(self, drawn):
        if armed.is_set() and not release.is_set():
            entered.set()
            release.wait(60)
        return deal_together(self, drawn)

    monkeypatch.setattr(dealing.StepDealing, "inline", lambda self: False)
    monkeypatch.setattr(dealing.StepDealing, "deal_together", held)
    far = 70
    plan = _plan(tmp_path, stages=(_long(far),))
    with Client(cluster) as client:
        job = Job.start(plan, client=client)
        feeders = [job.feeder(rank=r, output="numpy") for r in (0, 1)]
        done = threading.Event()

        def consume() -> None:  # the ranks ask for steps on, past those drawn ahead
            for _ in range(far - 1):
                for f in feeders:
                    next(f.steps())
            done.set()

        reader = threading.Thread(target=consume, daemon=True)
        try:
            for f in feeders:  # (the first steps are dealt before the hold)
                next(f.steps())
            armed.set()
            reader.start()
            assert entered.wait(60), "no step was dealt off the loop"
            reply = job.update_plan(_plan(tmp_path, stages=(_altered(far),)))
            release.set()
            reader.join(240)  # (steps come in seconds; this bounds a stall)
            assert done.is_set(), f"the job stalled after the change at step {reply['step']}"
        finally:
            release.set()
            for f in feeders:
                f.close()
            job.stop()

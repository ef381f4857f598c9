"""Training stages: the budget, seq_len and micro-batches change at declared steps or tokens.

The stream stays a pure function of the plan: each step is cut as its stage says, a checkpoint
restored before or after a stage change continues exactly as the uninterrupted run, and bad
stages are refused when the plan is read, naming the field.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from distributed import Client

from omniload_dask import Job, local_cluster
from omniload_dask.errors import PlanError
from omniload_dask.plan import parse_plan
from omniload_dask.testing import InlineDataPlane, check_resume_equivalence
from omniload_dask.trainer.feeder import stage_of

from .datagen import plan_dict, texts, write_jsonl

STAGES = [
    {"at_step": 3, "global_tokens": 1024, "micro_batches": 4},  # a batch ramp-up
    {"at_tokens": 4096, "seq_len": 512, "micro_batches": 1, "global_tokens": 1024},  # long ctx
]


def _plan(root: Path, checkpoint: bool = False, **batch):
    write_jsonl(root / "a.jsonl", texts(300, seed=1, mean_words=60, prefix="a"))
    write_jsonl(root / "b.jsonl", texts(200, seed=2, mean_words=150, prefix="b"))
    sources = [
        {"name": "a", "format": "jsonl", "path": str(root / "a.jsonl"), "weight": 2},
        {"name": "b", "format": "jsonl", "path": str(root / "b.jsonl"), "weight": 1},
    ]
    extra = {"checkpoint": {"url": str(root / "ckpt")}} if checkpoint else {}
    shape = {"seq_len": 128, "micro_batches": 2, "global_tokens": 512, "stages": STAGES}
    return parse_plan(plan_dict(sources, batch={**shape, **batch}, **extra))


def test_stages_start_where_declared_and_at_tokens_becomes_a_step(tmp_path):
    plan = _plan(tmp_path)
    # steps 0-2 take 512 tokens each, steps from 3 on 1024: step 6 starts at 4608 >= 4096
    assert [s.at_step for s in plan.batch.stages] == [3, 6]
    assert parse_plan(plan.to_dict()) == plan
    assert stage_of(plan.batch, 2)["stage"] == 0
    assert stage_of(plan.batch, 4) == {
        "stage": 1,
        "at_step": 3,
        "seq_len": 128,
        "micro_batches": 4,
        "global_tokens": 1024,
        "global_documents": None,
        "buckets": [],
    }
    assert stage_of(plan.batch, 50)["seq_len"] == 512


def test_each_step_is_cut_as_its_stage_says(tmp_path):
    plan = _plan(tmp_path)
    for t, batches in InlineDataPlane(plan).stream(8):
        shape = plan.batch.at(t)
        tokens = sum(b.num_tokens for b in batches.values())
        assert tokens == shape.global_tokens, t  # split fills each budget exactly
        for batch in batches.values():
            assert len(batch.micro_batches) == shape.micro_batches, t
            for mb in batch.micro_batches:
                assert int(mb["num_tokens"]) <= shape.seq_len
                assert np.diff(mb["cu_seqlens"]).max() <= shape.seq_len


def test_a_checkpoint_resumes_across_a_stage_change_exactly(tmp_path):
    plan = _plan(tmp_path, checkpoint=True)
    # before the ramp-up, on its first step, between the stages, after the long-context one
    assert check_resume_equivalence(plan, 9, [2, 3, 4, 7]) > 0


def test_a_checkpoint_of_a_plan_without_stages_resumes_with_stages_added_later(tmp_path):
    from omniload_dask.errors import CheckpointError
    from omniload_dask.testing import batch_digest

    staged = _plan(tmp_path, checkpoint=True, stages=[{"at_step": 6, "global_tokens": 1024}])
    data = staged.to_dict()
    plain = parse_plan({**data, "batch": {**data["batch"], "stages": None}})
    run = InlineDataPlane(plain)
    list(run.stream(4))
    run.checkpoint()
    reference = dict(InlineDataPlane(parse_plan({**data, "checkpoint": None})).stream(9))
    for t, batches in InlineDataPlane(staged, resume=4).stream(5, start=4):
        assert {g: batch_digest(b) for g, b in batches.items()} == {
            g: batch_digest(b) for g, b in reference[t].items()
        }, t
    other = parse_plan({**data, "batch": {**data["batch"], "global_tokens": 768, "stages": None}})
    with pytest.raises(CheckpointError, match="add a batch.stages entry"):
        InlineDataPlane(other, resume=4)


def test_without_stages_the_stream_is_as_before(tmp_path):
    plan = _plan(tmp_path)
    plain = parse_plan({**plan.to_dict(), "batch": {**plan.to_dict()["batch"], "stages": None}})
    assert plain.batch.stages == () and "stages" not in plain.to_dict()["batch"]
    staged = dict(InlineDataPlane(plan).stream(3))
    for t, batches in InlineDataPlane(plain).stream(3):  # the steps before the first stage
        for g, batch in batches.items():
            assert batch.num_tokens == staged[t][g].num_tokens


@pytest.mark.parametrize(
    ("stages", "batch", "message"),
    [
        ([{"at_step": 4, "global_tokens": 8}, {"at_step": 2, "global_tokens": 9}], {},
         r"batch.stages\[1\].at_step: stages must start in order"),
        ([{"at_step": 4}], {}, r"batch.stages\[0\]: a stage changes at least one of"),
        ([{"global_tokens": 8}], {}, r"batch.stages\[0\].at_step: give at_step or at_tokens"),
        ([{"at_step": 4, "pad_to_seq_len": True}], {}, r"batch.stages\[0\].pad_to_seq_len: a stage gives at_step"),
        ([{"at_step": 4, "global_tokens": 64}], {"long_documents": "truncate"},
         r"batch.stages\[0\].global_tokens: must be >= seq_len \(128\) so any document fits"),
        ([{"at_step": 4, "seq_len": 256}], {"long_documents": "truncate"},
         r"batch.stages\[0\]: with long_documents: truncate a stage keeps seq_len"),
        ([{"at_tokens": 900, "seq_len": 256}], {"global_tokens": None, "global_documents": 8},
         r"batch.stages\[0\].at_tokens: needs every step before it filled exactly"),
        ([{"at_step": 4, "micro_batches": 0}], {}, r"batch.stages\[0\].micro_batches: must be"),
    ],
)  # fmt: skip
def test_bad_stages_are_refused_naming_the_field(tmp_path, stages, batch, message):
    with pytest.raises(PlanError, match=message):
        _plan(tmp_path, **{**batch, "stages": stages})


@pytest.fixture(scope="module")
def cluster():
    with local_cluster(1, dashboard_address=None) as c:
        yield c


def test_the_feeder_says_the_stage_before_its_step_and_in_each_micro_batch(tmp_path, cluster):
    plan = _plan(tmp_path)
    with Client(cluster) as client:
        job = Job.start(plan, client=client)
        feeders = [job.feeder(rank=r, output="numpy", max_steps=7) for r in (0, 1)]
        seen = []
        for _ in range(7):
            ahead = feeders[0].stage
            for f in feeders:
                micro = next(f.steps())
                assert {mb["stage"] for mb in micro} == {ahead["stage"]}
                assert len(micro) == ahead["micro_batches"]
                assert all(int(mb["seq_len"]) <= ahead["seq_len"] for mb in micro)
            seen.append(ahead["stage"])
        assert seen == [0, 0, 0, 1, 1, 1, 2]
        for f in feeders:
            f.close()
        job.stop()

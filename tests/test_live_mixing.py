"""Mixing and curriculum: exact shares, schedules, live changes, sources joining and leaving."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from omniload_dask import JobError, PlanError
from omniload_dask.batching.mixing import WeightSchedule
from omniload_dask.plan import MixingSpec, SchedulePoint, SourceSpec, parse_plan
from omniload_dask.testing import InlineDataPlane, batch_digest

from .datagen import plan_dict


def sources(root: Path, **extra: dict) -> list[dict]:
    out = [
        {
            "name": "a",
            "format": "jsonl",
            "path": str(root / "a.jsonl"),
            "weight": 0.5,
            "unit_bytes": 8192,
        },
        {
            "name": "b",
            "format": "jsonl",
            "path": str(root / "b.jsonl"),
            "weight": 0.3,
            "unit_bytes": 8192,
        },
        {"name": "c", "format": "parquet", "path": str(root / "c.parquet"), "weight": 0.2},
    ]
    for src in out:
        src.update(extra.get(src["name"], {}))
    return out


def make(root: Path, **overrides):
    srcs = overrides.pop("sources", None) or sources(root)
    base = {
        "batch": {"seq_len": 512, "micro_batches": 2, "global_tokens": 2048},
        "layout": {"dp": 2},
    }
    base.update(overrides)
    return parse_plan(plan_dict(srcs, **base))


def shares(plane: InlineDataPlane, start: int = 0, stop: int | None = None) -> np.ndarray:
    by_tokens = plane.plan.mixing_by == "tokens"
    figs = [
        f for f in plane.coord.view.history if f.step >= start and (stop is None or f.step < stop)
    ]
    n = len(plane.coord.view.streams)
    got = np.zeros(n)
    for f in figs:
        vals = f.source_tokens if by_tokens else f.source_documents
        got[: len(vals)] += vals
    return got / got.sum()


@pytest.mark.parametrize("by", ["tokens", "documents"])
def test_realised_shares_within_half_a_point_over_1000_steps(corpus, by):
    plane = InlineDataPlane(make(corpus, mixing={"by": by}), build=False)
    plane.draw(1000)
    got = shares(plane, stop=1000)
    assert np.abs(got - [0.5, 0.3, 0.2]).max() < 0.005, got
    mix = plane.coord.view.mixture(window=200)
    assert [m["name"] for m in mix] == ["a", "b", "c"]
    assert abs(mix[0]["realised_total"] - 0.5) < 0.01
    assert mix[0]["target_now"] == pytest.approx(0.5)


def test_weight_change_keeps_earlier_batches_and_rules_later_ones(corpus):
    plan = make(corpus)
    ref = [
        {g: batch_digest(b) for g, b in bs.items()} for _, bs in InlineDataPlane(plan).stream(30)
    ]
    plane = InlineDataPlane(plan)
    assert plane.coord.set_weights({"a": 0.0, "b": 0.25, "c": 0.75}, at_step=12).step == 12
    got = [{g: batch_digest(b) for g, b in bs.items()} for _, bs in plane.stream(30)]
    assert got[:12] == ref[:12]
    assert got[12] != ref[12]
    for fig in plane.coord.view.history:
        if fig.step >= 12:
            assert fig.source_documents[0] == 0  # a has weight 0 from step 12 on
    plane.draw(300)
    assert np.abs(shares(plane, start=12)[1:] - [0.25, 0.75]).max() < 0.01
    assert plane.coord.view.log == [
        {"step": 12, "kind": "weights", "weights": {"a": 0.0, "b": 0.25, "c": 0.75}}
    ]


def test_partial_change_leaves_other_sources_on_the_plan(corpus):
    plane = InlineDataPlane(make(corpus), build=False)
    plane.coord.set_weights({"c": 0.7})
    assert plane.coord.view.weights_at(0).tolist() == [0.5, 0.3, 0.7]


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ({"a": -1}, "weights.a: must be >= 0, got -1"),
        ({"a": float("nan")}, "weights.a: must be a finite number"),
        ({"a": 0, "b": 0, "c": 0}, "would leave no source with a weight > 0"),
        ({"zzz": 1}, "weights.zzz: unknown source"),
        ({}, "give at least one source weight"),
    ],
)
def test_bad_weights_are_rejected_and_the_job_carries_on(corpus, weights, message):
    plane = InlineDataPlane(make(corpus), build=False)
    plane.draw(3)
    with pytest.raises((JobError, PlanError), match=message):
        plane.coord.set_weights(weights)
    with pytest.raises(JobError, match="already built"):
        plane.coord.set_weights({"a": 1}, at_step=0)
    assert plane.coord.view.error is None
    plane.draw(3)  # carries on
    assert plane.coord.view.log == []


def test_schedule_points_must_be_in_order_and_name_known_sources(corpus):
    with pytest.raises(PlanError, match=r"mixing.schedule\[1\].at: must be > the previous"):
        make(
            corpus,
            mixing={"schedule": [{"at": 10, "weights": {"a": 1}}, {"at": 5, "weights": {"a": 2}}]},
        )
    with pytest.raises(PlanError, match=r"mixing.schedule\[0\].weights.q: unknown source"):
        make(corpus, mixing={"schedule": [{"at": 0, "weights": {"q": 1}}]})
    with pytest.raises(PlanError, match=r"mixing.schedule\[0\].weights: at least one weight"):
        make(corpus, mixing={"schedule": [{"at": 0, "weights": {"a": 0, "b": 0, "c": 0}}]})


def test_weight_schedule_interpolates():
    spec = MixingSpec(
        interpolate="linear",
        schedule=(SchedulePoint(0, {"web": 1.0}), SchedulePoint(100, {"web": 3.0, "code": 2.0})),
    )
    sched = WeightSchedule({"web": 5.0, "code": 0.0}, spec)
    assert sched.at(["web", "code"], 50, 0).tolist() == [2.0, 1.0]
    assert sched.at(["web", "code"], 500, 0).tolist() == [3.0, 2.0]
    const = WeightSchedule({"web": 5.0}, MixingSpec(schedule=(SchedulePoint(10, {"web": 1.0}),)))
    assert const.at(["web"], 9, 0).tolist() == [5.0]  # before the first point: plan weight
    assert const.at(["web"], 10, 0).tolist() == [1.0]
    tok = WeightSchedule(
        {"web": 1.0}, MixingSpec(over="tokens", schedule=(SchedulePoint(1000, {"web": 4.0}),))
    )
    assert tok.at(["web"], 0, 999).tolist() == [1.0] and tok.at(["web"], 0, 1000).tolist() == [4.0]


@pytest.mark.parametrize("interpolate", ["constant", "linear"])
def test_steps_follow_a_schedule(corpus, interpolate):
    plan = make(
        corpus,
        mixing={
            "interpolate": interpolate,
            "schedule": [
                {"at": 0, "weights": {"a": 1, "b": 0, "c": 0}},
                {"at": 200, "weights": {"a": 0, "b": 1, "c": 1}},
            ],
        },
    )
    plane = InlineDataPlane(plan, build=False)
    plane.draw(400)
    first = shares(plane, stop=5)
    assert first[0] > 0.95
    late = shares(plane, start=210, stop=400)
    assert late[0] == 0 and abs(late[1] - 0.5) < 0.02
    if interpolate == "linear":
        mid = shares(plane, start=90, stop=110)
        assert 0.3 < mid[0] < 0.7


def test_sources_join_and_leave_keeping_their_cursors(corpus):
    plan = make(corpus)
    base = InlineDataPlane(plan, build=False)
    base.draw(40)
    plane = InlineDataPlane(plan)
    list(plane.stream(10))
    new = SourceSpec(name="d", format="jsonl", paths=(str(corpus / "d.jsonl"),), weight=0.4)
    step = plane.add_source(new)
    assert step == plane.coord.view.next_step
    removed_at = plane.coord.remove_source("b", at_step=step + 5)
    plane.draw(30)
    figs = {
        f.step: f.source_documents + [0] * (4 - len(f.source_documents))
        for f in plane.coord.view.history
    }
    assert all(figs[t][3] == 0 for t in figs if t < step)
    assert sum(figs[t][3] for t in figs if t >= step) > 0
    assert all(figs[t][1] == 0 for t in figs if t >= removed_at)
    # b's cursor stays where it stopped; bringing it back continues from there
    b = plane.coord.view.streams[1]
    cursor = (b.epoch, b.position, b.row, b.docs)
    plane.draw(5)
    assert (b.epoch, b.position, b.row, b.docs) == cursor
    plane.add_source(plan.sources[1])
    plane.draw(5)
    assert b.docs > cursor[3] and not b.retired
    with pytest.raises(JobError, match="already in the job"):
        plane.coord.add_source(plan.sources[0], plane.coord.view.streams[0].catalog)
    with pytest.raises(JobError, match="no source 'zzz'"):
        plane.coord.remove_source("zzz")


def test_a_source_with_limited_epochs_stops_and_the_stream_ends(corpus):
    plan = make(corpus, sources=sources(corpus, c={"epochs": 2}))
    plane = InlineDataPlane(plan, build=False)
    plane.draw(1000)
    c = plane.coord.view.streams[2]
    assert c.exhausted and c.docs == 2 * 100
    assert plane.coord.view.stats()["sources"][2]["exhausted"]
    assert plane.coord.view.streams[0].epoch >= 1  # the others go on
    every = make(corpus, sources=sources(corpus, a={"epochs": 1}, b={"epochs": 1}, c={"epochs": 1}))
    done = InlineDataPlane(every, build=False)
    done.draw(10_000)  # returns when the stream ends
    assert done.coord.view.end_step is not None and done.coord.view.end_step < 10_000
    assert [s.docs for s in done.coord.view.streams] == [300, 200, 100]


# ---------------------------------------------------------------------- on a real cluster
def test_live_changes_on_a_running_job_match_the_replayed_stream(corpus, tmp_path):
    import yaml

    from omniload_dask import Job
    from omniload_dask.cli import main

    plan = make(corpus, name="live")
    with Job.start(plan, workers=2, dashboard_address=None) as job:
        feeders = [job.feeder(dp_rank=g, output="numpy") for g in range(2)]
        got: list[dict] = []

        def take(n: int) -> None:
            for _ in range(n):
                got.append(
                    {
                        g: [
                            tuple(mb["input_ids"].tolist()) + tuple(mb["doc_id"].tolist())
                            for mb in next(f.steps())
                        ]
                        for g, f in enumerate(feeders)
                    }
                )

        take(4)
        with pytest.raises(PlanError, match="weights.a: must be >= 0, got -2"):
            job.set_weights({"a": -2})
        with pytest.raises((JobError, PlanError), match="weights.nope: unknown source"):
            job.set_weights({"nope": 1})
        at = job.set_weights({"a": 0.1, "c": 0.6})
        assert at >= 4
        take(3)
        # a new plan version: d joins, b leaves
        new = dict(plan.to_dict())
        new["sources"] = [s for s in new["sources"] if s["name"] != "b"] + [
            {"name": "d", "format": "jsonl", "path": [str(corpus / "d.jsonl")], "weight": 0.5}
        ]
        (tmp_path / "v2.yaml").write_text(yaml.safe_dump(new))
        assert (
            main(
                [
                    "update-plan",
                    "--address",
                    job.client.scheduler.address,
                    "--job",
                    "live",
                    str(tmp_path / "v2.yaml"),
                ]
            )
            == 0
        )
        changed = job.stats()
        # past the new version's step (the data plane may have drawn well ahead of the ranks)
        joined = max(e["step"] for e in changed["log"])
        take(max(12, joined + 6 - len(got)))
        log = list(job.mixture(window=5))
        assert [m["name"] for m in log] == ["a", "b", "c", "d"]
        assert log[1]["retired"] and log[3]["realised_window"] > 0
    # the same changes, replayed at the same steps, give the same batches bit for bit (the new
    # plan version's weights rule from its step: a and c back to 0.5 and 0.2)
    assert [e["kind"] for e in changed["log"]] == ["weights", "add", "remove", "weights"]
    assert changed["log"][-1]["weights"] == {"a": 0.5, "c": 0.2}
    plane = InlineDataPlane(plan)
    for entry in changed["log"]:
        if entry["kind"] == "weights":
            plane.coord.set_weights(entry["weights"], at_step=entry["step"])
        elif entry["kind"] == "add":
            spec = SourceSpec(
                name="d", format="jsonl", paths=(str(corpus / "d.jsonl"),), weight=0.5
            )
            plane.add_source(spec, at_step=entry["step"])
        elif entry["kind"] == "remove":
            plane.coord.remove_source(entry["source"], at_step=entry["step"])
    ref = []
    for _, bs in plane.stream(len(got)):
        ref.append(
            {
                g: [
                    tuple(mb["input_ids"].tolist()) + tuple(mb["doc_id"].tolist())
                    for mb in b.micro_batches
                ]
                for g, b in bs.items()
            }
        )
    assert got == ref


def test_feeders_stop_when_every_source_is_exhausted(corpus):
    from omniload_dask import Job

    plan = make(
        corpus,
        name="finite",
        sources=sources(corpus, a={"epochs": 1}, b={"epochs": 1}, c={"epochs": 1}),
    )
    with Job.start(plan, workers=2, dashboard_address=None) as job:
        pieces: list[tuple[int, int]] = []
        steps = [job.feeder(dp_rank=g, output="numpy").steps() for g in range(2)]
        running = [True, True]
        while any(running):  # ranks advance together, as trainer ranks do
            for g in range(2):
                step = next(steps[g], None) if running[g] else None
                if step is None:
                    running[g] = False
                    continue
                for mb in step:
                    pieces += [
                        (int(d), int(o))
                        for d, o in zip(mb["doc_id"], mb["doc_offset"], strict=True)
                    ]
        stats = job.stats()
    assert stats["end_step"] is not None
    assert len(pieces) == len(set(pieces))  # nothing twice
    assert len({d for d, _ in pieces}) == 600  # every record of a, b and c

"""The stream contract: nothing dropped, the mix held at every budget, exactly once, no empty
micro-batches, and live plan changes that replay and resume."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from omniload_dask import JobError
from omniload_dask.checkpoint import Checkpoint
from omniload_dask.cli import main
from omniload_dask.plan import Plan, SourceSpec, parse_plan
from omniload_dask.testing import InlineDataPlane, check_resume_equivalence

from .datagen import (
    plan_dict,
    read_records,
    shaped_sources,
    texts,
    write_jsonl,
    write_shaped_corpus,
)

BOS, EOS = 256, 257


@pytest.fixture(scope="module")
def shaped(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Short texts, code and long documents at 1/32 of a real corpus' lengths."""
    return write_shaped_corpus(tmp_path_factory.mktemp("shaped"))


@pytest.fixture(scope="module")
def small_shaped(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same shapes, fewer documents: a whole epoch is a few dozen steps."""
    return write_shaped_corpus(tmp_path_factory.mktemp("small"), counts=(150, 60, 16))


def shaped_plan(root: Path, dp: int = 2, **batch: object) -> Plan:
    """One 256-token micro-batch per rank (an 8,192-token one at the corpus' real scale)."""
    extra = {k: v for k, v in batch.items() if k in ("mixing", "checkpoint", "sources")}
    batch = {k: v for k, v in batch.items() if k not in extra}
    sources = extra.pop("sources", None) or shaped_sources(root)
    return parse_plan(
        plan_dict(
            sources,
            batch={"seq_len": 256, "micro_batches": 1, "global_tokens": None, **batch},
            layout={"dp": dp},
            **extra,
        )
    )


def record_tokens(plan: Plan) -> dict[int, np.ndarray]:
    """Every record's tokens, by sample id, as the read tasks produce them."""
    return {sid: tokens for _, sid, tokens in read_records(plan)}


def delivered(plane: InlineDataPlane, steps: int) -> list[tuple[int, int, int, np.ndarray]]:
    """(step, doc_id, doc_offset, tokens) of every piece of ``steps`` steps, in step order."""
    out = []
    for t, batches in plane.stream(steps):
        for batch in batches.values():
            for raw in batch.micro_batches:
                cu = raw["cu_seqlens"]
                for d, (sid, off) in enumerate(zip(raw["doc_id"], raw["doc_offset"], strict=True)):
                    out.append((t, int(sid), int(off), raw["input_ids"][cu[d] : cu[d + 1]]))
    return out


# -- long documents --------------------------------------------------------------------------
def test_split_drops_nothing_a_document_longer_than_a_batch_continues_in_the_next(
    small_shaped,
):
    plan = shaped_plan(
        small_shaped, sources=shaped_sources(small_shaped, epochs=1), global_tokens=512
    )
    full = record_tokens(plan)
    plane = InlineDataPlane(plan)
    pieces = []
    step = 0
    while plane.coord.view.end_step is None or step < plane.coord.view.end_step:
        pieces += delivered_step(plane, step)
        step += 1
    by_doc: dict[int, list[tuple[int, int, np.ndarray]]] = {}
    for t, sid, off, tok in pieces:
        by_doc.setdefault(sid, []).append((off, t, tok))
    assert set(by_doc) == set(full)  # every record of the epoch, once (epochs: 1)
    spans = 0
    for sid, parts in by_doc.items():
        parts.sort(key=lambda p: p[0])
        steps = [t for _, t, _ in parts]
        assert steps == sorted(steps)  # a document continues forwards, never back
        offsets = [off for off, _, _ in parts]
        assert offsets[0] == 0 and all(
            a + len(x) == b for (a, _, x), (b, _, _) in itertools.pairwise(parts)
        )
        whole = np.concatenate([tok for _, _, tok in parts])
        assert np.array_equal(whole, full[sid])  # nothing dropped, nothing twice
        if len(whole) > plan.batch.global_tokens:
            spans += 1
            assert steps[-1] - steps[0] >= len(whole) // plan.batch.global_tokens
    assert spans > 0  # the corpus has documents longer than a global batch
    stats = plane.coord.view.stats()
    assert all(s["truncated_tokens"] == 0 for s in stats["sources"])
    # a global batch is exactly full, except the last
    tokens = [f.tokens for f in plane.coord.view.history]
    assert all(n == plan.batch.global_tokens for n in tokens[:-1])


def delivered_step(plane: InlineDataPlane, step: int) -> list[tuple[int, int, int, np.ndarray]]:
    """The pieces of one step, as every rank asks for it (nothing once the stream ended)."""
    out = []
    for batch in plane.step(step).values():
        for mb in batch.micro_batches:
            cu = mb["cu_seqlens"]
            for d, (sid, off) in enumerate(zip(mb["doc_id"], mb["doc_offset"], strict=True)):
                out.append((step, int(sid), int(off), mb["input_ids"][cu[d] : cu[d + 1]]))
    return out


def test_max_document_tokens_caps_only_where_the_plan_says_and_may_exceed_the_budget(
    small_shaped,
):
    cap = 700  # more than the 512-token global batch: allowed now, and still continued
    plan = shaped_plan(small_shaped, global_tokens=512, max_document_tokens=cap)
    full = record_tokens(plan)
    plane = InlineDataPlane(plan)
    got: dict[int, int] = {}
    for _, sid, off, tok in delivered(plane, 40):
        assert off + len(tok) <= cap
        got[sid] = max(got.get(sid, 0), off + len(tok))
    finished = [sid for sid in got if got[sid] == min(len(full[sid]), cap)]
    assert any(len(full[sid]) > cap for sid in finished)
    stats = plane.coord.view.stats()
    expected = sum(
        max(0, len(full[sid]) - cap) for sid in finished if got[sid] == cap
    )  # the cap drops the rest, and counts it (only once a document is finished)
    assert sum(s["truncated_tokens"] for s in stats["sources"]) >= expected > 0


# -- the mix at small budgets ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("by", "long_documents", "dp"),
    [
        ("documents", "split", 2),
        ("documents", "split", 4),
        ("documents", "split", 8),
        ("tokens", "split", 4),
        ("documents", "truncate", 4),
        ("tokens", "truncate", 2),
    ],
)
def test_the_mix_holds_within_half_a_point_over_1000_steps_at_every_budget(
    shaped, by, long_documents, dp
):
    # 0.6 / 0.3 / 0.1 of short texts, code and long documents, one 8,192-token micro-batch per
    # rank (at the corpus' real scale): the budgets where a source's next document often did
    # not fit and the deficit was never paid back (0.668 / 0.249 / 0.083 at 2 ranks).
    plan = shaped_plan(shaped, dp=dp, mixing={"by": by}, long_documents=long_documents)
    plane = InlineDataPlane(plan, build=False)
    plane.draw(1000)
    mix = plane.coord.view.mixture(window=1000)
    realised = np.asarray([m["realised_total"] for m in mix])
    assert np.abs(realised - [0.6, 0.3, 0.1]).max() < 0.005, realised
    if long_documents == "split":
        assert all(s["truncated_tokens"] == 0 for s in plane.coord.view.stats()["sources"])


def test_validate_states_the_mix_bound_of_the_plan(shaped, tmp_path, capsys):
    import yaml

    for long_documents, says in (
        ("split", "continues in the next global batch, so at fixed weights every share is "
         "within 0.30 points"),
        ("truncate", "paid back within 4 global batches, so at fixed weights every share is "
         "within 0.54 points"),
    ):  # fmt: skip
        plan = shaped_plan(shaped, long_documents=long_documents)
        path = tmp_path / f"{long_documents}.yaml"
        path.write_text(yaml.safe_dump(plan.to_dict()))
        assert main(["validate", str(path)]) == 0
        err = capsys.readouterr().err
        assert "mix:" in err and says in err, err


# -- exactly once across resume, inside a document ---------------------------------------------
def test_resume_inside_a_document_continues_it_exactly(small_shaped, tmp_path):
    plan = shaped_plan(small_shaped, global_tokens=512, checkpoint={"url": str(tmp_path / "ckpt")})
    steps = 24
    assert check_resume_equivalence(plan, steps, list(range(steps))) == sum(range(1, steps + 1))
    saved = Checkpoint(str(tmp_path / "ckpt"))
    inside = [
        t for t in range(steps) if any(s["state"][8] > 0 for s in saved.state_at(t)["sources"])
    ]
    assert inside  # some restore points fall inside a document (its offset is saved)


# -- no empty micro-batches ---------------------------------------------------------------------
def test_no_micro_batch_is_handed_out_empty_with_buckets_and_context_parallelism(shaped):
    plan = parse_plan(
        plan_dict(
            shaped_sources(shaped),
            batch={
                "seq_len": None,
                "micro_batches": None,
                "global_tokens": 4096,
                "buckets": [
                    {"seq_len": 64, "share": 0.5},
                    {"seq_len": 512, "share": 0.3},
                    {"seq_len": 512, "share": 0.2, "sources": ["long"]},
                ],
            },
            layout={"dp": 2, "tp": 2, "cp": 2},
        )
    )
    plane = InlineDataPlane(plan)  # (before: 296 of its 11,032 micro-batches were empty)
    for t in range(60):
        fetched = plane.fetch(t)
        assert len(fetched) == 8  # dp 2 x tp 2 x cp 2: each rank its cp slice
        for rank, key in fetched.items():
            micro = plane.batches[key].micro_batches  # what the rank's feeder hands out
            assert [mb["micro_step"] for mb in micro] == list(range(micro[0]["num_micro_steps"]))
            for mb in micro:
                assert mb["num_tokens"] > 0, (t, rank, mb["micro_step"])


# -- live plan changes --------------------------------------------------------------------------
@pytest.fixture
def three(tmp_path: Path) -> Path:
    write_jsonl(tmp_path / "a.jsonl", texts(300, seed=1, mean_words=20, prefix="a"))
    write_jsonl(tmp_path / "b.jsonl", texts(200, seed=2, mean_words=60, prefix="b"))
    write_jsonl(tmp_path / "c.jsonl", texts(200, seed=3, mean_words=40, prefix="c"))
    write_jsonl(tmp_path / "d.jsonl", texts(100, seed=4, mean_words=40, prefix="d"))
    return tmp_path


def version(root: Path, weights: dict[str, float], **extra: object) -> Plan:
    srcs = [
        {"name": n, "format": "jsonl", "path": str(root / f"{n}.jsonl"), "weight": w}
        for n, w in weights.items()
    ]
    base = {
        "batch": {"seq_len": 512, "micro_batches": 2, "global_tokens": 2048},
        "layout": {"dp": 2},
        "mixing": {"by": "tokens"},
        **extra,
    }
    return parse_plan(plan_dict(srcs, **base))


def shares(plane: InlineDataPlane, start: int, stop: int) -> np.ndarray:
    figs = [f for f in plane.coord.view.history if start <= f.step < stop]
    got = np.zeros(len(plane.coord.view.streams))
    for f in figs:
        got[: len(f.source_tokens)] += f.source_tokens
    return got / got.sum()


def test_two_plan_versions_queued_back_to_back_each_compare_with_the_plan_due_at_its_step(
    three,
):
    v1 = version(three, {"a": 0.4, "b": 0.3, "c": 0.3})
    v2 = version(three, {"a": 0.5, "b": 0.5})  # c leaves, a and b re-weighted
    v3 = version(three, {"a": 0.4, "b": 0.3, "c": 0.3})  # back to v1
    plane = InlineDataPlane(v1, build=False)
    plane.draw(5)
    assert plane.update_plan(v2, at_step=20) == 20
    assert plane.update_plan(v3, at_step=40) == 40  # queued before step 20 is drawn
    plane.draw(55)
    assert np.abs(shares(plane, 0, 20) - [0.4, 0.3, 0.3]).max() < 0.03
    assert np.abs(shares(plane, 20, 40) - [0.5, 0.5, 0.0]).max() < 0.03
    assert np.abs(shares(plane, 40, 60) - [0.4, 0.3, 0.3]).max() < 0.03
    kinds = [(e["step"], e["kind"]) for e in plane.coord.view.log]
    assert kinds == [(20, "remove"), (20, "weights"), (40, "add"), (40, "weights")]


def test_source_changes_are_checked_against_the_job_as_it_will_be(three):
    plane = InlineDataPlane(version(three, {"a": 0.4, "b": 0.3, "c": 0.3}), build=False)
    plane.coord.remove_source("c", at_step=10)
    with pytest.raises(JobError, match="no source 'c' in the job"):
        plane.coord.remove_source("c", at_step=12)
    d = SourceSpec(name="d", format="jsonl", paths=(str(three / "d.jsonl"),), weight=0.2)
    plane.add_source(d, at_step=15)
    with pytest.raises(JobError, match="'d' is already in the job"):
        plane.add_source(d, at_step=16)
    assert plane.coord.set_weights({"d": 0.5}, at_step=16).step == 16  # d takes part by then
    with pytest.raises(JobError, match="queued for step 15; queue changes in step order"):
        plane.coord.remove_source("a", at_step=12)


def test_a_checkpoint_after_a_source_joined_live_resumes_and_inspects(three, tmp_path):
    def plans(url: Path) -> tuple[Plan, Plan]:
        ckpt = {"checkpoint": {"url": str(url)}}
        old = version(three, {"a": 0.5, "b": 0.3}, **ckpt)
        return old, version(three, {"a": 0.5, "b": 0.3, "d": 0.4}, **ckpt)

    d = SourceSpec(name="d", format="jsonl", paths=(str(three / "d.jsonl"),), weight=0.4)

    def join(plane: InlineDataPlane) -> None:
        plane.add_source(d, at_step=10)

    after = [10, 11, 17, 24]  # restore points after d joined (the base is at step 0)
    # with the plan the job had, and with the plan version the change led to
    old, new = plans(tmp_path / "first")
    assert check_resume_equivalence(old, 30, after, changes=join) == sum(30 - s for s in after)
    assert main(["checkpoint", "inspect", str(tmp_path / "first")]) == 0
    old, new = plans(tmp_path / "ckpt")
    assert check_resume_equivalence(old, 30, after, changes=join, resume_plan=new) == sum(
        30 - s for s in after
    )
    # before it joined, the new plan rules from the resumed step: d joins there, and every
    # sample still comes once
    again = InlineDataPlane(new, resume=4)
    again.draw(20)
    assert again.coord.view.streams[2].docs > 0 and again.coord.view.error is None
    summary = Checkpoint(str(tmp_path / "ckpt")).summary()
    assert [s["name"] for s in summary["sources"]] == ["a", "b", "d"]
    json.dumps(summary)

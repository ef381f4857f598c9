from __future__ import annotations

from pathlib import Path

import pytest

from omniload_dask import PlanError, load_plan, parse_plan

from .datagen import plan_dict

SRC = {"name": "web", "format": "jsonl", "path": "/data/*.jsonl"}
REPO = Path(__file__).resolve().parents[1]


def test_every_plan_in_plans_folder_loads():
    plans = sorted((REPO / "plans").glob("*.yaml"))
    assert plans
    for path in plans:
        plan = load_plan(path)
        assert plan.sources


def test_resolved_plan_round_trips_through_to_dict():
    plan = parse_plan(plan_dict([SRC, {**SRC, "name": "b", "format": "parquet", "weight": 2}]))
    again = parse_plan(plan.to_dict())
    assert again == plan
    assert again.stream_fingerprint() == plan.stream_fingerprint()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"sources": [SRC, {**SRC, "name": "b", "weight": -1}]},
            "sources[1].weight: must be >= 0, got -1",
        ),
        ({"sources": [{**SRC, "weight": float("nan")}]}, "sources[0].weight: must be a finite"),
        ({"sources": [{**SRC, "weight": 0}]}, "sources: at least one source needs a weight > 0"),
        ({"sources": [{**SRC, "format": "csv"}]}, "sources[0].format: must be one of"),
        ({"sources": [{**SRC, "wieght": 1}]}, "did you mean 'weight'"),
        ({"sources": [SRC, SRC]}, "sources[1].name: duplicates sources[0].name"),
        ({"sources": []}, "sources: must be a non-empty list"),
        ({"sources": [{**SRC, "path": 3}]}, "sources[0].path: must be a path"),
        (
            {"sources": [{**SRC, "format": "parquet", "unit_bytes": "1MiB"}]},
            "sources[0].unit_bytes: only applies to format: jsonl",
        ),
        ({"sources": [{**SRC, "unit_bytes": "lots"}]}, "sources[0].unit_bytes: must be a byte"),
        ({"batch": {"seq_len": 4}}, "batch.seq_len: must be >= 8, got 4"),
        (
            {"batch": {"global_documents": 8}},
            "batch.global_documents: give global_tokens or global_documents, not both",
        ),
        ({"layout": {"dp": 0}}, "layout.dp: must be >= 1, got 0"),
        ({"layout": {"order": "tp-dp-pp"}}, "layout.order: must name dp, tp, pp and cp"),
        ({"tokenizer": {"kind": "huggingface"}}, "tokenizer.path: is required"),
        (
            {"tokenizer": {"kind": "huggingface", "path": "t.json", "add_bos": True}},
            "tokenizer.bos: is required when add_bos is true",
        ),
        ({"tokenizer": {"kind": "byte", "bos": "<s>"}}, "tokenizer.bos: the byte tokenizer"),
        ({"on_error": "ignore"}, "on_error: must be one of 'raise', 'skip'"),
        ({"version": 2}, "version: this omniload-dask reads plan version 1"),
        ({"seed": -1}, "seed: must be >= 0"),
        ({"surprise": 1}, "surprise: unknown field"),
        ({"cost": {"linear": 0, "quadratic": 0}}, "cost.linear: linear and quadratic cannot"),
        ({"loader": {"prefetch": 0}}, "loader.prefetch: must be >= 1"),
        ({"name": "bad name!"}, "name: must match"),
    ],
)
def test_bad_fields_are_named_with_path_and_value(change, message):
    data = plan_dict([SRC])
    for key, value in change.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    with pytest.raises(PlanError) as info:
        parse_plan(data)
    assert message in str(info.value)


def test_relative_paths_resolve_against_the_plan_folder_and_env_vars_expand(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNI_TEST_ROOT", "/mnt/x")
    (tmp_path / "p.yaml").write_text(
        "sources:\n"
        "  - {name: a, format: jsonl, path: data/*.jsonl}\n"
        "  - {name: b, format: jsonl, path: '${OMNI_TEST_ROOT}/b.jsonl'}\n"
        "  - {name: c, format: jsonl, path: '${OMNI_UNSET_VAR:-s3://bucket}/c.jsonl'}\n"
        "  - {name: d, format: parquet, path: 'memory://x/d.parquet'}\n"
        "batch: {seq_len: 64}\n"
    )
    plan = load_plan(tmp_path / "p.yaml")
    assert plan.sources[0].paths == (str(tmp_path / "data" / "*.jsonl"),)
    assert plan.sources[1].paths == ("/mnt/x/b.jsonl",)
    assert plan.sources[2].paths == ("s3://bucket/c.jsonl",)
    assert plan.sources[3].paths == ("memory://x/d.parquet",)


def test_unset_env_var_without_default_is_an_error(tmp_path):
    data = plan_dict([{**SRC, "path": "${OMNI_SURELY_UNSET}/x.jsonl"}])
    with pytest.raises(PlanError, match=r"sources\[0\].path: environment variable"):
        parse_plan(data)


def test_plan_file_errors_name_the_file(tmp_path):
    with pytest.raises(PlanError, match="cannot read it"):
        load_plan(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("sources: [unclosed\n")
    with pytest.raises(PlanError, match="not valid YAML"):
        load_plan(tmp_path / "bad.yaml")


def test_default_budget_is_dp_times_micro_batches_times_seq_len():
    plan = parse_plan(
        plan_dict(
            [SRC],
            batch={"seq_len": 100, "micro_batches": 3, "global_tokens": None},
            layout={"dp": 4},
        )
    )
    assert plan.batch.global_tokens == 1200


def test_layout_rank_mapping_is_a_bijection_with_tp_fastest():
    plan = parse_plan(plan_dict([SRC], layout={"dp": 2, "tp": 2, "pp": 2, "cp": 2}))
    lay = plan.layout
    seen = set()
    for r in range(lay.world_size):
        c = lay.coords(r)
        assert lay.rank(c["dp"], c["tp"], c["pp"], c["cp"]) == r
        seen.add(tuple(sorted(c.items())))
    assert len(seen) == 16
    assert lay.coords(1)["tp"] == 1 and lay.coords(1)["dp"] == 0
    assert lay.group_ranks(1) == sorted(r for r in range(16) if lay.coords(r)["dp"] == 1)
    with pytest.raises(PlanError, match="rank: must be in"):
        lay.coords(16)

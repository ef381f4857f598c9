from __future__ import annotations

from pathlib import Path

import pytest

from omniload_dask import PlanError, load_plan, parse_plan

from .datagen import plan_dict

SRC = {"name": "web", "format": "jsonl", "path": "/data/*.jsonl"}
BUCKETS = [{"seq_len": 256, "share": 0.75}, {"seq_len": 2048, "share": 0.25}]
NO_SEQ = {"seq_len": None, "micro_batches": None}  # plan_dict's defaults, cleared for buckets
REPO = Path(__file__).resolve().parents[1]


def test_every_plan_in_plans_folder_loads():
    plans = sorted((REPO / "plans").glob("*.yaml"))
    assert plans
    for path in plans:
        plan = load_plan(path)
        assert plan.sources


def test_image_plan_round_trips_and_fills_defaults():
    plan = parse_plan(
        plan_dict(
            [
                {**SRC, "format": "parquet", "image": "jpeg", "unit_records": 32},
                {**SRC, "name": "tars", "format": "webdataset", "image": ["JPG", ".png"]},
            ],
            cost={"encoder": {"model": {"hidden": 64, "layers": 2, "heads": 4}}},
        )
    )
    assert plan.images is not None and plan.images.placeholder == 258
    assert plan.sources[0].image == ("jpeg",) and plan.sources[0].unit_records == 32
    assert plan.sources[1].image == ("jpg", "png") and plan.sources[1].text == "txt"
    assert plan.sources[1].unit_records == 64
    assert plan.cost.encoder_model == {"hidden": 64, "layers": 2, "heads": 4, "causal": False}
    assert plan.cost.encoder_quadratic == 12 * 2 * 64  # bidirectional attention
    again = parse_plan(plan.to_dict())
    assert again == plan and again.stream_fingerprint() == plan.stream_fingerprint()
    text_only = parse_plan(plan_dict([SRC]))
    assert text_only.images is None and "images" not in text_only.to_dict()


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
        ({"sources": [{**SRC, "unit_bytes": "lots"}]}, "sources[0].unit_bytes: must be a byte"),
        (  # every format reads it now (the cap on merging small files): checked for each
            {"sources": [{**SRC, "format": "parquet", "unit_bytes": "lots"}]},
            "sources[0].unit_bytes: must be a byte",
        ),
        ({"sources": [{**SRC, "merge_bytes": -1}]}, "sources[0].merge_bytes: must not be negative"),
        ({"sources": [{**SRC, "merge_bytes": "1 lot"}]}, "sources[0].merge_bytes: must be a byte"),
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
        (
            {"batch": {"seq_len": 64, "buckets": [{"seq_len": 64, "micro_batches": 1}]}},
            "batch.seq_len: give it in each of batch.buckets instead",
        ),
        (
            {"batch": {**NO_SEQ, "global_tokens": 1000, "buckets": BUCKETS[:1]}},
            "batch.buckets: shares must add up to 1, got [0.75]",
        ),
        (
            {"batch": {**NO_SEQ, "buckets": [BUCKETS[0], {"seq_len": 512, "micro_batches": 1}]}},
            "batch.buckets[1].micro_batches: give share in every bucket or micro_batches in every",
        ),
        (
            {
                "batch": {
                    **NO_SEQ,
                    "global_tokens": None,
                    "buckets": [{"seq_len": 64, "share": 1.0}],
                }
            },
            "batch.buckets[0].share: needs batch.global_tokens",
        ),
        (
            {"batch": {**NO_SEQ, "buckets": [{"seq_len": 64, "micro_batches": 1, "share": 1.0}]}},
            "batch.buckets[0].micro_batches: give share or micro_batches, not both",
        ),
        (
            {"batch": {**NO_SEQ, "buckets": [{"seq_len": 64, "micro_batches": 1}] * 2}},
            "batch.buckets[0].seq_len: two buckets without sources have this seq_len",
        ),
        (
            {
                "batch": {
                    **NO_SEQ,
                    "buckets": [{"seq_len": 64, "micro_batches": 1, "sources": ["wbe"]}],
                }
            },
            "batch.buckets[0].sources[0]: no source named 'wbe' (have web)",
        ),
        (
            {
                "batch": {
                    **NO_SEQ,
                    "buckets": [{"seq_len": 64, "micro_batches": 1, "sources": "web"}],
                }
            },
            "batch.buckets[0].sources: must be a list of source names",
        ),
        ({"layout": {"dp": 2, "rank_map": [[0, 0, 0, 0]]}}, "layout.rank_map: must list [dp"),
        (
            {"layout": {"dp": 2, "rank_map": [[0, 0, 0, 0], [0, 0, 0, 0]]}},
            "layout.rank_map[1]: duplicates rank_map[0]",
        ),
        (
            {"layout": {"dp": 2, "rank_map": [[0, 0, 0, 0], [2, 0, 0, 0]]}},
            "layout.rank_map[1]: dp must be in [0, 2), got [2, 0, 0, 0]",
        ),
        (
            {"layout": {"dp": 2, "rank_map": [[0, 0, 0, 0], [1, 0]]}},
            "layout.rank_map[1]: must be [dp, tp, pp, cp], four integers",
        ),
        (
            {"layout": {"dp": 2, "order": "dp-tp-pp-cp", "rank_map": [[0, 0, 0, 0], [1, 0, 0, 0]]}},
            "layout.order: give order or rank_map, not both",
        ),
        ({"sources": [{**SRC, "image": "img"}]}, "sources[0].image: images come from parquet"),
        (
            {"sources": [{**SRC, "format": "parquet", "image": "text"}]},
            "sources[0].image: must be another column than sources[].text, got 'text'",
        ),
        (
            {"sources": [{**SRC, "format": "webdataset", "image": "jpg;p g"}]},
            "sources[0].image: must be file extensions",
        ),
        ({"sources": [{**SRC, "unit_records": 8}]}, "sources[0].unit_records: only applies to"),
        ({"images": {"patch_size": 0}}, "images.patch_size: must be >= 1, got 0"),
        (
            {"images": {"merge": 2, "patch_size": 14, "min_pixels": 100}},
            "images.min_pixels: must be >= 784",
        ),
        (
            {"images": {"max_pixels": 1000, "min_pixels": 3136}},
            "images.max_pixels: must be >= 3136",
        ),
        (
            {"images": {"placeholder": 300}},
            "images.placeholder: the byte tokenizer's image token is 258",
        ),
        (
            {
                "tokenizer": {"kind": "huggingface", "path": "t.json", "bos": "<s>", "eos": "</s>"},
                "sources": [{**SRC, "format": "webdataset"}],
            },
            "images.placeholder: is required with a huggingface tokenizer",
        ),
        ({"cost": {"encoder": {"linear": -1}}}, "cost.encoder.linear: must be >= 0, got -1"),
        (
            {"cost": {"encoder": {"linear": 1, "model": {"hidden": 8, "layers": 1}}}},
            "cost.encoder.linear: give linear/quadratic or model, not both",
        ),
        ({"loader": {"task_seconds": 0.001}}, "loader.task_seconds: must be 0 (never split)"),
        ({"loader": {"quotas": "yes"}}, "loader.quotas: must be true or false"),
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


def test_bucket_shares_size_each_buckets_micro_batches_and_round_trip():
    books = {**SRC, "name": "books"}
    plan = parse_plan(
        plan_dict(
            [SRC, books],
            batch={
                **NO_SEQ,
                "global_tokens": 40960,
                "buckets": [
                    {"seq_len": 256, "share": 0.6875},
                    {"seq_len": 2048, "share": 0.25},
                    {"seq_len": 2048, "share": 0.0625, "sources": ["books"]},
                ],
            },
            layout={"dp": 4},
        )
    )
    buckets = plan.batch.context_buckets
    assert [(b.seq_len, b.micro_batches) for b in buckets] == [(256, 28), (2048, 2), (2048, 1)]
    assert (plan.batch.seq_len, plan.batch.micro_batches) == (2048, 31)
    assert plan.batch.document_cap_for("books") == plan.batch.document_cap
    assert parse_plan(plan.to_dict()) == plan


def test_every_source_needs_a_bucket_when_all_buckets_pin_sources():
    data = plan_dict(
        [SRC, {**SRC, "name": "books"}],
        batch={**NO_SEQ, "buckets": [{"seq_len": 64, "micro_batches": 1, "sources": ["books"]}]},
    )
    with pytest.raises(PlanError, match=r"batch.buckets: every bucket lists its sources.*'web'"):
        parse_plan(data)


def test_truncation_caps_each_source_at_its_buckets_seq_len():
    plan = parse_plan(
        plan_dict(
            [SRC, {**SRC, "name": "books"}],
            batch={
                **NO_SEQ,
                "global_tokens": 4096,
                "long_documents": "truncate",
                "buckets": [
                    {"seq_len": 64, "micro_batches": 2},
                    {"seq_len": 512, "micro_batches": 1, "sources": ["books"]},
                ],
            },
        )
    )
    assert plan.batch.document_cap_for("web") == 64
    assert plan.batch.document_cap_for("books") == 512


def test_an_explicit_rank_map_drives_coords_and_groups():
    rank_map = [[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0, 0], [0, 1, 0, 0]]
    plan = parse_plan(plan_dict([SRC], layout={"dp": 2, "tp": 2, "rank_map": rank_map}))
    lay = plan.layout
    assert lay.coords(0) == {"dp": 1, "tp": 0, "pp": 0, "cp": 0}
    assert lay.rank(0, 1) == 3 and lay.group_ranks(1) == [0, 2]
    assert parse_plan(plan.to_dict()) == plan

"""Mutated plans: every outcome is a valid plan (within every field's range, round-tripping) or a
PlanError that starts with the field path, never another exception."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omniload_dask import PlanError, load_plan, parse_plan
from omniload_dask.plan import limits

from .datagen import IMAGES, plan_dict

REPO = Path(__file__).resolve().parents[1]
PLANS = REPO / "plans"
# A field path: top-level key, then .key or [index] parts; "plan" for the whole document.
FIELD = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\[\d+\])*(\.[A-Za-z_][A-Za-z0-9_]*(\[\d+\])*)*: ")


def _bases() -> list[dict[str, Any]]:
    out = [yaml.safe_load(p.read_text()) for p in sorted(PLANS.glob("*.yaml"))]
    out.append(
        plan_dict(
            [
                {"name": "a", "format": "jsonl", "path": "/d/a/*.jsonl", "unit_bytes": "64KiB"},
                {"name": "b", "format": "parquet", "path": ["/d/b.parquet"], "image": "img"},
                {"name": "c", "format": "webdataset", "path": "s3://bucket/c/*.tar", "epochs": 2},
            ],
            images=IMAGES,
            checkpoint={"url": "memory://ckpt", "compact_every": 10},
            mixing={"schedule": [{"at": 0, "weights": {"a": 1}}, {"at": 9, "weights": {"b": 2}}]},
            loader={"task_seconds": 0.2, "retain_steps": 8},
            layout={"dp": 2, "rank_map": [[0, 0, 0, 0], [1, 0, 0, 0]]},
        )
    )
    return out


BASES = _bases()

VALUES = st.one_of(
    st.sampled_from(
        [
            0,
            -1,
            1,
            7,
            2**31,
            2**63,
            2**64,
            10**18,
            10**400,
            float("nan"),
            float("inf"),
            -0.0,
            1e308,
            0.5,
            True,
            None,
            "",
            "::::",
            "\x00bad",
            "nosuchproto://x/y",
            "s3://",
            "http://[::1",
            "${NO_SUCH_VARIABLE_HERE}",
            "1e400GiB",
            "9" * 400,
            "4MiB",
            "web",
            [],
            {},
            [1, 2],
            {"x": 1},
        ]
    ),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
)
KEYS = st.sampled_from(["seq_len", "weight", "path", "paths", "x", "bucket", "sources", "at"])


def _locations(node: Any, where: tuple = ()) -> list[tuple]:
    """Every path to a value inside ``node`` (dict keys and list indices)."""
    out = [where]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _locations(v, (*where, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _locations(v, (*where, i))
    return out


def _mutate(plan: Any, where: tuple, action: str, value: Any, key: str) -> Any:
    """``plan`` (a copy) with the value at ``where`` replaced, deleted, or given a new key."""
    if not where:
        return value if action == "replace" else plan
    parent = plan
    for k in where[:-1]:
        parent = parent[k]
    last = where[-1]
    if action == "delete":
        del parent[last]
    elif action == "add" and isinstance(parent[last], dict):
        parent[last][key] = value
    else:
        parent[last] = value
    return plan


def _check(data: Any) -> None:
    try:
        plan = parse_plan(data, base_dir=PLANS)
    except PlanError as exc:
        assert FIELD.match(str(exc)), f"PlanError without a field path: {exc}"
        return
    batch = plan.batch
    assert 8 <= batch.seq_len <= limits.MAX_SEQ_LEN
    assert plan.layout.dp * batch.micro_batches <= limits.MAX_STEP_MICRO_BATCHES
    if batch.global_tokens is not None:
        assert batch.global_tokens <= limits.MAX_STEP_TOKENS
    assert all(0 <= s.weight <= limits.MAX_WEIGHT for s in plan.sources)
    again = parse_plan(plan.to_dict())
    assert again == plan and again.stream_fingerprint() == plan.stream_fingerprint()


@settings(
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    base=st.sampled_from(range(len(BASES))),
    data=st.data(),
    mutations=st.integers(1, 3),
)
def test_a_mutated_plan_is_valid_or_a_plan_error_naming_the_field(base, data, mutations):
    plan = yaml.safe_load(yaml.safe_dump(BASES[base]))  # a deep copy
    for _ in range(mutations):
        where = data.draw(st.sampled_from(_locations(plan)))
        action = data.draw(st.sampled_from(["replace", "replace", "delete", "add"]))
        value = copy.deepcopy(data.draw(VALUES))  # later mutations may edit it in place
        plan = _mutate(plan, where, action, value, data.draw(KEYS))
    _check(plan)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"batch": {"seq_len": 2**64}}, "batch.seq_len: must be <= "),
        ({"batch": {"seq_len": 10**18}}, "batch.seq_len: must be <= "),
        ({"batch": {"micro_batches": 10**18}}, "batch.micro_batches: must be <= "),
        ({"batch": {"seq_len": 2**24, "micro_batches": 2**16}}, "batch.micro_batches: dp (2) x"),
        ({"layout": {"dp": 65536, "tp": 65536}}, "layout: dp * tp * pp * cp must be <= "),
        ({"seed": 2**64}, "seed: must be <= "),
        ({"tokenizer": {"kind": "huggingface", "path": "", "eos": "x"}}, "tokenizer.path: must "),
        ({"checkpoint": {"url": "s3://"}}, "checkpoint.url: names no bucket or host"),
    ],
)
def test_huge_or_malformed_values_name_the_field(change, field):
    sources = [{"name": "a", "format": "jsonl", "path": "/d/*.jsonl"}]
    with pytest.raises(PlanError) as err:
        parse_plan(plan_dict(sources, **change))
    assert str(err.value).startswith(field), str(err.value)


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("", "must be a non-empty path or URL"),
        ("::::", "is not a path or URL (an empty part between '::')"),
        ("\x00bad", "must not contain control characters"),
        ("nosuchproto://bucket/x.jsonl", "unknown protocol 'nosuchproto'"),
        ("s3://", "names no bucket or host after 's3://'"),
        ("http://[::1", "is not a valid URL"),
    ],
)
def test_malformed_paths_are_plan_errors_naming_the_field(path, message):
    data = plan_dict([{"name": "a", "format": "jsonl", "path": path}])
    with pytest.raises(PlanError, match=re.escape(f"sources[0].path: {message}")):
        parse_plan(data)
    data = plan_dict([{"name": "a", "format": "jsonl", "path": ["/ok/a.jsonl", path]}])
    with pytest.raises(PlanError, match=re.escape("sources[0].path: ")):
        parse_plan(data)


def test_a_plan_file_that_is_not_utf8_is_a_plan_error_naming_the_file(tmp_path):
    text = (PLANS / "quickstart.yaml").read_bytes()
    (tmp_path / "latin1.yaml").write_bytes(b"# caf\xe9\n" + text)  # a Latin-1 byte
    with pytest.raises(PlanError, match=r"plan file '.*latin1\.yaml': not UTF-8 text \(byte 0xe9"):
        load_plan(tmp_path / "latin1.yaml")
    (tmp_path / "binary.yaml").write_bytes(b"\xff\xfe\x00\x01" * 10)
    with pytest.raises(PlanError, match="not UTF-8 text"):
        load_plan(tmp_path / "binary.yaml")

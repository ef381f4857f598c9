"""Every section of a plan names an unknown field, and a misspelt one with the field it meant,
also where the misspelling leaves a required field (or a whole section) absent."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from omniload_dask import PlanError, parse_plan

SRC = {"name": "web", "format": "jsonl", "path": "/data/*.jsonl", "weight": 1}
TOKENIZER = {"kind": "huggingface", "path": "/data/tokenizer.json", "bos": "<s>", "eos": "</s>"}
BASE: dict[str, Any] = {
    "version": 1,
    "name": "t",
    "seed": 3,
    "on_error": "raise",
    "tokenizer": TOKENIZER,
    "batch": {"seq_len": 256, "micro_batches": 2, "global_tokens": 1024},
    "layout": {"dp": 2},
    "cost": {"linear": 1.0, "quadratic": 0.001, "encoder": {"linear": 1.0}},
    "loader": {"workers": 2},
    "checkpoint": {"url": "/ckpt", "flush_seconds": 5},
    "mixing": {"by": "tokens", "schedule": [{"at": 10, "weights": {"web": 1}}]},
    "images": {"patch_size": 8, "placeholder": "<img>"},
    "sources": [SRC],
}
BUCKETS = {"global_tokens": 4096, "buckets": [{"seq_len": 256, "share": 1.0}]}
MODEL = {"model": {"hidden": 64, "layers": 2, "heads": 4}}

# (where the section lives, a change that puts it in the plan (None: BASE has it), a field of
# it as it is spelt right, and a misspelling of that field)
SECTIONS = [
    ((), None, "seed", "sed"),
    (("tokenizer",), None, "kind", "knid"),
    (("tokenizer",), None, "bos", "boss"),
    (("batch",), None, "seq_len", "seq_length"),
    (("batch",), None, "global_tokens", "global_token"),
    (("batch", "buckets", 0), {"batch": BUCKETS}, "seq_len", "seqlen"),
    (("layout",), None, "dp", "dp_"),
    (("cost",), None, "quadratic", "quadratc"),
    (("cost", "encoder"), None, "linear", "lineer"),
    (("cost", "model"), {"cost": MODEL}, "hidden", "hiden"),
    (("loader",), None, "workers", "worker"),
    (("checkpoint",), None, "url", "uri"),
    (("mixing",), None, "schedule", "schedul"),
    (("mixing", "schedule", 0), None, "weights", "wieghts"),
    (("images",), None, "placeholder", "placeholdr"),
    (("sources", 0), None, "weight", "wieght"),
    (("sources", 0), None, "path", "pth"),
]


def _plan(change: dict[str, Any] | None) -> dict[str, Any]:
    data = copy.deepcopy(BASE)
    for key, value in (change or {}).items():
        data[key] = copy.deepcopy(value)
    return data


def _section(data: dict[str, Any], where: tuple[Any, ...]) -> dict[str, Any]:
    node: Any = data
    for part in where:
        node = node[part]
    return node


def _path(where: tuple[Any, ...], key: str) -> str:
    out = ""
    for part in where:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else part
    return f"{out}.{key}" if out else key


def test_the_base_plan_of_these_tests_is_valid():
    for _, change, _, _ in SECTIONS:
        parse_plan(_plan(change))


@pytest.mark.parametrize(("where", "change", "field", "typo"), SECTIONS)
def test_an_unknown_field_is_named_in_every_section(where, change, field, typo):
    data = _plan(change)
    _section(data, where)["zz_unknown"] = 1
    with pytest.raises(PlanError) as err:
        parse_plan(data)
    assert str(err.value).startswith(f"{_path(where, 'zz_unknown')}: unknown field (known: ")
    assert "did you mean" not in str(err.value)


@pytest.mark.parametrize(("where", "change", "field", "typo"), SECTIONS)
def test_a_misspelt_field_is_named_with_the_one_it_meant_in_every_section(
    where, change, field, typo
):
    data = _plan(change)
    section = _section(data, where)
    section[typo] = section.pop(field)
    with pytest.raises(PlanError) as err:
        parse_plan(data)
    message = str(err.value)
    assert message.startswith(f"{_path(where, typo)}: unknown field"), message
    assert f"did you mean {field!r}?" in message, message


def test_a_misspelt_section_is_named_where_its_absence_is_found():
    data = _plan(None)
    data["bacth"] = data.pop("batch")
    with pytest.raises(PlanError) as err:
        parse_plan(data)
    message = str(err.value)
    assert message.startswith("bacth: unknown field; did you mean 'batch'?"), message
    assert "(batch.seq_len: is required)" in message


def test_a_missing_required_field_without_a_near_key_says_only_that():
    data = _plan(None)
    del data["batch"]["seq_len"]
    with pytest.raises(PlanError, match=r"^batch\.seq_len: is required$"):
        parse_plan(data)


def _with_loader(**loader: Any) -> dict[str, Any]:
    plan = copy.deepcopy(BASE)
    plan["loader"] = {"workers": 2, **loader}
    return plan


def test_a_renamed_field_is_read_under_its_former_name_with_a_warning(caplog):
    with caplog.at_level("WARNING", logger="omniload_dask.plan.fields"):
        old = parse_plan(_with_loader(reads_per_thread=5))
    assert old.loader.reads_per_slot == 5
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warned == ["loader.reads_per_thread is deprecated: name it loader.reads_per_slot "
                      "(same meaning)"]  # fmt: skip
    caplog.clear()
    with caplog.at_level("WARNING", logger="omniload_dask.plan.fields"):
        new = parse_plan(_with_loader(reads_per_slot=5))
    assert new.loader == old.loader and not caplog.records
    # the old name is checked as the new one is
    with pytest.raises(
        PlanError,
        match=r"^loader\.reads_per_slot \(given as reads_per_thread\): must be >= 1, got 0$",
    ):
        parse_plan(_with_loader(reads_per_thread=0))


def test_a_renamed_field_given_under_both_names_is_an_error():
    with pytest.raises(PlanError) as err:
        parse_plan(_with_loader(reads_per_thread=2, reads_per_slot=3))
    assert str(err.value) == (
        "loader.reads_per_thread: renamed to 'reads_per_slot', and both are given "
        "(reads_per_thread=2, reads_per_slot=3); keep 'reads_per_slot' only"
    )

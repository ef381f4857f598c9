"""Write docs/guides/plan-fields.md: every plan field with its type, range and default.

The table is taken from the plan parser itself, not written by hand: a handful of plans that
between them take every branch of ``parse_plan`` are parsed while each getter of
:class:`omniload_dask.plan.fields.Fields` is watched, and every call (field path, kind,
default, bounds, choices) becomes a row. Only the one-line meanings below are written by hand,
and ``tests/test_docs.py`` checks both ways: each field the parser reads has a meaning here,
each meaning here names a field the parser reads, every field name the parsers ask for by
literal appears in the table, and the committed page equals what this script writes now.

    python scripts/docs_plan_fields.py           # rewrite the page
    python scripts/docs_plan_fields.py --check   # exit 1 if the page is out of date
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import re
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for folder in (ROOT, ROOT / "scripts"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from docs_plan_meanings import MEANINGS, SECTIONS  # noqa: E402

from omniload_dask.plan import fields as fields_module  # noqa: E402
from omniload_dask.plan.parse import parse_plan  # noqa: E402

PAGE = ROOT / "docs" / "guides" / "plan-fields.md"
GETTERS = (
    "integer",
    "optional_int",
    "number",
    "text",
    "flag",
    "size",
    "mapping",
    "plain_mapping",
    "storage_options",
    "sequence",
    "raw",
    "required",
)
KIND = {
    "integer": "integer",
    "optional_int": "integer",
    "number": "number",
    "text": "string",
    "flag": "true / false",
    "size": "byte size (`4MiB`, `512 KB` or an integer)",
    "mapping": "section",
    "plain_mapping": "mapping",
    "storage_options": "mapping of fsspec options",
    "sequence": "list",
}


@dataclass
class Row:
    """What the parser asked of one field, over every plan parsed."""

    kinds: set[str] = field(default_factory=set)
    defaults: set[str] = field(default_factory=set)
    ranges: set[str] = field(default_factory=set)


def normalise(path: str) -> str:
    """``sources[2].weight`` -> ``sources[].weight``; a calibration file's fields get its name."""
    path = re.sub(r" \([^)]*\)", "", path)
    # A stream's sources and batch are read as the plan's own: one row each, not two.
    path = re.sub(r"^streams\.\w+\.(sources|batch)", r"\1", path)
    path = re.sub(r"^streams\.\w+", "streams.<name>", path)
    # A stage is read as a whole batch section: its fields are the batch's (but where it starts).
    path = re.sub(r"^batch\.stages\[\d+\]\.(?!at_)", "batch.", path)
    return re.sub(r"\[\d+\]", "[]", path)


class _Shown(str):
    """Text already formatted for the table."""


def _show(value: Any) -> str:
    if isinstance(value, _Shown):
        return str(value)
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if isinstance(value, float) and (value != int(value) or value >= 1e6):
        return f"`{value:g}`"
    if isinstance(value, (int, float)):
        number = int(value)
        if number >= 2**10 and number & (number - 1) == 0:
            return f"`2**{number.bit_length() - 1}`"
        if number >= 2**10 and (number + 1) & number == 0:
            return f"`2**{number.bit_length()} - 1`"
        return f"`{number:,}`".replace(",", "_") if number >= 10**5 else f"`{number}`"
    if isinstance(value, (dict, list)) and not value:
        return "empty"
    return f"`{value}`"


def _bytes(value: Any) -> str:
    """A byte size as ``4 MiB`` where it is a whole number of KiB, MiB, GiB."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if isinstance(value, int) and value and value % size == 0:
            return f"`{value // size} {unit}`"
    return _show(value)


def _describe(method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, str]:
    """(default, range) of one getter call, as the table shows them."""
    default: Any = args[1] if len(args) > 1 else kwargs.get("default")
    if method in ("integer", "number", "text") and default is None:
        shown = "required"
    elif method == "optional_int":
        shown = "unset"
    elif method in ("sequence", "required"):
        shown = "required"
    elif method in ("mapping", "plain_mapping", "storage_options"):
        shown = "empty"
    elif method == "raw":
        shown = "unset" if default is None else _show(default)
    else:
        shown = _show(default)
    low, high = kwargs.get("min"), kwargs.get("max")
    if method == "size":
        shown = _bytes(default)
        low, high = (
            (_Shown(_bytes(low)) if low is not None else None),
            (_Shown(_bytes(high)) if high is not None else None),
        )
    parts = []
    if kwargs.get("choices"):
        parts.append(", ".join(f"`{c}`" for c in kwargs["choices"]))
    if kwargs.get("pattern"):
        parts.append(f"matches `{kwargs['pattern']}`")
    if low is not None or high is not None:
        sign = ">" if kwargs.get("exclusive_min") else ">="
        if low is not None and high is not None and not kwargs.get("exclusive_min"):
            parts.append(f"{_show(low)} .. {_show(high)}")
        else:
            if low is not None:
                parts.append(f"{sign} {_show(low)}")
            if high is not None:
                parts.append(f"<= {_show(high)}")
    return shown, "; ".join(parts)


@contextlib.contextmanager
def watching() -> Iterator[dict[str, Row]]:
    """Record every outermost getter call of ``Fields`` while the block runs."""
    rows: dict[str, Row] = {}
    depth = [0]
    cls = fields_module.Fields
    saved = {name: getattr(cls, name) for name in GETTERS}

    def wrap(name: str, original: Any) -> Any:
        def watched(self: Any, *args: Any, **kwargs: Any) -> Any:
            if depth[0] == 0:
                key = args[0] if args else kwargs.get("key", "storage_options")
                row = rows.setdefault(normalise(self.at(key)), Row())
                default, bounds = _describe(name, (key, *args[1:]), kwargs)
                if name not in ("raw", "required"):
                    row.kinds.add(name)
                row.defaults.add(default)
                if bounds:
                    row.ranges.add(bounds)
            depth[0] += 1
            try:
                return original(self, *args, **kwargs)
            finally:
                depth[0] -= 1

        return watched

    for name, original in saved.items():
        setattr(cls, name, wrap(name, original))
    try:
        yield rows
    finally:
        for name, original in saved.items():
            setattr(cls, name, original)


def _source(name: str, fmt: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "format": fmt, "path": f"data/{name}/*", **extra}


def coverage_plans(folder: Path) -> list[dict[str, Any]]:
    """Plans that between them take every branch of the parser (they are parsed, never run)."""
    calibration = folder / "calibration.yaml"
    calibration.write_text(
        "calibration: {version: 1}\n"
        "cost: {piece: 1.0, linear: 0.5, quadratic: 0.001, encoder: {linear: 1, quadratic: 0}}\n"
    )
    model = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "ffn": 256, "vocab": 256}
    full = {
        "version": 1,
        "name": "every-field",
        "seed": 1,
        "on_error": "skip",
        "layout": {"dp": 2, "tp": 1, "pp": 1, "cp": 1, "order": "tp-cp-dp-pp", "balance": "fast"},
        "batch": {
            "seq_len": 64,
            "micro_batches": 2,
            "global_tokens": 200,
            "long_documents": "split",
            "max_document_tokens": 1000,
            "pad_to_seq_len": False,
        },
        "tokenizer": {
            "kind": "tiktoken",
            "path": "bpe.tiktoken",
            "pattern": r"\w+|\s+",
            "special_tokens": {"<s>": 300, "</s>": 301, "<image>": 302},
            "bos": "<s>",
            "eos": "</s>",
            "add_bos": True,
            "add_eos": True,
            "storage_options": {},
        },
        "cost": {"linear": 1.0, "quadratic": 0.0, "piece": 0.0, "encoder": {"linear": 1.0}},
        "loader": {
            "workers": 2,
            "threads_per_worker": 1,
            "read_ahead": 2,
            "prefetch": 2,
            "lookahead": 2,
            "retain_steps": 64,
            "read_retries": 2,
            "standby": True,
            "task_seconds": 0.5,
            "quotas": True,
            "reads_per_slot": 2,
            "groups_per_task": 0,
            "steps_per_task": 0,
            "live_lead": 0,
            "fanout": "none",
            "tls": False,
        },
        "checkpoint": {
            "url": "ckpt",
            "flush_seconds": 2,
            "compact_every": 1000,
            "keep_bases": 3,
            "storage_options": {},
        },
        "mixing": {
            "by": "tokens",
            "over": "steps",
            "interpolate": "linear",
            "schedule": [{"at": 0, "weights": {"web": 1}}, {"at": 10, "weights": {"img": 1}}],
        },
        "images": {
            "patch_size": 14,
            "merge": 2,
            "min_pixels": 3136,
            "max_pixels": 147456,
            "max_input_pixels": 2**26,
            "placeholder": "<image>",
        },
        "sources": [
            _source(
                "web",
                "jsonl",
                weight=1,
                text="text",
                unit_bytes="1MiB",
                merge_bytes="1MiB",
                storage_options={},
                epochs=2,
            ),
            _source("img", "parquet", image="jpeg", text="caption", unit_records=16),
            _source("tar", "webdataset", image=["jpg"]),
            _source(
                "meg",
                "megatron",
                vocabulary={"size": 320, "bos_id": 300, "eos_id": 301},
                transform="omniload_dask.preprocess.fim:fill_in_the_middle",
                filter="omniload_dask.preprocess.fim:fill_in_the_middle",
            ),
            _source("nano", "flat", dtype="uint16", eod=301, vocabulary={"size": 320}),
            _source("mds", "mds", tokens="tokens", dtype="uint32", vocabulary={"size": 320}),
            _source("tok", "parquet", tokens="input_ids", vocabulary={"size": 320}),
            _source(
                "sft",
                "arrow",
                tokens="input_ids",
                mask={"column": "labels", "kind": "labels", "ignore_index": -100},
                vocabulary={"size": 320},
            ),
            _source(
                "chat",
                "jsonl",
                chat={
                    "layout": "messages",
                    "field": "messages",
                    "train_on": "assistant",
                    "template": "{{ messages }}",
                    "max_tokens": 64,
                },
            ),
            _source(
                "qa",
                "parquet",
                chat={
                    "layout": "prompt_completion",
                    "completion": "answer",
                    "template_file": "chat.jinja",
                },
            ),
        ],
    }
    buckets = {
        "layout": {"dp": 2, "rank_map": [[0, 0, 0, 0], [1, 0, 0, 0]]},
        "batch": {
            "global_tokens": 512,
            "buckets": [
                {"seq_len": 64, "share": 0.5},
                {"seq_len": 128, "share": 0.5, "sources": ["web"]},
            ],
        },
        "cost": {"model": {**model, "gated": True, "causal": True}, "encoder": {"model": model}},
        "images": {},
        "sources": [_source("web", "jsonl"), _source("img", "parquet", image="jpeg")],
    }
    micro = {
        "batch": {
            "global_documents": 8,
            "buckets": [{"seq_len": 64, "micro_batches": 2}],
            "stages": [
                {"at_step": 10, "global_documents": 16},
                {"at_step": 20, "global_tokens": 512, "seq_len": 128, "micro_batches": 2},
                {"at_tokens": 10000, "buckets": [{"seq_len": 256, "micro_batches": 1}]},
            ],
        },
        "cost": {"function": "numpy:sqrt"},
        "sources": [_source("web", "jsonl")],
        "streams": {
            "validation": {
                "sources": [_source("held", "jsonl")],
                "batch": {"seq_len": 64},
                "steps": 4,
                "rotation": 2,
            }
        },
    }
    calibrated = {
        "batch": {"seq_len": 64, "long_documents": "truncate", "pack_pool": 16},
        "cost": {"calibration": str(calibration)},
        "sources": [_source("web", "jsonl")],
    }
    return [full, buckets, micro, calibrated]


def watched_rows() -> dict[str, Row]:
    """Every field the parser reads, over the coverage plans."""
    with tempfile.TemporaryDirectory() as tmp, watching() as rows:
        for plan in coverage_plans(Path(tmp)):
            parse_plan(plan, base_dir=tmp)
    return rows


def literal_fields() -> set[str]:
    """Every field name the plan parsers pass by literal to a ``Fields`` getter or ``has``."""
    names: set[str] = set()
    for module in sorted((ROOT / "omniload_dask" / "plan").glob("parse*.py")):
        for node in ast.walk(ast.parse(module.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in (*GETTERS, "has", "at")
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                names.add(node.args[0].value)
    return names


HEADER = """# Plan fields

<!-- Written by scripts/docs_plan_fields.py from the plan parser; do not edit by hand. -->

Every field a plan may give, as `omniload_dask.plan.parse_plan` reads it: its type, the
values it takes and its default. An unknown field is an error that names the closest known
one; a null value counts as absent. How the fields work together is in [Plans](plans.md).
"""


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(rows: dict[str, Row]) -> str:
    """The page: one table per top-level section, in the order of :data:`SECTIONS`."""
    out = [HEADER]
    for section, (title, intro) in SECTIONS.items():
        if section == "":
            members = [p for p in rows if "." not in p and p not in SECTIONS]
        else:
            members = [p for p in rows if _under(p, section)]
            members = [p for p in members if not _deeper_section(p, section)]
        if not members:
            continue
        out.append(f"## {title}\n\n{intro}\n")
        out.append("| field | type | values | default | meaning |")
        out.append("|---|---|---|---|---|")
        for path in members:
            row, meaning = rows[path], MEANINGS[path]
            if isinstance(meaning, str):
                meaning = {"meaning": meaning}
            kind = meaning.get("type") or KIND.get(next(iter(sorted(row.kinds)), ""), "")
            values = meaning.get("values", "; ".join(sorted(row.ranges)))
            default = meaning.get("default", next(iter(row.defaults)))
            out.append(
                f"| `{path}` | {cell(kind)} | {cell(values)} | {cell(default)} "
                f"| {cell(meaning['meaning'])} |"
            )
        out.append("")
    return "\n".join(out)


def _under(path: str, section: str) -> bool:
    """Whether ``path`` is ``section`` or a field inside it."""
    return path == section or path.startswith((section + ".", section + "["))


def _deeper_section(path: str, section: str) -> bool:
    """Whether ``path`` belongs to a longer section of :data:`SECTIONS` than ``section``."""
    return any(
        other != section and _under(other, section) and _under(path, other) for other in SECTIONS
    )


def problems(rows: dict[str, Row]) -> list[str]:
    """What keeps the page from being right: fields without a meaning, meanings without a
    field, defaults or ranges that differ between plans with no stated answer."""
    found = [
        f"{p}: read by the parser, no meaning in docs_plan_meanings.py"
        for p in rows
        if p not in MEANINGS
    ]
    found += [f"{p}: has a meaning, the parser never reads it" for p in MEANINGS if p not in rows]
    for path, row in rows.items():
        meaning = MEANINGS.get(path)
        stated = meaning if isinstance(meaning, dict) else {}
        if len(row.defaults) > 1 and "default" not in stated:
            found.append(f"{path}: defaults differ by plan ({sorted(row.defaults)}): state it")
        if len(row.ranges) > 1 and "values" not in stated:
            found.append(f"{path}: ranges differ by plan ({sorted(row.ranges)}): state it")
        if not row.kinds and "type" not in stated:
            found.append(f"{path}: read unchecked (raw), so its type must be stated")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    args = parser.parse_args()
    rows = watched_rows()
    issues = problems(rows)
    if issues:
        print("\n".join(issues), file=sys.stderr)
        return 1
    page = render(rows)
    if args.check:
        if PAGE.read_text() != page:
            print(
                f"{PAGE.relative_to(ROOT)} is out of date: run scripts/docs_plan_fields.py",
                file=sys.stderr,
            )
            return 1
        return 0
    PAGE.write_text(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())

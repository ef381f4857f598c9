from __future__ import annotations

import os
from pathlib import Path

import pytest

from omniload_dask.core.actions import ReadSpec, SubmitRead
from omniload_dask.plan import Plan, parse_plan
from omniload_dask.testing import InlineDataPlane

from .datagen import plan_dict, texts, write_jsonl, write_parquet

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture
def small_sources(tmp_path: Path) -> Path:
    """Three small sources: plain JSONL (several byte ranges), zstd JSONL, Parquet."""
    write_jsonl(tmp_path / "web" / "a.jsonl", texts(120, seed=1, prefix="wa"))
    write_jsonl(tmp_path / "web" / "b.jsonl", texts(80, seed=2, prefix="wb"))
    write_jsonl(
        tmp_path / "code" / "c.jsonl.zst",
        texts(60, seed=3, mean_words=80, prefix="c"),
        compression="zstd",
    )
    write_parquet(
        tmp_path / "books" / "d.parquet",
        texts(50, seed=4, mean_words=200, prefix="bk"),
        column="body",
    )
    return tmp_path


def make_plan(root: Path, **overrides: object) -> Plan:
    sources = [
        {
            "name": "web",
            "format": "jsonl",
            "path": str(root / "web" / "*.jsonl"),
            "weight": 2,
            "unit_bytes": 4096,
        },
        {
            "name": "code",
            "format": "jsonl",
            "path": str(root / "code" / "*.jsonl.zst"),
            "weight": 1,
        },
        {
            "name": "books",
            "format": "parquet",
            "path": str(root / "books"),
            "text": "body",
            "weight": 1,
        },
    ]
    return parse_plan(plan_dict(sources, **overrides))


@pytest.fixture
def small_plan(small_sources: Path) -> Plan:
    return make_plan(small_sources)


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    write_jsonl(tmp_path / "a.jsonl", texts(300, seed=1, mean_words=20, prefix="a"))
    write_jsonl(tmp_path / "b.jsonl", texts(200, seed=2, mean_words=60, prefix="b"))
    write_parquet(tmp_path / "c.parquet", texts(100, seed=3, mean_words=150, prefix="c"))
    write_jsonl(tmp_path / "d.jsonl", texts(100, seed=4, mean_words=40, prefix="d"))
    return tmp_path


def record_reads(plane: InlineDataPlane) -> list[ReadSpec]:
    """The reads ``plane`` submits from now on, in order (the list fills as it runs)."""
    reads: list[ReadSpec] = []
    original = plane._run

    def run(actions):
        reads.extend(a.read for a in actions if isinstance(a, SubmitRead))
        original(actions)

    plane._run = run  # type: ignore[method-assign]
    return reads

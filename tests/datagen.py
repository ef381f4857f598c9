"""Small real files for tests: JSON Lines (plain/gz/zst) and Parquet, with known contents."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import zstandard


def texts(n: int, seed: int = 0, mean_words: float = 30, prefix: str = "doc") -> list[str]:
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta", "iota", "kappa"]
    out = []
    for i in range(n):
        k = int(max(1, rng.poisson(mean_words)))
        out.append(f"{prefix}{i} " + " ".join(words[int(j)] for j in rng.integers(0, 10, k)))
    return out


def write_jsonl(
    path: Path,
    docs: list[Any],
    field: str = "text",
    compression: str | None = None,
    raw_lines: dict[int, str] | None = None,
) -> Path:
    """One record per doc; ``raw_lines`` replaces line i verbatim (to plant bad records)."""
    lines = []
    for i, d in enumerate(docs):
        if raw_lines and i in raw_lines:
            lines.append(raw_lines[i])
        else:
            lines.append(json.dumps({field: d, "n": i}))
    data = ("\n".join(lines) + "\n").encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    if compression == "gzip":
        data = gzip.compress(data, mtime=0)
    elif compression == "zstd":
        data = zstandard.ZstdCompressor().compress(data)
    path.write_bytes(data)
    return path


def write_parquet(
    path: Path,
    docs: list[Any],
    column: str = "text",
    row_group_size: int = 16,
) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(
        pa.table({column: docs, "n": list(range(len(docs)))}), path, row_group_size=row_group_size
    )
    return path


def plan_dict(sources: list[dict[str, Any]], **overrides: Any) -> dict[str, Any]:
    plan: dict[str, Any] = {
        "version": 1,
        "name": "t",
        "seed": 3,
        "tokenizer": {"kind": "byte"},
        "batch": {"seq_len": 256, "micro_batches": 2, "global_tokens": 1024},
        "layout": {"dp": 2},
        "on_error": "raise",
        "sources": sources,
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(plan.get(key), dict):
            plan[key] = {**plan[key], **value}
        else:
            plan[key] = value
    return plan


IMAGES = {"patch_size": 8, "merge": 2, "min_pixels": 1024, "max_pixels": 16384}


def write_image_sources(root: Path) -> Path:
    """Parquet with JPEG/PNG/WebP bytes (40 rows), two tar shards (30 + 20), and JSON Lines."""
    from omniload_dask.demo import write_image_parquet, write_image_tar

    write_image_parquet(root / "pq" / "a.parquet", 40, seed=1, row_group_size=16)
    write_image_tar(root / "tar" / "a.tar", 30, seed=2)
    write_image_tar(root / "tar" / "b.tar", 20, seed=3)
    write_jsonl(root / "txt" / "a.jsonl", texts(120, seed=4))
    return root


def image_plan(root: Path, **overrides: Any) -> Any:
    """Two image-text sources and one text source over :func:`write_image_sources`' files."""
    from omniload_dask.plan import parse_plan

    sources = [
        {
            "name": "cap",
            "format": "parquet",
            "path": str(root / "pq"),
            "image": "image",
            "text": "caption",
            "weight": 1,
        },
        {
            "name": "wds",
            "format": "webdataset",
            "path": str(root / "tar"),
            "unit_records": 8,
            "weight": 1,
        },
        {"name": "txt", "format": "jsonl", "path": str(root / "txt"), "weight": 1},
    ]
    data = plan_dict(
        sources,
        batch={"seq_len": 512, "micro_batches": 2, "global_tokens": 2048},
        images=IMAGES,
        cost={"encoder": {"linear": 1.0, "quadratic": 0.001}},
    )
    data.update(overrides)
    return parse_plan(data)

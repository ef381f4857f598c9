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

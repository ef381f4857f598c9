"""Small real files for tests: JSON Lines (plain/gz/zst) and Parquet, with known contents."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
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


def validation_plan(root: Path, name: str, validation: dict[str, Any], **overrides: Any) -> Any:
    """A one-source training plan (dp 1, one micro-batch of 128 a step) with a ``validation``
    stream over a held-out file: ``validation`` gives the stream's other fields."""
    from omniload_dask.plan import parse_plan

    write_jsonl(root / "train.jsonl", texts(100, seed=1, prefix="tr"))
    write_jsonl(root / "val.jsonl", texts(40, seed=2, prefix="va"))
    held = {"name": "held", "format": "jsonl", "path": str(root / "val.jsonl")}
    sources = [{"name": "web", "format": "jsonl", "path": str(root / "train.jsonl")}]
    return parse_plan(
        plan_dict(
            sources,
            name=name,
            layout={"dp": 1},
            batch={"seq_len": 128, "micro_batches": 1, "global_tokens": 128},
            streams={"validation": {"sources": [held], **validation}},
            **overrides,
        )
    )


def sized_texts(lengths: np.ndarray, seed: int, prefix: str) -> list[str]:
    """Texts of exactly these lengths in bytes (with the byte tokenizer: ``length + 2``
    tokens, BOS and EOS), random lowercase letters and spaces."""
    rng = np.random.default_rng(seed)
    alphabet = np.frombuffer(b"abcdefghij klmnopqrstuvwxyz ", dtype=np.uint8)
    out = []
    for i, n in enumerate(np.asarray(lengths).tolist()):
        head = f"{prefix}{i} "
        body = alphabet[rng.integers(0, len(alphabet), max(0, n - len(head)))].tobytes().decode()
        out.append((head + body)[: max(n, 1)])
    return out


def write_shaped_corpus(
    root: Path, scale: int = 32, counts: tuple[int, int, int] = (2400, 900, 240)
) -> Path:
    """Three sources shaped like a real corpus at 1/``scale`` of its token counts: short texts
    (real: about 100-4,000 tokens), code files (real: a long tail up to 183k tokens) and long
    documents (real: 8k-32k tokens), ``counts`` documents of each. At ``scale`` 32 an
    8,192-token micro-batch is 256 tokens."""
    rng = np.random.default_rng(7)
    short = np.clip(rng.lognormal(6.0, 0.8, counts[0]), 100, 4000) / scale
    code = np.clip(rng.lognormal(7.5, 1.3, counts[1]), 60, 183_000) / scale
    long = rng.integers(8192, 32768, counts[2]) / scale
    for name, lengths, seed in (("short", short, 1), ("code", code, 2), ("long", long, 3)):
        write_jsonl(root / name / "part.jsonl", sized_texts(lengths.astype(int), seed, name))
    return root


def shaped_sources(
    root: Path, weights: tuple[float, float, float] = (0.6, 0.3, 0.1), **extra: Any
) -> list[dict[str, Any]]:
    """The three sources of :func:`write_shaped_corpus` with these weights (and ``extra``
    fields, e.g. ``epochs``)."""
    return [
        {
            "name": name,
            "format": "jsonl",
            "path": str(root / name / "part.jsonl"),
            "weight": w,
            "unit_bytes": 16384,
            **extra,
        }
        for name, w in zip(("short", "code", "long"), weights, strict=True)
    ]


def read_records(plan: Any) -> Iterator[tuple[int, int, np.ndarray]]:
    """Every record of ``plan``'s sources as its read task hands it over (bad ones left out
    under ``on_error: skip``): ``(source index, sample id, tokens)``."""
    from omniload_dask.cluster import tasks

    for i, spec in enumerate(plan.sources):
        catalog = tasks.discover(spec)
        for f, lo, hi in catalog.units.tolist():
            shard = tasks.read_unit(
                spec, i, plan.tokenizer, plan.on_error, f, catalog.files[f], lo, hi
            )
            for r, sid in enumerate(shard.sample_ids.tolist()):
                yield i, sid, shard.tokens[shard.offsets[r] : shard.offsets[r + 1]]

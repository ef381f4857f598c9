"""Padding of whole documents in context buckets, with and without ``batch.pack_pool``.

A generated corpus of two sources, short chat-like documents and longer ones (log-normal word
counts, the byte tokenizer, so nothing is downloaded), under a plan with two context buckets
and ``long_documents: truncate``. The data plane runs in process (the coordinator and inline
reads: padding is a property of the draw and the balancer, not of the cluster), once with the
in-order draw and once with the pool, on the same data and plan otherwise, for the same steps.
Each bucket's padding share is its micro-batches' empty positions over their capacity; the
in-order draw also gives a step more micro-batches than the plan declares where its documents
do not pack into them (``extra_micro_batches``), the pooled one never.

    python benchmarks/pool_buckets.py --steps 300 --pack-pool 64

Prints ``RESULT {json}`` with ``padding_share`` and ``padding_share_in_order`` (per bucket, by
seq_len), ``padding_share_all`` / ``padding_share_all_in_order`` (every micro-batch) and
``extra_micro_batches`` / ``extra_micro_batches_in_order`` (beyond the declared, all steps).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

WORDS = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta", "iota", "kappa"]


def write_corpus(root: Path, short: int, long: int) -> None:
    """Two JSONL sources: ``short`` documents of about 25 words, ``long`` of about 110."""
    rng = np.random.default_rng(7)
    for name, n, median, sigma in (("chat", short, 25, 0.7), ("docs", long, 110, 0.5)):
        words = np.maximum(1, rng.lognormal(np.log(median), sigma, n).astype(int))
        (root / name).mkdir(parents=True, exist_ok=True)
        with open(root / name / "part.jsonl", "w") as out:
            for i, k in enumerate(words.tolist()):
                text = f"{name}{i} " + " ".join(WORDS[j] for j in rng.integers(0, 10, k))
                out.write(json.dumps({"text": text}) + "\n")


def run(root: Path, pool: int, steps: int, buckets: list[dict[str, Any]]) -> dict[str, Any]:
    """Each bucket's padding and the micro-batches past the declared over ``steps`` steps."""
    from omniload_dask.plan import parse_plan
    from omniload_dask.testing import InlineDataPlane

    plan = parse_plan({
        "version": 1, "name": "pool-buckets", "seed": 3, "tokenizer": {"kind": "byte"},
        "batch": {"buckets": buckets, "long_documents": "truncate", "pack_pool": pool},
        "layout": {"dp": 4}, "on_error": "raise",
        "sources": [{"name": n, "format": "jsonl", "path": str(root / n), "weight": 1}
                    for n in ("chat", "docs")],
    })  # fmt: skip
    declared = sum(b.micro_batches for b in plan.batch.buckets)
    plane = InlineDataPlane(plan)
    empty: Counter[int] = Counter()
    capacity: Counter[int] = Counter()
    extra = 0
    for _, batches in plane.stream(steps):
        for batch in batches.values():
            extra += len(batch.micro_batches) - declared
            for mb in batch.micro_batches:
                seq_len = int(mb["seq_len"])
                capacity[seq_len] += seq_len
                empty[seq_len] += seq_len - int(mb["cu_seqlens"][-1])
    return {
        "padding_share": {s: round(empty[s] / capacity[s], 4) for s in sorted(capacity)},
        "padding_share_all": round(sum(empty.values()) / sum(capacity.values()), 4),
        "extra_micro_batches": extra,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--pack-pool", type=int, default=64)
    parser.add_argument("--short", type=int, default=6000, help="short documents")
    parser.add_argument("--long", type=int, default=3000, help="long documents")
    args = parser.parse_args()
    buckets = [{"seq_len": 256, "micro_batches": 4}, {"seq_len": 1024, "micro_batches": 2}]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_corpus(root, args.short, args.long)
        pooled = run(root, args.pack_pool, args.steps, buckets)
        in_order = run(root, 0, args.steps, buckets)
    result = {
        "steps": args.steps, "pack_pool": args.pack_pool, "buckets": buckets, "dp": 4,
        **pooled, **{f"{k}_in_order": v for k, v in in_order.items()},
    }  # fmt: skip
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

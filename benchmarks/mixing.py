"""Dealing time of a global batch drawn from many sources (the paper's largest mix has 306).

    python benchmarks/mixing.py [--quick] [--sources 300]

The real data plane (coordinator, mixer, balancer) runs on synthetic catalogs: read units are
"reported" at once with deterministic heavy-tailed document lengths, so only dealing is timed,
never I/O. For each configuration it reports the median and p99 time of

- ``select``: the mixer alone (``Mixer.select`` over every source's upcoming documents),
- ``draw``: the data plane's whole draw (every source's candidates, select, cursor commit),
- ``split`` and ``recipes``: balancing across DP groups, and the per-group recipes,
- ``step``: all of it, as one ``Coordinator.advance`` call,

against the DESIGN.md budget of 10 ms per global batch (4k documents, DP 128), and checks the
realised shares against the targets. Ends with ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from omniload_dask.batching.mixing import Mixer
from omniload_dask.core.coordinator import Coordinator, SubmitRead
from omniload_dask.core.events import ReadReported, StepsRequested
from omniload_dask.plan import parse_plan
from omniload_dask.sources import Catalog

BUDGET_MS = 10.0


def synthetic_plan(sources: int, dp: int, budget: dict, by: str) -> tuple:
    rng = np.random.default_rng(0)
    weights = rng.pareto(1.2, sources) + 0.05  # a few big sources, a long tail of small ones
    plan = parse_plan(
        {
            "name": "mix",
            "seed": 1,
            "batch": {"seq_len": 8192, "micro_batches": 4, **budget},
            "layout": {"dp": dp},
            "mixing": {"by": by},
            "sources": [
                {
                    "name": f"s{i:03d}",
                    "format": "jsonl",
                    "path": f"memory://mix/s{i}.jsonl",
                    "weight": float(w),
                }
                for i, w in enumerate(weights)
            ],
        }
    )
    catalogs = [
        Catalog(
            source=s.name,
            files=(f"memory://mix/{s.name}.jsonl",),
            units=np.array([[0, u, u + 1] for u in range(64)], dtype=np.int64),
            rows=np.full(64, -1, dtype=np.int64),
        )
        for s in plan.sources
    ]
    medians = rng.lognormal(6.0, 1.0, sources)  # per-source typical document length
    return plan, catalogs, medians


def run(sources: int, dp: int, steps: int, by: str, documents: int | None = None) -> dict:
    global_tokens = dp * 4 * 8192
    budget = {"global_documents": documents} if documents else {"global_tokens": global_tokens}
    plan, catalogs, medians = synthetic_plan(sources, dp, budget, by)
    coord = Coordinator(plan, catalogs, "bench")
    rng = np.random.default_rng(1)

    def report(actions: list) -> None:
        for a in actions:
            if isinstance(a, SubmitRead):
                n = 400
                lengths = np.clip(
                    rng.lognormal(np.log(medians[a.read.source]), 0.9, n), 8, 60_000
                ).astype(np.int32)
                coord.handle(ReadReported(a.read.key, lengths, 0))

    step_ms, select_ms, docs, phases = [], [], [], []
    mixer_probe = Mixer(sources, by)
    for t in range(steps):
        for r in range(plan.layout.world_size):
            coord.handle(StepsRequested(r, t, 1))
        report(coord.advance(max_steps=0))  # reads for the step are known beforehand
        for _ in range(50):
            before = coord.view.next_step
            t0 = time.perf_counter()
            actions = coord.advance(max_steps=1)
            elapsed = (time.perf_counter() - t0) * 1e3
            report(actions)
            if coord.view.next_step > before:
                step_ms.append(elapsed)
                phases.append(dict(coord.components.figures.timing))
                docs.append(coord.view.history[-1].documents)
                break
        # the draw alone, on the same candidates the coordinator saw
        weights = coord.view.weights_at(coord.view.next_step)
        cands = [
            s.candidates(
                coord.components.sources.caps[i],
                int(global_tokens * weights[i] / weights.sum() * 1.25) + 8192,
                1,
            )
            for i, s in enumerate(coord.view.streams)
        ]
        mixer_probe.tags = coord.components.drawer.mixer.tags.copy()
        t0 = time.perf_counter()
        mixer_probe.select(
            weights,
            [c.lengths for c in cands],
            [True] * sources,
            budget_tokens=None if documents else global_tokens,
            budget_documents=documents,
            cut=documents is None and plan.batch.long_documents == "split",  # as the draw does
            chunk=plan.batch.seq_len,
            continuing=[s.offset > 0 for s in coord.view.streams],
        )
        select_ms.append((time.perf_counter() - t0) * 1e3)
    warm = slice(min(3, len(step_ms) - 1), None)
    target = coord.view.weights_at(coord.view.next_step)
    shares = np.asarray([s.tokens if by == "tokens" else s.docs for s in coord.view.streams], float)
    error = np.abs(shares / shares.sum() - target / target.sum()).max()
    return {
        "sources": sources,
        "dp": dp,
        "by": by,
        "steps": len(step_ms),
        "documents_per_step": float(np.mean(docs)),
        "draw_ms_p50": float(np.median(select_ms[warm])),
        "draw_ms_p99": float(np.percentile(select_ms[warm], 99)),
        "step_ms_p50": float(np.median(step_ms[warm])),
        "plane_draw_ms_p50": float(np.median([p["draw_ms"] for p in phases[warm]])),
        "split_ms_p50": float(np.median([p["assign_ms"] for p in phases[warm]])),
        "recipes_ms_p50": float(np.median([p["recipes_ms"] for p in phases[warm]])),
        "step_ms_p99": float(np.percentile(step_ms[warm], 99)),
        "max_share_error_pp": float(error * 100),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sources", type=int, default=300)
    args = parser.parse_args()
    steps = 12 if args.quick else 60
    configs = [
        (args.sources, 8, "tokens", None),
        (args.sources, 128, "tokens", 4096),
        (args.sources, 128, "documents", 4096),
        (3, 128, "tokens", 4096),
    ]
    rows = [run(s, dp, steps, by, docs) for s, dp, by, docs in configs]
    print(
        f"{'sources':>7} {'dp':>4} {'by':>9} {'docs/step':>9} {'select p50/p99':>15} "
        f"{'draw':>6} {'split':>6} {'recipes':>7} {'step p50/p99 ms':>16} {'share err pp':>12}"
    )
    for r in rows:
        print(
            f"{r['sources']:>7} {r['dp']:>4} {r['by']:>9} {r['documents_per_step']:>9.0f} "
            f"{r['draw_ms_p50']:>6.2f} / {r['draw_ms_p99']:<6.2f} "
            f"{r['plane_draw_ms_p50']:>6.2f} {r['split_ms_p50']:>6.2f} {r['recipes_ms_p50']:>7.2f} "
            f"{r['step_ms_p50']:>7.2f} / {r['step_ms_p99']:<6.2f} {r['max_share_error_pp']:>12.3f}"
        )
    print(
        "RESULT "
        + json.dumps(
            {
                "benchmark": "mixing",
                "quick": args.quick,
                "budget_ms": BUDGET_MS,
                "load_average": os.getloadavg()[0],
                "rows": rows,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Dealing time of one global batch: everything the data plane does per drawn step, by phase.

    python benchmarks/dealing.py [--quick] [--mix balance|manysources|h2h] [--runs 3] [--steps 6]

The real :class:`~omniload_dask.core.coordinator.Coordinator` runs on synthetic catalogs (no
I/O: a read unit "reports" at once, with document lengths drawn from a fixed seed per unit),
so only dealing is timed. One point is a DP size and a global batch of about ``docs``
documents::

    dp1024_docs16384   DP 1,024; a global batch of 16,384 x 1,024 = 16 Mi tokens (mix
                       "balance": a document averages 1,024 tokens); seq_len 8192, so every
                       rank has ceil(16 Mi / (1,024 x 8192)) = 2 micro-batches, all full
    dp8_docs64         DP 8; 64 x 1,024 = 64 Ki tokens: one full 8192-token micro-batch per
                       rank, the step of the throughput benchmark at R = 8

The mixes are the length distributions of the other benchmarks: ``balance`` is
``benchmarks/balance.py``'s (web-like lognormal, code-like lognormal, 8k-64k log-uniform long
documents; token weights 0.5 / 0.3 / 0.2) with every length scaled by 0.886 so that the mean
document is 1,024 tokens; ``manysources`` is ``benchmarks/support/manysources.py``'s 16 sources (web,
code and book word counts, each source with its own length scale; code counts a third more
tokens than words for its punctuation); ``h2h`` is the shape of ``benchmarks/head_to_head.py``'s
steps (short texts of about 100 tokens, code of about 1.6k, long documents of 8k-32k; token
weights 0.026 / 0.205 / 0.769: at DP 8 about 19 documents a step, ``--point 8 19``, one
8192-token micro-batch per rank) under that run's fitted cost model (``linear`` 4.92e-5,
``quadratic`` 4.94e-8) instead of the 8B model's. The global batch is ``docs`` times the mix's mean
document (the global batch does not depend on the DP size); the layout follows from it.

Per point it reports, as the best of ``--runs`` runs (a fresh coordinator each, so each run
deals the same steps) of the process's CPU time, the median over the timed steps of:

- ``step``: one drawn step, its three phases ``Coordinator.draw_step``, ``deal_steps`` and
  ``commit_step`` (the apply of live changes, the draw,
  the split, the recipes, the construction actions, the figures and the state record);
- ``draw`` (the mixer's selection and the cursors), ``split`` (routing to buckets, the split
  among DP groups, the packing into micro-batches) and ``recipes``; ``rest`` is the remainder;

and the balance of those steps: efficiency (mean/max of the group costs under the plan's cost
model) mean and minimum, the structural bound (``Assignment.bound``: the mean group cost over
the costliest piece of at most ``seq_len`` tokens, what any split that does not cut documents
shorter can reach) mean, and the documents cut per step. Ends with ``RESULT {json}``.

``--consecutive N`` deals N consecutive steps per point instead (one run, two warm-up steps)
and reports their balance against ``benchmarks/head_to_head.py``'s ``balance_bound`` of each
step's pieces under its token limit: efficiency mean (standard error) and minimum, the bound's
mean, the mean gap and the share of steps within 0.01 of it, the sum of the steps' peak group
costs, cuts a step, and the medians of ``split`` and ``step``::

    python benchmarks/dealing.py --mix h2h --point 8 19 --consecutive 1000

:func:`planning_ms` gives the per-step figure alone, keyed like ``"dp1024_docs16384"``, for
other benchmarks (``benchmarks/scale.py``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # (run from elsewhere: head_to_head)

from head_to_head import balance_bound

from omniload_dask.core.coordinator import Coordinator, SubmitRead
from omniload_dask.core.events import ReadReported, StepsRequested
from omniload_dask.plan import parse_plan
from omniload_dask.sources import Catalog

SEQ_LEN = 8192
DPS = (128, 1024, 4096)
DOCS = (4096, 16384, 65536)
QUICK = ((128, 4096), (1024, 16384), (4096, 4096), (4096, 16384))
MODEL_8B = {"hidden": 4096, "layers": 32, "heads": 32, "kv_heads": 8, "ffn": 14336,
            "vocab": 128256, "gated": True}  # fmt: skip
TRAIL = 8  # the ranks have fetched every step but the last 8 drawn
UNIT_TOKENS = 1 << 20  # a read unit holds about this many tokens (a few MiB of text)
BALANCE_SCALE = 0.886  # benchmarks/balance.py's lengths times this: a 1,024-token mean


# ------------------------------------------------------------------ length mixes
class Mix:
    """Sources (name, token weight) and a deterministic length sampler per source."""

    def __init__(
        self,
        name: str,
        weights: list[float],
        draw: Callable[[np.random.Generator, int, int], np.ndarray],
        mean_tokens: float | None = None,
        cost: dict[str, Any] | None = None,
    ) -> None:
        self.name = name
        self.cost = cost or {"model": MODEL_8B}  # the plan's cost section
        self.weights = np.asarray(weights, dtype=np.float64)
        self.draw = draw  # (rng, source, n) -> token counts
        rng = np.random.default_rng(12345)
        means = np.asarray([draw(rng, s, 200_000).mean() for s in range(len(weights))])
        share = self.weights / self.weights.sum()
        # documents are drawn by tokens; the balance mix is scaled to a 1,024-token mean
        self.mean_tokens = mean_tokens or round(float(1.0 / (share / means).sum()))
        self.source_mean = means


def _balance_draw(rng: np.random.Generator, source: int, n: int) -> np.ndarray:
    s = BALANCE_SCALE
    if source == 0:  # web-like: median 400 tokens, heavy tail
        x = np.clip(rng.lognormal(np.log(400 * s), 1.0, n), 16, 16000 * s)
    elif source == 1:  # code-like files: median 1500 tokens, heavier tail
        x = np.clip(rng.lognormal(np.log(1500 * s), 1.2, n), 32, 60000 * s)
    else:  # long documents: 8k to 64k, log-uniform
        x = np.exp(rng.uniform(np.log(8192 * s), np.log(65536 * s), n))
    return np.maximum(x, 1).astype(np.int64)


MANY_SOURCES = 16
_KIND_WEIGHT = (0.5, 0.3, 0.2)  # web, code, books; split evenly among the sources of a kind
_SCALES = np.random.default_rng(20261130).uniform(0.7, 1.4, MANY_SOURCES)


def _many_draw(rng: np.random.Generator, source: int, n: int) -> np.ndarray:
    kind, scale = source % 3, float(_SCALES[source])
    if kind == 0:  # web: median ~100 words, heavy tail
        words = np.clip(rng.lognormal(np.log(100 * scale), 0.8, n), 5, 4000)
    elif kind == 1:  # code: median ~250 words, plus a punctuation token for a third of them
        words = np.clip(rng.lognormal(np.log(250 * scale), 0.9, n), 20, 12000) * 4 / 3
    else:  # books: Pareto tail from 300 words, up to 40k
        words = np.clip(rng.pareto(1.5, n) * 800 * scale + 300, 300, 40000)
    return words.astype(np.int64) + 2  # BOS and EOS


def _many_weights() -> list[float]:
    kinds = [s % 3 for s in range(MANY_SOURCES)]
    return [_KIND_WEIGHT[k] / kinds.count(k) for k in kinds]


def _h2h_draw(rng: np.random.Generator, source: int, n: int) -> np.ndarray:
    if source == 0:  # short texts
        x = np.clip(rng.lognormal(np.log(100), 0.9, n), 8, 1000)
    elif source == 1:  # source code
        x = np.clip(rng.lognormal(np.log(1600), 1.1, n), 30, 60000)
    else:  # long documents, 8k to 32k
        x = np.exp(rng.uniform(np.log(8000), np.log(32000), n))
    return np.maximum(x, 1).astype(np.int64)


H2H_COST = {"linear": 4.92e-05, "quadratic": 4.94e-08}  # the head-to-head run's fitted model

MIXES = {
    "balance": lambda: Mix("balance", [0.5, 0.3, 0.2], _balance_draw, 1024),
    "manysources": lambda: Mix("manysources", _many_weights(), _many_draw),
    "h2h": lambda: Mix("h2h", [0.026, 0.205, 0.769], _h2h_draw, cost=H2H_COST),
}


# ------------------------------------------------------------------ one point
def point_key(dp: int, docs: int) -> str:
    """The key of a point in :func:`planning_ms`'s answer."""
    return f"dp{dp}_docs{docs}"


def setup(dp: int, docs: int, mix: Mix, steps: int) -> tuple[Any, list[Catalog], dict[str, Any]]:
    """The plan and catalogs of one point, and its shape (tokens, micro-batches, fill)."""
    tokens = int(docs * mix.mean_tokens)
    micro = max(1, math.ceil(tokens / (dp * SEQ_LEN)))
    sources = [
        {"name": f"s{i:02d}", "format": "jsonl", "path": f"memory://s{i:02d}.jsonl", "weight": w}
        for i, w in enumerate(mix.weights.tolist())
    ]
    plan = parse_plan({
        "name": "dealing", "seed": 1,
        "batch": {"seq_len": SEQ_LEN, "micro_batches": micro, "global_tokens": tokens},
        "layout": {"dp": dp}, "cost": mix.cost, "sources": sources,
        "loader": {"lookahead": 0, "prefetch": 1},
    })  # fmt: skip
    share = mix.weights / mix.weights.sum()
    catalogs = []
    for i, spec in enumerate(plan.sources):
        need = share[i] * tokens * (steps + 2) / UNIT_TOKENS + 4
        units = int(need) + 1
        catalogs.append(
            Catalog(
                source=spec.name,
                files=(f"memory://{spec.name}.jsonl",),
                units=np.array([[0, u, u + 1] for u in range(units)], dtype=np.int64),
                rows=np.full(units, -1, dtype=np.int64),
            )
        )
    shape = {"global_tokens": tokens, "micro_batches": micro,
             "fill": tokens / (dp * micro * SEQ_LEN)}  # fmt: skip
    return plan, catalogs, shape


def _report(coord: Coordinator, mix: Mix, actions: Iterable[Any]) -> None:
    """Report every submitted read at once, with lengths fixed by (source, unit)."""
    for a in actions:
        if isinstance(a, SubmitRead):
            s, u = a.read.source, a.read.start
            rng = np.random.default_rng([zlib.crc32(mix.name.encode()), s, u])
            n = max(8, int(UNIT_TOKENS / mix.source_mean[s]))
            coord.handle(ReadReported(a.read.key, mix.draw(rng, s, n).astype(np.int32), 0))


def run_once(dp: int, docs: int, mix: Mix, steps: int, warmup: int) -> dict[str, Any]:
    """Plan ``warmup + steps`` steps with a fresh coordinator; CPU ms per phase of each step."""
    plan, catalogs, shape = setup(dp, docs, mix, steps + warmup)
    coord = Coordinator(plan, catalogs, "bench")
    phases: dict[str, float] = {}

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            c0 = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                phases[name] = phases.get(name, 0.0) + (time.process_time() - c0) * 1e3

        return wrapper

    splits: list[Any] = []
    split = coord.components.dealer.assign

    def keep_split(*args: Any, **kwargs: Any) -> Any:
        out = split(*args, **kwargs)
        splits.append(out)
        return out

    coord.components.drawer.draw = timed("draw", coord.components.drawer.draw)  # type: ignore[method-assign]
    coord.components.dealer.assign = timed("split", keep_split)  # type: ignore[method-assign]
    coord.components.dealer.recipes = timed("recipes", coord.components.dealer.recipes)  # type: ignore[method-assign]
    # One drawn step is its three phases (draw, plan, commit; see core/stepping.py); they
    # add up to "step" whether they ran inline or, in the plugin, in a dealing process.
    coord.draw_step = timed("step", coord.draw_step)  # type: ignore[method-assign]
    coord.deal_steps = timed("step", coord.deal_steps)  # type: ignore[method-assign]
    coord.commit_step = timed("step", coord.commit_step)  # type: ignore[method-assign]
    rows, step_splits = [], []  # (each step's split: its last)
    ranks = list(range(plan.layout.world_size))
    for rank in ranks:
        coord.handle(StepsRequested(rank, 0, steps + warmup))
    for t in range(steps + warmup):
        if t >= TRAIL:  # the ranks fetch as they go (the draw stops 12 steps past the slowest)
            coord.handle(StepsRequested(ranks, t - TRAIL, steps + warmup - t + TRAIL))
        for _ in range(64):  # report the reads it asks for until the step is drawn
            before = coord.view.next_step
            phases.clear()
            _report(coord, mix, coord.advance(max_steps=1))
            if coord.view.next_step > before:
                break
        else:
            raise RuntimeError("a step was not drawn after 64 rounds of reads")
        a = splits[-1]
        step_splits.append(a)
        step_rows = {k: phases.get(k, 0.0) for k in ("step", "draw", "split", "recipes")}
        step_rows["rest"] = step_rows["step"] - step_rows["draw"] - step_rows["split"]
        step_rows["rest"] -= step_rows["recipes"]
        step_rows.update(
            peak=float(a.group_costs.max()),
            efficiency=a.efficiency,
            bound=getattr(a, "bound", None),
            cuts=a.cuts,
            documents=coord.view.history[-1].documents,
            pieces=len(a.doc),
        )
        rows.append(step_rows)
    return {"shape": shape, "rows": rows[warmup:], "splits": step_splits[warmup:]}


def _bound(a: Any) -> float:
    """``head_to_head.balance_bound`` of a split's pieces under its groups' token limit."""
    return balance_bound(a.cost, a.groups, a.length, float(a.micro_capacity.sum()))


def balance_figures(splits: list[Any]) -> dict[str, float]:
    """Balance of dealt steps (their ``Assignment``s) against each one's bound: efficiency
    mean (standard error) and minimum, the bound's mean, the mean gap, the share of steps
    within 0.01 of their bound, and cuts a step (also ``benchmarks/real_balance.py``'s)."""
    eff = np.asarray([a.efficiency for a in splits])
    bound = np.asarray([_bound(a) for a in splits])
    return {
        "efficiency_mean": float(eff.mean()),
        "efficiency_se": float(eff.std(ddof=1) / math.sqrt(len(eff))) if len(eff) > 1 else 0.0,
        "efficiency_min": float(eff.min()),
        "balance_bound_mean": float(bound.mean()),
        "gap_mean": float((bound - eff).mean()),
        "within_001": float(((bound - eff) <= 0.01).mean()),
        "cuts_per_step": float(np.mean([a.cuts for a in splits])),
    }


def consecutive(dp: int, docs: int, mix: str, steps: int) -> dict[str, Any]:
    """Balance and dealing time of ``steps`` consecutive steps of one point (module doc)."""
    run = run_once(dp, docs, MIXES[mix](), steps, 2)
    rows = run["rows"]
    return {
        "key": point_key(dp, docs), "mix": mix, "steps": len(rows),
        **balance_figures(run["splits"]),
        "peak_sum": float(sum(r["peak"] for r in rows)),
        "split_ms_median": float(np.median([r["split"] for r in rows])),
        "step_ms_median": float(np.median([r["step"] for r in rows])),
    }  # fmt: skip


def measure(
    dp: int, docs: int, mix: str = "balance", steps: int = 6, runs: int = 3, warmup: int = 1
) -> dict[str, Any]:
    """One point: best of ``runs`` per step and phase, then the median over ``steps`` steps."""
    m = MIXES[mix]()
    results = [run_once(dp, docs, m, steps, warmup) for _ in range(runs)]
    first = results[0]["rows"]
    best = {
        k: np.min([[r[k] for r in res["rows"]] for res in results], axis=0)
        for k in ("step", "draw", "split", "recipes", "rest")
    }
    eff = np.asarray([r["efficiency"] for r in first])
    bounds = [r["bound"] for r in first if r["bound"] is not None]
    return {
        "key": point_key(dp, docs),
        "mix": mix,
        "dp": dp,
        "docs_nominal": docs,
        **results[0]["shape"],
        "documents_per_step": float(np.mean([r["documents"] for r in first])),
        "documents_per_group": float(np.mean([r["documents"] for r in first]) / dp),
        "pieces_per_step": float(np.mean([r["pieces"] for r in first])),
        "step_ms": float(np.median(best["step"])),
        "step_ms_max": float(np.max(best["step"])),
        "draw_ms": float(np.median(best["draw"])),
        "split_ms": float(np.median(best["split"])),
        "recipes_ms": float(np.median(best["recipes"])),
        "rest_ms": float(np.median(best["rest"])),
        "efficiency_mean": float(eff.mean()),
        "efficiency_min": float(eff.min()),
        "bound_mean": float(np.mean(bounds)) if bounds else None,
        "cuts_per_step": float(np.mean([r["cuts"] for r in first])),
        "steps": len(first),
        "runs": runs,
    }


def planning_ms(
    points: Iterable[tuple[int, int]] | None = None,
    *,
    mix: str = "balance",
    steps: int = 4,
    runs: int = 3,
) -> dict[str, float]:
    """CPU milliseconds per drawn step (best of ``runs``, median over ``steps``) per point,
    keyed like ``"dp1024_docs16384"``; ``points`` are ``(dp, docs)`` pairs (default: the
    ``--quick`` set)."""
    return {
        point_key(dp, docs): measure(dp, docs, mix, steps, runs)["step_ms"]
        for dp, docs in (points if points is not None else QUICK)
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="four points, fewer steps")
    parser.add_argument("--mix", choices=sorted(MIXES), default="balance")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per point")
    parser.add_argument("--runs", type=int, default=3, help="runs per point (best of)")
    parser.add_argument("--point", nargs=2, type=int, action="append", metavar=("DP", "DOCS"),
                        help="only this point (repeatable)")  # fmt: skip
    parser.add_argument("--consecutive", type=int, default=0, metavar="N",
                        help="balance of N consecutive steps per point (module doc)")  # fmt: skip
    args = parser.parse_args()
    if args.consecutive < 0:
        parser.error(f"--consecutive: a number of steps >= 1 (0: off), got {args.consecutive}")
    points = args.point or (QUICK if args.quick else [(d, n) for d in DPS for n in DOCS])
    if args.consecutive:
        load_before = os.getloadavg()[0]
        found = []
        for dp, docs in points:
            c = consecutive(dp, docs, args.mix, args.consecutive)
            found.append(c)
            print(f"{c['key']:>18} {c['steps']} steps: efficiency {c['efficiency_mean']:.4f} "
                  f"({c['efficiency_se']:.4f}) min {c['efficiency_min']:.4f}, bound "
                  f"{c['balance_bound_mean']:.4f} (gap {c['gap_mean']:.4f}, "
                  f"{c['within_001']:.0%} within 0.01), peaks {c['peak_sum']:.1f}, cuts "
                  f"{c['cuts_per_step']:.1f}, split {c['split_ms_median']:.2f} ms, step "
                  f"{c['step_ms_median']:.2f} ms", flush=True)  # fmt: skip
        load = [load_before, os.getloadavg()[0]]
        print(f"load average (1 min): {load[0]:.2f} before, {load[1]:.2f} after")
        print("RESULT " + json.dumps({"benchmark": "dealing", "mix": args.mix, "load_average":
                                      load, "consecutive": found}, sort_keys=True))  # fmt: skip
        return 0
    steps = args.steps or (3 if args.quick else 6)
    load_before = os.getloadavg()[0]
    print(f"dealing per global batch, mix {args.mix}, seq_len {SEQ_LEN}, CPU ms, best of "
          f"{args.runs} runs, median over {steps} steps")  # fmt: skip
    print(f"{'point':>18} {'docs/grp':>8} {'micro':>5} {'fill':>5} {'step':>7} {'max':>7} "
          f"{'draw':>6} {'split':>6} {'recipes':>7} {'rest':>6} {'eff mean':>8} {'min':>6} "
          f"{'bound':>6} {'cuts':>6}")  # fmt: skip
    rows = []
    for dp, docs in points:
        r = measure(dp, docs, args.mix, steps, args.runs)
        rows.append(r)
        print(f"{r['key']:>18} {r['documents_per_group']:>8.1f} {r['micro_batches']:>5} "
              f"{r['fill']:>5.2f} {r['step_ms']:>7.2f} {r['step_ms_max']:>7.2f} "
              f"{r['draw_ms']:>6.2f} {r['split_ms']:>6.2f} {r['recipes_ms']:>7.2f} "
              f"{r['rest_ms']:>6.2f} {r['efficiency_mean']:>8.4f} {r['efficiency_min']:>6.4f} "
              f"{r['bound_mean'] or float('nan'):>6.3f} {r['cuts_per_step']:>6.0f}",
              flush=True)  # fmt: skip
    load_after = os.getloadavg()[0]
    print(f"load average (1 min): {load_before:.2f} before, {load_after:.2f} after")
    result = {
        "benchmark": "dealing",
        "mix": args.mix,
        "quick": args.quick,
        "load_average": [load_before, load_after],
        "planning_ms": {r["key"]: r["step_ms"] for r in rows},
        "points": rows,
    }
    print("RESULT " + json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())

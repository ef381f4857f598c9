"""Balance on the head to head's real steps: efficiency against each step's bound, cuts and
dealing time, per DP size and number of cut rounds.

    python benchmarks/real_balance.py [--dp 8,16,32] [--steps 150] [--cut-rounds 8,12]
                                      [--together 8] [--quick]

``dealing.py``'s synthetic ``h2h`` mix is easier than the real corpus (0.988 against
0.958 after the polish, 2026-12-02), so balance work is judged here. The steps are those of
``head_to_head.py``'s plan: its real corpus (``support/realcorpus.py``), Tekken, one 8192-token
micro-batch per rank, the mix 0.6 / 0.3 / 0.1 by documents, and the cost that ``head_to_head``
fitted on this machine's real compute (its calibration file, when a run left one under
``--root``; else the figures fitted on 2026-12-02, said so in the output). The data plane runs
inline (:class:`~omniload_dask.testing.InlineDataPlane`, no cluster, no batches built) and the
drawn steps are kept. Each setting of ``refine.SMALL_CUT_ROUNDS`` then deals the same steps
again, so every setting weighs the same documents::

    drawn steps (the first WARMUP dropped) -> StepDealer.deal per setting -> per step:
        efficiency = mean / max of the DP groups' costs
        bound      = head_to_head.balance_bound over the final pieces (what any assignment
                     of these pieces could reach under the token limits)
        cuts       = documents continued in another micro-batch

Dealing time is the CPU time of dealing all kept steps, the best of ``--runs``; on a busy
host read it as a ratio between settings. ``--together K`` (default 8) also deals the steps K
at a time, as the scheduler plugin's dealing thread does (``StepDealer.deal_steps``: pass 3
of K steps side by side), in alternation with one by one, and checks that every step gets the
same split and recipes bit for bit (``same_splits_together``). Ends with ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

WARMUP = 5  # first steps dropped: the mix's first draws and the sources' first reads
FITTED_COST = {"linear": 4.9238824879504564e-05, "quadratic": 4.9411456827808705e-08}


def fitted_cost(root: Path, seq_len: int) -> tuple[dict[str, float], str]:
    """The cost head_to_head fitted on this machine (its calibration file), or the one fitted on 2026-12-02."""
    import torch

    saved = root / f"calibration-{seq_len}-torch{torch.__version__}.json"
    if not saved.exists():
        return FITTED_COST, "the cost fitted on 2026-12-02 (no calibration file under --root)"
    from support.realcompute import StepTimer

    timer = StepTimer()
    timer.load(json.loads(saved.read_text()))
    linear, quadratic = timer.fit()
    return {"linear": linear, "quadratic": quadratic}, f"fitted from {saved.name}"


def drawn_steps(plan: Any, steps: int) -> list[Any]:
    """The inline data plane's drawn steps (``DrawnStep``), in order."""
    from omniload_dask.testing import InlineDataPlane

    plane = InlineDataPlane(plan, build=False)
    dealer = plane.coord.components.dealer
    kept: list[Any] = []
    deal_step = dealer.deal

    def keep(drawn: Any) -> Any:
        kept.append(drawn)
        return deal_step(drawn)

    dealer.deal = keep  # type: ignore[method-assign]
    plane.draw(steps + WARMUP)
    return kept[WARMUP : WARMUP + steps]


def weigh(
    plan: Any, drawn: list[Any], cut_rounds: int, runs: int, together: int = 0
) -> dict[str, Any]:
    """Plan ``drawn`` again with ``cut_rounds`` rounds of cuts (up to 64 groups); with
    ``together``, also ``together`` steps at a time (``StepDealer.deal_steps``, as the
    scheduler plugin's dealing thread does), timed in alternation with one by one, and
    checked to give every step the same split and recipes."""
    from dealing import balance_figures

    from omniload_dask.batching.balance import refine
    from omniload_dask.core.dealer import StepDealer

    kept = refine.SMALL_CUT_ROUNDS
    refine.SMALL_CUT_ROUNDS = cut_rounds
    try:
        dealer = StepDealer(plan)
        best = best_together = float("inf")
        dealt: list[Any] = []
        grouped: list[Any] = []
        for _ in range(runs):
            t0 = time.thread_time()
            dealt = [dealer.deal(d) for d in drawn]
            best = min(best, time.thread_time() - t0)
            if together:
                t0 = time.thread_time()
                grouped = []
                for i in range(0, len(drawn), together):
                    grouped += dealer.deal_steps(drawn[i : i + together])
                best_together = min(best_together, time.thread_time() - t0)
    finally:
        refine.SMALL_CUT_ROUNDS = kept
    figures = {k: round(v, 4) for k, v in balance_figures([p.split for p in dealt]).items()}
    out = {
        "cut_rounds": cut_rounds,
        **figures,
        "plan_ms_per_step": round(best / len(drawn) * 1e3, 2),
    }
    if together:
        out["together"] = together
        out["plan_ms_per_step_together"] = round(best_together / len(drawn) * 1e3, 2)
        out["ratio_plan_time_together"] = round(best_together / best, 3)
        out["same_splits_together"] = all(_same(a, b) for a, b in zip(dealt, grouped, strict=True))
    return out


def _same(a: Any, b: Any) -> bool:
    """Whether two dealt steps have the same split and recipes, bit for bit."""
    import numpy as np

    fields = ("doc", "start", "length", "cost", "group", "micro", "micro_capacity")
    if a.split.cuts != b.split.cuts or a.split.bound != b.split.bound:
        return False
    if not all(np.array_equal(getattr(a.split, f), getattr(b.split, f)) for f in fields):
        return False
    ra, rb = vars(a.recipes), vars(b.recipes)
    return ra.keys() == rb.keys() and all(
        np.array_equal(ra[k], rb[k]) if isinstance(ra[k], np.ndarray) else ra[k] == rb[k]
        for k in ra
    )


def _numbers(parser: argparse.ArgumentParser, name: str, value: str) -> list[int]:
    """A comma-separated list of whole numbers, or a usage error naming the option."""
    try:
        return [int(x) for x in value.split(",")]
    except ValueError:
        parser.error(f"{name}: comma-separated whole numbers, got {value!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dp", default="8,16,32", help="DP sizes, comma-separated")
    parser.add_argument("--steps", type=int, default=150, help="steps weighed per DP size")
    parser.add_argument("--cut-rounds", default="8,12", help="settings of SMALL_CUT_ROUNDS")
    parser.add_argument("--runs", type=int, default=3, help="dealing runs per setting (best)")
    parser.add_argument(
        "--together", type=int, default=8,
        help="also deal this many steps at a time (0: not), as the dealing thread does",
    )  # fmt: skip
    parser.add_argument("--corpus-mb", type=float, default=80)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--root", help="cache folder, head_to_head's (default: under temp)")
    parser.add_argument("--quick", action="store_true", help="DP 8 only, 60 steps, one run")
    args = parser.parse_args()
    if args.quick:
        args.dp, args.steps, args.runs = "8", 60, 1
    dps, settings = (
        _numbers(parser, "--dp", args.dp),
        _numbers(parser, "--cut-rounds", args.cut_rounds),
    )
    if args.steps < 1 or args.runs < 1 or min(dps) < 1 or min(settings) < 0 or args.together < 0:
        parser.error("--steps, --runs and --dp take numbers >= 1, --cut-rounds and --together >= 0")
    root = Path(args.root) if args.root else Path(tempfile.gettempdir()) / "omniload-h2h-real"
    from head_to_head import MIX3, make_plan
    from support.realcorpus import build_corpus, find_tokenizers

    from omniload_dask.plan import parse_plan

    corpus = build_corpus(root / "corpus", args.corpus_mb, files=32)
    tokenizers = find_tokenizers(root / "tokenizers")
    if "tekken" not in tokenizers:
        raise SystemExit("the Tekken tokenizer was not found: run benchmarks/setup-thirdparty.sh")
    cost, origin = fitted_cost(root, args.seq_len)
    print(f"cost {cost} ({origin})", flush=True)
    shape = argparse.Namespace(seq_len=args.seq_len, micro=1, workers=2, loader={})
    points = []
    for dp in dps:
        plan = parse_plan(make_plan(corpus, MIX3, tokenizers["tekken"], dp, shape, cost))
        t0 = time.monotonic()
        drawn = drawn_steps(plan, args.steps)
        print(f"DP {dp}: {len(drawn)} steps drawn in {time.monotonic() - t0:.0f} s", flush=True)
        for rounds in settings:
            point = {
                "dp": dp,
                "steps": len(drawn),
                **weigh(plan, drawn, rounds, args.runs, args.together),
            }
            points.append(point)
            print(
                f"  cut rounds {rounds:2d}: efficiency {point['efficiency_mean']:.4f} "
                f"bound {point['balance_bound_mean']:.4f} gap {point['gap_mean']:.4f} "
                f"(within 0.01: {point['within_001']:.0%} of steps) "
                f"cuts {point['cuts_per_step']:.1f} a step, dealing "
                f"{point['plan_ms_per_step']:.2f} ms a step"
                + (
                    f"; {args.together} at a time {point['plan_ms_per_step_together']:.2f} ms a "
                    f"step ({point['ratio_plan_time_together']:.2f}x), same splits: "
                    f"{point['same_splits_together']}"
                    if args.together
                    else ""
                ),
                flush=True,
            )
    result = {"benchmark": "real_balance", "cost": cost, "cost_origin": origin, "points": points}
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()

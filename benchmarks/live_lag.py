"""How soon a live weight change reaches the trainer, and what bounding the lead costs.

    python benchmarks/live_lag.py [--quick] [--step-ms 100] [--lead 8]

A job on the demo data (real BPE tokenizer, embedded Dask cluster) serves ``dp`` trainer ranks,
fed by feeders in threads that each take one step every ``--step-ms`` milliseconds (an
emulated forward and backward). At trainer step ``CHANGE_AT`` the operator calls
``job.set_weights`` and the script measures the lag: in steps, from the step the trainer takes
next to the step the change takes effect at, and in seconds, from the call until every rank
has the first batch drawn under the change. Three ways, in one run::

    drawn     the plan as it is, the change at the first step not drawn (what set_weights
              did before it could draw steps again: at_step = stats()["next_step"])
    built     the plan as it is, the default: the first step not built
    lead      the plan with loader.live_lead = --lead, the default

and the cost of the lead: delivered tokens/s with ranks consuming as fast as they can, with and
without ``live_lead`` (same run, ratio). Ends with ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from omniload_dask import Job, parse_plan
from omniload_dask.demo import demo_sources, demo_tokenizer, make_demo_data

CHANGE_AT = 50
CHANGE = {"web": 0.1, "code": 0.6, "books": 0.3}


def plan_of(data: Path, dp: int, lead: int) -> dict:
    return {
        "version": 1,
        "name": f"live-{lead}",
        "seed": 1,
        "tokenizer": demo_tokenizer(data),
        "batch": {"seq_len": 2048, "micro_batches": 1},
        "layout": {"dp": dp},
        "on_error": "skip",
        "loader": {"workers": 2, "live_lead": lead},
        "sources": demo_sources(data, web_unit_bytes="1MiB"),
    }


def run_ranks(job: Job, dp: int, steps: int, step_s: float, on_step: object = None) -> dict:
    """Feed ``dp`` ranks for ``steps`` steps, each rank taking ``step_s`` per step; returns
    per rank the wall time each step's last micro-batch arrived, and the tokens delivered."""
    arrived = np.zeros((dp, steps))
    tokens = np.zeros(dp, dtype=np.int64)

    def rank(r: int) -> None:
        feeder = job.feeder(rank=r, max_steps=steps, output="numpy")
        for mb in feeder:
            tokens[r] += len(mb["input_ids"])
            if mb["micro_step"] == mb["num_micro_steps"] - 1:
                arrived[r, mb["step"]] = time.perf_counter()
                if r == 0 and callable(on_step):
                    on_step(mb["step"] + 1)
                if step_s:
                    time.sleep(step_s)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(dp)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"arrived": arrived, "tokens": int(tokens.sum()), "seconds": time.perf_counter() - t0}


def lag(data: Path, dp: int, lead: int, how: str, steps: int, step_s: float) -> dict:
    """One job: change the weights at trainer step CHANGE_AT; the lag in steps and seconds."""
    job = Job.start(parse_plan(plan_of(data, dp, lead)), dashboard_address=None)
    got: dict = {}

    def on_step(next_step: int) -> None:
        if next_step != CHANGE_AT:
            return
        stats = job.stats()  # where the stream is: drawn to, first step not built
        got["drawn"], got["built"] = stats["next_step"], stats["earliest_change"]
        got["asked"] = time.perf_counter()
        at = stats["next_step"] if how == "drawn" else None
        got["step"] = job.set_weights(CHANGE, at_step=at)

    try:
        out = run_ranks(job, dp, steps, step_s, on_step)
        stats = job.stats()
    finally:
        job.close()
    step = got["step"]
    seconds = float(out["arrived"][:, step].max() - got["asked"]) if step < steps else None
    return {
        "how": how,
        "lead": lead,
        "lag_steps": step - CHANGE_AT,
        "lag_seconds": seconds,
        "effective_step": step,
        "drawn_ahead": got["drawn"] - CHANGE_AT,  # the first step not drawn, when asked
        "built_ahead": got["built"] - CHANGE_AT,  # the first step a change could reach
        "drawn_ahead_at_end": stats["next_step"] - steps,
    }


def throughput(data: Path, dp: int, lead: int, steps: int) -> float:
    job = Job.start(parse_plan(plan_of(data, dp, lead)), dashboard_address=None)
    try:
        run_ranks(job, dp, 8, 0.0)  # warm: workers up, tokenizer loaded
        out = run_ranks_from(job, dp, 8, steps)
    finally:
        job.close()
    return out


def run_ranks_from(job: Job, dp: int, start: int, steps: int) -> float:
    """Tokens/s of ``dp`` ranks taking steps ``start`` to ``start + steps`` at full speed."""
    tokens = np.zeros(dp, dtype=np.int64)

    def rank(r: int) -> None:
        feeder = job.feeder(rank=r, start_step=start, max_steps=start + steps, output="numpy")
        for mb in feeder:
            tokens[r] += len(mb["input_ids"])

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(dp)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return float(tokens.sum() / (time.perf_counter() - t0))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--step-ms", type=float, default=100.0)
    parser.add_argument("--lead", type=int, default=8)
    args = parser.parse_args()
    steps = 90 if args.quick else 120
    fast_steps = 100 if args.quick else 300
    data = Path(tempfile.mkdtemp(prefix="omniload-live-"))
    make_demo_data(data)
    step_s = args.step_ms / 1e3
    rows = [
        lag(data, args.dp, 0, "drawn", steps, step_s),
        lag(data, args.dp, 0, "built", steps, step_s),
        lag(data, args.dp, args.lead, "built", steps, step_s),
    ]
    for r in rows:
        secs = "-" if r["lag_seconds"] is None else f"{r['lag_seconds']:.3f} s"
        print(
            f"change at {r['how']:<6} live_lead {r['lead']:>3}: lag {r['lag_steps']:>3} steps, "
            f"{secs} (takes effect at step {r['effective_step']}; when asked, drawn "
            f"{r['drawn_ahead']} and built-or-reachable {r['built_ahead']} steps ahead)"
        )
    free = throughput(data, args.dp, 0, fast_steps)
    bounded = throughput(data, args.dp, args.lead, fast_steps)
    print(
        f"tokens/s, ranks at full speed: no lead {free:,.0f}; live_lead {args.lead}: "
        f"{bounded:,.0f} (x{bounded / free:.3f})"
    )
    result = {
        "dp": args.dp,
        "step_ms": args.step_ms,
        "live_lead": args.lead,
        "lag_steps_drawn": rows[0]["lag_steps"],
        "lag_seconds_drawn": rows[0]["lag_seconds"],
        "lag_steps_built": rows[1]["lag_steps"],
        "lag_seconds_built": rows[1]["lag_seconds"],
        "lag_steps_lead": rows[2]["lag_steps"],
        "lag_seconds_lead": rows[2]["lag_seconds"],
        "drawn_ahead_no_lead": rows[1]["drawn_ahead"],
        "earliest_change_ahead_no_lead": rows[1]["built_ahead"],
        "drawn_ahead_lead": rows[2]["drawn_ahead"],
        "earliest_change_ahead_lead": rows[2]["built_ahead"],
        "tokens_per_s_no_lead": round(free),
        "tokens_per_s_lead": round(bounded),
        "lead_tokens_per_s_ratio": round(bounded / free, 3),
    }
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

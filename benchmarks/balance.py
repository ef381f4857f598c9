"""Balance benchmark: how evenly global batches are split across DP ranks, at what cost.

A heavy-tailed mix of three synthetic sources (short web-like documents, code-like files, 8k-64k
long documents; token weights 0.5 / 0.3 / 0.2) is drawn by the real mixer, one global batch per
step, and split by the data plane's own balancer (``balance.route`` + ``balance.balance``) for
DP = 8, 32 and 128: 4 micro-batches of 8192 tokens per rank, a global budget of
``dp * 4 * 8192`` tokens (the plan's default: full micro-batches), costs from the model
description of an 8B Llama-shaped transformer (``cost.transformer_coefficients``).

Per configuration it reports balance efficiency per step (mean/max of rank costs: mean and worst),
the simulated step time (the slowest rank's cost) against the paper's baseline, where every rank
draws and packs its own stream (first fit, in stream order, into the same micro-batches), and
against the perfect-balance bound (the mean rank cost), the padding a fixed-shape trainer would
add (1 - tokens / (ranks * micro-steps * seq_len)), documents cut to fill micro-batches, and the
dealing time per global batch. ``--compare`` adds LPT without the refinement pass.

Two further checks: the whole data-plane step (draw + balance + recipes, ``Coordinator``) timed
on real JSON Lines files at DP 128 through :class:`~omniload_dask.testing.InlineDataPlane`; and
balance judged by measured time (:func:`measured_balance`): the cost of a tiny transformer is
calibrated on this CPU (``omniload_dask.calibrate``), then every rank's step (forward + backward
of each of its micro-batches) is timed for the unbalanced per-rank packing and for the balancer
with the plan's default cost, the transformer formula and the calibrated cost, at dp 8 and 32
(``--measured-dp``), at a full budget and at 90 % of the capacity (``--measured-fill``).

    python benchmarks/balance.py --quick      # a few minutes; ends with one line RESULT {json}
    python benchmarks/balance.py --measured-only     # only the measured part
    python benchmarks/balance.py --measured-only --realtime   # timed on one core at real-time
                                                              # priority (root): a shared machine

The RESULT line has, for the first measured DP size and fill (dp 8, full budget):
``measured_efficiency_unbalanced``, ``_default_cost``, ``_model_cost``, ``_calibrated``,
``_identical_work`` (every rank timed on the same step: what timer noise leaves; the method
is sound when it reads close to 1), ``bound_calibrated_cost`` and ``calibration_error_pct``
(held-back micro-batches); every run's figures are under ``measured``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from omniload_dask.batching.balance import Bucket, balance, route, split_documents
from omniload_dask.batching.mixing import Mixer, NeedMore
from omniload_dask.plan.cost import CostModel, transformer_coefficients

SEQ_LEN = 8192
MICRO = 4
WEIGHTS = np.array([0.5, 0.3, 0.2])
MODEL_8B = {"hidden": 4096, "layers": 32, "heads": 32, "kv_heads": 8, "ffn": 14336,
            "vocab": 128256, "gated": True}  # fmt: skip
TINY = {"hidden": 64, "layers": 2, "heads": 4, "ffn": 256, "vocab": 256, "gated": True}
RC_SEQ, RC_MICRO = 2048, 2  # real compute: micro-batches of the tiny model on CPU


# ------------------------------------------------------------------ the synthetic mix
@dataclass
class Shape:
    """Length distributions of the three sources, scaled by ``scale``."""

    scale: float = 1.0

    def draw(self, rng: np.random.Generator, source: int, n: int) -> np.ndarray:
        s = self.scale
        if source == 0:  # web-like: median 400 tokens, heavy tail
            x = np.clip(rng.lognormal(np.log(400 * s), 1.0, n), 16, 16000 * s)
        elif source == 1:  # code-like files: median 1500 tokens, heavier tail
            x = np.clip(rng.lognormal(np.log(1500 * s), 1.2, n), 32, 60000 * s)
        else:  # long documents: 8k to 64k, log-uniform
            x = np.exp(rng.uniform(np.log(8192 * s), np.log(65536 * s), n))
        return np.maximum(x, 1).astype(np.int64)


class Stream:
    """Documents drawn by the real mixer from three endless sources of ``shape``.

    With ``split``, documents are cut into pieces of at most that many tokens first, so a
    rank's own stream continues a long document into its next step instead of waiting for a
    budget it never has.
    """

    def __init__(self, seed: int, shape: Shape, split: int | None = None) -> None:
        self.rng = np.random.default_rng(seed)
        self.shape = shape
        self.split = split
        self.mixer = Mixer(3, "tokens")
        self.queues = [np.zeros(0, np.int64) for _ in range(3)]

    def _more(self, source: int) -> np.ndarray:
        x = self.shape.draw(self.rng, source, 256)
        if self.split is None:
            return x
        doc, start = split_documents(x, self.split)
        return np.minimum(x[doc] - start, self.split)

    def next(self, budget: int) -> tuple[np.ndarray, np.ndarray]:
        """(lengths, sources) of the next global batch of at most ``budget`` tokens."""
        for s in range(3):
            want = 2 * budget * WEIGHTS[s] + 70000 * self.shape.scale
            while self.queues[s].sum() < want:
                self.queues[s] = np.concatenate([self.queues[s], self._more(s)])
        sel = self.mixer.select(WEIGHTS, self.queues, [True] * 3, budget_tokens=budget)
        if isinstance(sel, NeedMore):  # cannot happen: the queues hold two budgets' worth
            raise RuntimeError(f"the mixer wants more documents of sources {sel.sources}")
        self.mixer.commit(sel)
        src, idx = sel.order[:, 0], sel.order[:, 1]
        lengths = np.empty(len(src), dtype=np.int64)
        for s in range(3):
            mine = src == s
            lengths[mine] = self.queues[s][idx[mine]]
            self.queues[s] = self.queues[s][sel.counts[s] :]
        return lengths, src


def baseline_costs(
    streams: list[Stream], micro: int, seq_len: int, cost: CostModel, fill: float = 1.0
) -> tuple[np.ndarray, list[np.ndarray]]:
    """Per rank: its own stream's next ``fill * micro * seq_len`` tokens (documents split at
    ``seq_len``), packed first fit in stream order; a piece that fits nowhere is cut to fill."""
    out, pieces_of_rank = [], []
    for stream in streams:
        lengths, _ = stream.next(int(fill * micro * seq_len))
        room = [seq_len] * micro
        pieces: list[int] = []
        for n in lengths.tolist():
            while n > 0:
                piece = min(n, seq_len)
                n -= piece
                for m in range(micro):
                    if room[m] >= piece:
                        room[m] -= piece
                        pieces.append(piece)
                        break
                else:  # cut to fill, like the balancer
                    for m in sorted(range(micro), key=lambda k: -room[k]):
                        take = min(piece, room[m])
                        if take:
                            room[m] -= take
                            pieces.append(take)
                            piece -= take
        arr = np.asarray(pieces, dtype=np.int64)
        pieces_of_rank.append(arr)
        out.append(float(cost(arr).sum()))
    return np.asarray(out), pieces_of_rank


# ------------------------------------------------------------------ simulation
def simulate(
    dp: int, steps: int, cost: CostModel, seed: int, refine: bool = True, fill: float = 1.0
) -> dict[str, Any]:
    """Balanced split vs per-rank packing for ``steps`` global batches at DP ``dp``.

    The budget is ``fill`` times the capacity (``dp * MICRO * SEQ_LEN``), for both.
    """
    budget = int(fill * dp * MICRO * SEQ_LEN)
    buckets = [Bucket(SEQ_LEN, MICRO)]
    stream = Stream(seed, Shape())
    ranks = [Stream(seed * 1000 + 17 + r, Shape(), split=SEQ_LEN) for r in range(dp)]
    rows: dict[str, list[float]] = {k: [] for k in (
        "eff", "step", "bound", "base_eff", "base_step", "base_tokens", "tokens", "padding",
        "cuts", "ms", "cpu_ms", "docs", "micro_eff", "underfill")}  # fmt: skip
    for _ in range(steps):
        lengths, src = stream.next(budget)
        t0, c0 = time.perf_counter(), time.process_time()
        bucket, by_length = route(lengths, src, buckets)
        plan = balance(lengths, bucket, buckets, dp, cost, by_length=by_length, refine=refine)
        rows["ms"].append((time.perf_counter() - t0) * 1e3)
        rows["cpu_ms"].append((time.process_time() - c0) * 1e3)
        costs = plan.group_costs
        rows["eff"].append(plan.efficiency)
        rows["step"].append(float(costs.max()))
        rows["bound"].append(float(costs.mean()))
        rows["tokens"].append(float(lengths.sum()))
        rows["padding"].append(1 - lengths.sum() / (dp * plan.num_micro_steps * SEQ_LEN))
        rows["underfill"].append(1 - lengths.sum() / (dp * MICRO * SEQ_LEN))
        rows["cuts"].append(plan.cuts)
        rows["docs"].append(len(lengths))
        micro = plan.micro_costs
        rows["micro_eff"].append(float((micro.mean(axis=1) / micro.max(axis=1)).mean()))
        base, pieces = baseline_costs(ranks, MICRO, SEQ_LEN, cost, fill)
        rows["base_eff"].append(float(base.mean() / base.max()))
        rows["base_step"].append(float(base.max()))
        rows["base_tokens"].append(float(sum(p.sum() for p in pieces)))
    r = {k: np.asarray(v) for k, v in rows.items()}
    per_token = r["step"].sum() / r["tokens"].sum()
    base_per_token = r["base_step"].sum() / r["base_tokens"].sum()
    return {
        "dp": dp,
        "budget_fill": fill,
        "steps": steps,
        "documents_per_step": float(r["docs"].mean()),
        "efficiency_mean": float(r["eff"].mean()),
        "efficiency_worst": float(r["eff"].min()),
        "step_time_vs_bound": float(r["step"].sum() / r["bound"].sum()),
        "baseline_efficiency_mean": float(r["base_eff"].mean()),
        "baseline_efficiency_worst": float(r["base_eff"].min()),
        "speedup_vs_baseline": float(base_per_token / per_token),
        "padding_fraction": float(r["padding"].mean()),
        "budget_underfill": float(r["underfill"].mean()),
        "cuts_per_step": float(r["cuts"].mean()),
        "micro_batch_efficiency": float(r["micro_eff"].mean()),
        "planning_ms_median": float(np.median(r["ms"])),
        "planning_ms_p95": float(np.percentile(r["ms"], 95)),
        "planning_ms_min": float(r["ms"].min()),
        "planning_cpu_ms_median": float(np.median(r["cpu_ms"])),
    }


# ------------------------------------------------------------------ the whole data-plane step
def write_source(folder: Path, name: str, lengths: np.ndarray, rng: np.random.Generator) -> None:
    """JSON Lines whose byte-tokenized documents have exactly ``lengths`` tokens (BOS + EOS)."""
    folder.mkdir(parents=True)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz ", dtype=np.uint8)
    pool = letters[rng.integers(0, len(letters), int(lengths.max()) + 1)].tobytes().decode()
    per_file = max(1, len(lengths) // 4)
    for f, lo in enumerate(range(0, len(lengths), per_file)):
        with open(folder / f"{name}-{f:03d}.jsonl", "w") as out:
            for i, n in enumerate(lengths[lo : lo + per_file].tolist()):
                text = pool[i % 7 : i % 7 + max(0, n - 2)]
                out.write(json.dumps({"text": text}) + "\n")


PHASES = ("draw_step", "deal_steps", "commit_step")


def coordinator_timing(dp: int, steps: int, seed: int) -> dict[str, Any]:
    """The data plane's own per-step dealing (draw, balance, recipes) on real files."""
    from omniload_dask.core.coordinator import Coordinator
    from omniload_dask.plan import parse_plan
    from omniload_dask.testing import InlineDataPlane

    budget = dp * MICRO * SEQ_LEN
    rng = np.random.default_rng(seed)
    shape = Shape()
    with tempfile.TemporaryDirectory() as tmp:
        sources = []
        for s, name in enumerate(("web", "code", "long")):
            total = WEIGHTS[s] * budget * (steps + 4)
            lengths = shape.draw(rng, s, 64)
            while lengths.sum() < total:
                lengths = np.concatenate([lengths, shape.draw(rng, s, 1024)])
            write_source(Path(tmp) / name, name, lengths, rng)
            sources.append({"name": name, "format": "jsonl", "path": f"{tmp}/{name}/*.jsonl",
                            "weight": float(WEIGHTS[s]), "unit_bytes": "8MiB"})  # fmt: skip
        plan = parse_plan({
            "name": "bench", "seed": seed, "tokenizer": {"kind": "byte"},
            "batch": {"seq_len": SEQ_LEN, "micro_batches": MICRO},
            "layout": {"dp": dp}, "cost": {"model": MODEL_8B}, "sources": sources,
            "loader": {"lookahead": 0, "prefetch": 1},
        })  # fmt: skip
        plane = InlineDataPlane(plan)
        times: list[float] = []
        cpu: list[float] = []
        # One drawn step is its three phases (see core/stepping.py): timed together, from a
        # draw that drew a step to its commit.
        phases = {name: getattr(Coordinator, name) for name in PHASES}
        spent = [0.0, 0.0]

        def timed(name: str) -> Any:
            fn = phases[name]

            def run(self: Coordinator, *args: Any) -> Any:
                t0, c0 = time.perf_counter(), time.process_time()
                out = fn(self, *args)
                spent[0] += time.perf_counter() - t0
                spent[1] += time.process_time() - c0
                if name == "draw_step" and out is None:
                    spent[:] = [0.0, 0.0]  # nothing drawn: not a step's time
                elif name == "commit_step":
                    times.append(spent[0] * 1e3)
                    cpu.append(spent[1] * 1e3)
                    spent[:] = [0.0, 0.0]
                return out

            return run

        for name in PHASES:
            setattr(Coordinator, name, timed(name))
        try:
            effs = []
            for t in range(steps):
                plane.step(t)
                effs.append(plane.coord.view.history[-1].efficiency)
        finally:
            for name, fn in phases.items():
                setattr(Coordinator, name, fn)
        stats = plane.coord.view.stats()
    return {
        "dp": dp,
        "steps": len(times),
        "documents_per_step": stats["documents"] / max(1, stats["steps_drawn"]),
        "step_ms_median": float(np.median(times)),
        "step_ms_min": float(np.min(times)),
        "step_cpu_ms_median": float(np.median(cpu)),
        "efficiency_mean": float(np.mean(effs)),
    }


# ------------------------------------------------------------------ real compute
@dataclass(frozen=True)
class RealCompute:
    """What the measured part runs: a described model, micro-batches, device and threads."""

    model: dict[str, Any]
    seq_len: int = RC_SEQ
    micro: int = RC_MICRO
    device: str = "cpu"
    threads: int = 1


def measured_balance(
    setup: RealCompute,
    dps: list[int],
    steps: int,
    seed: int,
    fills: list[float],
    repeats: int = 3,
    quick: bool = False,
    max_repeats: int = 24,
    tolerance: float = 0.015,
    formula: bool = True,
    save_timings: str | None = None,
) -> dict[str, Any]:
    """Balance judged by measured time: forward + backward of ``setup.model`` over every
    rank's step.

    The cost is first calibrated on the device (:func:`omniload_dask.calibrate.calibrate`,
    micro-batches of up to ``setup.seq_len`` tokens). Then, per step, one global batch of the
    mix scaled to that length (at RC_SEQ = 2048: web ~100, code ~375, long 2k-16k tokens; a
    budget of ``fill`` times the capacity, for every fill of ``fills``) is split four ways:
    each rank packing its own stream (unbalanced), and the balancer with the plan's default
    cost, with the transformer formula of the model, and with the calibrated cost; a fifth
    variant gives every rank the same step (the calibrated plan's first rank), so its measured
    efficiency is what timer noise alone leaves. The unit of timing is one micro-batch
    (forward + backward; on CPU with one thread as the thread's CPU time, on CUDA with
    events), every micro-batch of every rank of every variant its own unit, all interleaved
    in a shuffled order; a micro-batch's figure is its time at the machine's best speed,
    fitted from its timings and the machine's speed around each (:mod:`omniload_dask.
    calibrate.steady`), from at least ``repeats`` and at most ``max_repeats`` timings, until
    its standard error is within ``tolerance``; a rank's step is the sum of its
    micro-batches' figures, as a trainer runs them one after another. Beside the measured
    figures: the efficiency the calibrated model predicts for each variant, the balancer's
    own (modelled) efficiency, and an upper bound on any split of the step's pieces
    under the calibrated cost (``stepcompute.efficiency_bound``). Without ``formula``, the
    transformer formula's variant is left out (a fifth less to time). ``save_timings``: a
    folder that gets every timing of every step (``timings-<dp>-<step>.npz``: the unit, the
    seconds in the order taken, and which variant, rank and micro-batch each unit is).
    """
    from omniload_dask.calibrate import StepTimer, calibrate, load_model
    from omniload_dask.plan import CostSpec

    t0 = time.time()
    print(f"  calibrating on {setup.device} ...", file=sys.stderr, flush=True)
    cal = calibrate(setup.model, seq_len=setup.seq_len, device=setup.device,
                    threads=setup.threads, repeats=3 if quick else 5,
                    random=12 if quick else 24, held_back_count=12 if quick else 24,
                    seed=seed)  # fmt: skip
    costs = {
        "default_cost": CostModel.from_spec(CostSpec()),
        "model_cost": CostModel(*transformer_coefficients(**setup.model)),
        "calibrated": cal.cost_model(),
    }
    print(f"  calibrated in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    if not formula:
        del costs["model_cost"]
    net, about = load_model(setup.model, setup.device)
    timer = StepTimer(net, setup.device, vocab=setup.model.get("vocab") or 256,
                      threads=setup.threads, seed=seed)  # fmt: skip
    out: dict[str, Any] = {
        "model": setup.model,
        "attention": about["attention"],
        "device": cal.device,
        "device_name": cal.device_name,
        "clock": timer.clock,
        "seq_len": setup.seq_len,
        "micro_batches": setup.micro,
        "repeats": repeats,
        "max_repeats": max_repeats,
        "tolerance": tolerance,
        "calibration": {
            "cost": cal.cost_block(),
            "micro_batch_us": cal.micro_batch_seconds * 1e6,
            "fit_error_pct": 100 * cal.fit.mean_abs_rel_error,
            "held_back": cal.check.to_dict() if cal.check else None,
            "timer_noise_pct": 100 * cal.noise if cal.noise is not None else None,
            "timing": cal.timing,
            "seconds": round(time.time() - t0, 1),
        },
        "by_dp": {},
    }
    for dp in dps:
        for fill in fills:
            n = steps if dp <= 8 else max(1, steps // 2)
            row = _measured_steps(
                setup, dp, fill, n, seed, costs, cal.fit.coefficients, timer,
                (repeats, max_repeats, tolerance), cal.micro_batch_seconds, save_timings,
            )  # fmt: skip
            out["by_dp"][run_key(dp, fill)] = row
            eff = row["measured_efficiency"]
            print(f"  measured {run_key(dp, fill)}: " + ", ".join(f"{k} {v:.4f}" for k, v in
                  eff.items()) + f" (complete {row['timing']['complete_share']:.3f}, load "
                  f"average {os.getloadavg()[0]:.1f})", file=sys.stderr)  # fmt: skip
    out["seconds"] = round(time.time() - t0, 1)
    return out


def isolate(priority: int = 50) -> str:
    """Run this process on the last CPU it may use at real-time priority ``priority``
    (SCHED_FIFO), so that other processes of a shared machine do not preempt its timings
    there; what it got, in words (the normal scheduling where the system refuses).

    The kernel still keeps 5 % of each second for other processes (``sched_rt_runtime_us``),
    and the other CPUs' work still shares caches and memory bandwidth.
    """
    cpu = max(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(priority))
    except (PermissionError, OSError) as exc:
        print(f"--realtime: real-time priority refused ({exc}); timing at normal priority",
              file=sys.stderr)  # fmt: skip
        return f"normal, pinned to cpu {cpu}"
    return f"SCHED_FIFO {priority}, pinned to cpu {cpu}"


def run_key(dp: int, fill: float) -> str:
    """``"8"`` at a full budget, ``"8@0.9"`` at 90 % of the capacity."""
    return str(dp) if fill == 1.0 else f"{dp}@{fill:g}"


def _measured_steps(
    setup: RealCompute,
    dp: int,
    fill: float,
    steps: int,
    seed: int,
    costs: dict[str, CostModel],
    coef: np.ndarray,
    timer: Any,
    repeats: tuple[int, int, float],
    micro_batch_seconds: float,
    save_timings: str | None = None,
) -> dict[str, Any]:
    """``steps`` steps of :func:`measured_balance` at one DP size and budget fill."""
    from support.stepcompute import (
        baseline_micro_batches,
        efficiency,
        efficiency_bound,
        measure,
        predict,
        rank_micro_batches,
    )

    seq, micro = setup.seq_len, setup.micro
    shape = Shape(scale=seq / SEQ_LEN)
    stream = Stream(seed, shape)
    ranks = [Stream(seed * 1000 + 7 + r, shape, split=seq) for r in range(dp)]
    buckets = [Bucket(seq, micro)]
    names = ["unbalanced", *costs, "identical"]
    measured: dict[str, list[float]] = {k: [] for k in names}
    step_seconds: dict[str, list[float]] = {k: [] for k in names}
    modelled: dict[str, list[float]] = {k: [] for k in names}
    balancer: dict[str, list[float]] = {k: [] for k in costs}
    bounds: list[float] = []
    timing = {"units": 0, "timings": 0, "counted": 0.0, "confirmed": 0.0, "complete": 0.0}
    errors: list[np.ndarray] = []
    slowest = 1.0
    for step in range(steps):
        lengths, src = stream.next(int(fill * dp * micro * seq))
        bucket, by_length = route(lengths, src, buckets)
        own = [r.next(int(fill * micro * seq))[0] for r in ranks]
        variants = {"unbalanced": baseline_micro_batches(own, micro, seq)}
        for name, cost in costs.items():
            plan = balance(lengths, bucket, buckets, dp, cost, by_length=by_length)
            variants[name] = rank_micro_batches(plan)
            balancer[name].append(plan.efficiency)
            if name == "calibrated":
                fixed = micro * micro_batch_seconds * 1e6  # the cost's unit: microseconds
                bounds.append(efficiency_bound(plan, cost, micro * seq, fixed))
        variants["identical"] = [variants["calibrated"][0]] * dp
        seconds, settled = measure(timer, list(variants.values()), keep=repeats[0],
                                   max_repeats=repeats[1], tolerance=repeats[2])  # fmt: skip
        timing["units"] += len(settled.seconds)
        timing["timings"] += int(settled.timings.sum())
        timing["counted"] += settled.counted_share * settled.timings.sum()
        timing["confirmed"] += float(settled.confirmed.sum())
        timing["complete"] += float(settled.complete.sum())
        errors.append(settled.error)
        if save_timings:
            labels = [f"{name} {r} {m} {mb.tokens} {len(mb.pieces)}"
                      for name, ranks_ in variants.items() for r, rank in enumerate(ranks_)
                      for m, mb in enumerate(rank)]  # fmt: skip
            Path(save_timings).mkdir(parents=True, exist_ok=True)
            np.savez(Path(save_timings) / f"timings-{run_key(dp, fill)}-{step}.npz",
                     unit=settled.log_unit, seconds=settled.log_seconds,
                     label=np.asarray(labels))  # fmt: skip
        slowest = max(slowest, settled.slowest_state)
        for name, rank_seconds in zip(variants, seconds, strict=True):
            measured[name].append(efficiency(rank_seconds))
            step_seconds[name].append(float(rank_seconds.max()))
            modelled[name].append(efficiency(predict(coef, variants[name])))
    return {
        "dp": dp,
        "budget_fill": fill,
        "steps": steps,
        "measured_efficiency": {k: float(np.mean(v)) for k, v in measured.items()},
        "measured_efficiency_worst": {k: float(np.min(v)) for k, v in measured.items()},
        "step_seconds": {k: float(np.mean(v)) for k, v in step_seconds.items()},
        "calibrated_model_efficiency": {k: float(np.mean(v)) for k, v in modelled.items()},
        "balancer_own_cost_efficiency": {k: float(np.mean(v)) for k, v in balancer.items()},
        "bound_calibrated_cost": float(np.mean(bounds)),
        "timing": {
            "micro_batches_timed": timing["units"],
            "timings": timing["timings"],
            "counted_share": round(timing["counted"] / max(1, timing["timings"]), 4),
            "confirmed_share": round(timing["confirmed"] / max(1, timing["units"]), 4),
            "complete_share": round(timing["complete"] / max(1, timing["units"]), 4),
            "median_error_pct": round(100 * float(np.median(np.concatenate(errors))), 3),
            "slowest_state": round(slowest, 3),
        },
    }


def print_measured(rc: dict[str, Any]) -> None:
    """The measured part as a small table."""
    cal = rc["calibration"]
    block, held = cal["cost"], cal["held_back"]
    print(f"calibrated cost on {rc['device']} ({rc['device_name']}; {cal['seconds']:.0f} s): "
          f"{block['piece']:.4g} us/piece + {block['linear']:.4g} us/token + "
          f"{block['quadratic']:.4g} us/token^2 (+ {cal['micro_batch_us']:.4g} us/micro-batch); "
          f"held back: mean |error| {held['mean_abs_rel_error_pct']:.2f} %, max "
          f"{held['max_abs_rel_error_pct']:.2f} %, rank correlation {held['rank_correlation']:.4f}"
          f"; timer noise {cal['timer_noise_pct']:.2f} %")  # fmt: skip
    print(
        f"measured step-time efficiency (mean/max of rank fwd+bwd, {rc['clock']}; each "
        f"micro-batch's time at the machine's best speed from {rc['repeats']}-"
        f"{rc['max_repeats']} timings, to {100 * rc['tolerance']:g} %), seq_len "
        f"{rc['seq_len']} x {rc['micro_batches']} micro-batches:"
    )
    print(f"{'dp':>6} {'steps':>5} {'variant':>13} {'measured':>9} {'worst':>7} "
          f"{'step s':>8} {'calibrated model':>17} {'own cost':>9}")  # fmt: skip
    for dp, row in rc["by_dp"].items():
        t = row["timing"]
        print(f"{dp:>6}: upper bound on any split under the calibrated cost "
              f"{row['bound_calibrated_cost']:.4f}; {t['timings']} timings of "
              f"{t['micro_batches_timed']} micro-batches ({t['counted_share']:.3f} of them "
              f"near the best speed, the slowest stretch {t['slowest_state']:.2f}x); "
              f"{t['confirmed_share']:.3f} confirmed, median standard error "
              f"{t['median_error_pct']:.2f} %")  # fmt: skip
        for name, value in row["measured_efficiency"].items():
            own = row["balancer_own_cost_efficiency"].get(name)
            print(f"{dp:>6} {row['steps']:>5} {name:>13} {value:>9.4f} "
                  f"{row['measured_efficiency_worst'][name]:>7.4f} "
                  f"{row['step_seconds'][name]:>8.3f} "
                  f"{row['calibrated_model_efficiency'][name]:>17.4f} "
                  f"{'' if own is None else f'{own:.4f}':>9}")  # fmt: skip


# ------------------------------------------------------------------ main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps: under a minute")
    parser.add_argument("--steps", type=int, default=None, help="steps per DP size")
    parser.add_argument("--dp", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--compare", action="store_true", help="also LPT without refinement")
    parser.add_argument("--no-torch", action="store_true", help="skip the measured part")
    parser.add_argument("--measured-only", action="store_true", help="only the measured part")
    parser.add_argument("--measured-dp", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--measured-steps", type=int, help="steps at dp 8 (half as many above)")
    parser.add_argument(
        "--measured-fill",
        type=float,
        nargs="+",
        default=[1.0, 0.9],
        help="budgets of the measured part, as shares of the capacity",
    )
    parser.add_argument("--repeats", type=int, default=6, help="timings per micro-batch, at least")
    parser.add_argument(
        "--max-repeats",
        type=int,
        default=24,
        help="timings per micro-batch, at most (until its standard error is within tolerance)",
    )
    parser.add_argument("--tolerance", type=float, default=0.015,
                        help="standard error of a micro-batch's time to reach")  # fmt: skip
    parser.add_argument(
        "--no-formula", action="store_true", help="measured part: leave out the formula's split"
    )
    parser.add_argument("--save-timings", help="measured part: a folder for every timing")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--realtime",
        action="store_true",
        help="time on one core at real-time priority (SCHED_FIFO; needs root or CAP_SYS_NICE)",
    )
    args = parser.parse_args()
    scheduling = isolate() if args.realtime else "normal"
    steps = args.steps or (6 if args.quick else 40)
    cost = CostModel(*transformer_coefficients(**MODEL_8B))  # type: ignore[arg-type]
    result: dict[str, Any] = {
        "seq_len": SEQ_LEN,
        "micro_batches": MICRO,
        "cost": {"model": MODEL_8B, "linear": cost.linear, "quadratic": cost.quadratic},
        "simulation": [],
    }
    print(f"balance benchmark: seq_len {SEQ_LEN}, {MICRO} micro-batches per rank, "
          f"budget dp x {MICRO * SEQ_LEN} tokens, 8B-shaped cost model")  # fmt: skip
    print(f"{'dp':>8} {'docs':>6} {'eff mean':>9} {'worst':>7} {'vs bound':>9} {'base eff':>9} "
          f"{'speedup':>8} {'padding':>8} {'underfill':>9} {'cuts':>6} {'micro eff':>9} "
          f"{'plan ms':>8} {'cpu ms':>7}")  # fmt: skip
    runs = [(dp, 1.0) for dp in args.dp] + ([] if args.quick else [(max(args.dp), 0.99)])
    for dp, fill in [] if args.measured_only else runs:
        r = simulate(dp, steps, cost, args.seed, fill=fill)
        result["simulation"].append(r)
        name = str(dp) if fill == 1.0 else f"{dp}@{fill:g}"
        print(f"{name:>8} {r['documents_per_step']:>6.0f} {r['efficiency_mean']:>9.4f} "
              f"{r['efficiency_worst']:>7.4f} {r['step_time_vs_bound']:>9.4f} "
              f"{r['baseline_efficiency_mean']:>9.4f} {r['speedup_vs_baseline']:>8.3f} "
              f"{r['padding_fraction']:>8.3%} {r['budget_underfill']:>9.3%} "
              f"{r['cuts_per_step']:>6.1f} {r['micro_batch_efficiency']:>9.4f} "
              f"{r['planning_ms_median']:>8.2f} {r['planning_cpu_ms_median']:>7.2f}")  # fmt: skip
    if args.compare and not args.measured_only:
        result["lpt_only"] = []
        print("LPT without the refinement pass:")
        for dp in args.dp:
            r = simulate(dp, steps, cost, args.seed, refine=False)
            result["lpt_only"].append(r)
            print(f"{dp:>8} eff mean {r['efficiency_mean']:.4f} worst {r['efficiency_worst']:.4f} "
                  f"plan ms {r['planning_ms_median']:.2f} cpu ms "
                  f"{r['planning_cpu_ms_median']:.2f}")  # fmt: skip
    if not args.measured_only:
        timing = coordinator_timing(128, 2 if args.quick else 5, args.seed)
        result["data_plane_step"] = timing
        print(f"data-plane step at dp {timing['dp']} on real files "
              f"({timing['documents_per_step']:.0f} documents): draw + balance + recipes "
              f"{timing['step_ms_median']:.2f} ms median ({timing['step_cpu_ms_median']:.2f} ms "
              f"CPU), {timing['step_ms_min']:.2f} ms min, efficiency "
              f"{timing['efficiency_mean']:.4f}")  # fmt: skip
    if not args.no_torch:
        rc = measured_balance(RealCompute(TINY), args.measured_dp,
                              args.measured_steps or (2 if args.quick else 4),
                              args.seed, args.measured_fill, repeats=args.repeats,
                              quick=args.quick, max_repeats=args.max_repeats,
                              tolerance=args.tolerance, formula=not args.no_formula,
                              save_timings=args.save_timings)  # fmt: skip
        result["measured"] = rc
        print_measured(rc)
        # The headline: the first DP size at the first budget fill (default dp 8, full budget).
        head = rc["by_dp"][run_key(args.measured_dp[0], args.measured_fill[0])]
        result["measured_at"] = {"dp": head["dp"], "budget_fill": head["budget_fill"]}
        for name, value in head["measured_efficiency"].items():
            result[f"measured_efficiency_{name.replace('identical', 'identical_work')}"] = value
        result["bound_calibrated_cost"] = head["bound_calibrated_cost"]
        result["measured_efficiency_calibrated_by_run"] = {
            k: r["measured_efficiency"]["calibrated"] for k, r in rc["by_dp"].items()
        }
        result["measured_efficiency_identical_work_by_run"] = {
            k: r["measured_efficiency"]["identical"] for k, r in rc["by_dp"].items()
        }
        held = rc["calibration"]["held_back"]
        result["calibration_error_pct"] = held["mean_abs_rel_error_pct"]
        result["calibration_rank_correlation"] = held["rank_correlation"]
    result["scheduling"] = scheduling
    result["load_average"] = os.getloadavg()[0]  # timings are wall clock on a shared machine
    print(f"load average during the run: {result['load_average']:.2f}")
    print("RESULT " + json.dumps(result, sort_keys=True))


if __name__ == "__main__":
    main()

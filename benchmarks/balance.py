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
planning time per global batch. ``--compare`` adds LPT without the refinement pass.

Two further checks: the whole data-plane step (draw + balance + recipes, ``Coordinator``) timed
on real JSON Lines files at DP 128 through :class:`~omniload_dask.testing.InlineDataPlane`; and
real compute: forward + backward of a tiny torch transformer on CPU over each rank's batch,
correlating the measured time with the modelled cost and fitting its coefficients.

    python benchmarks/balance.py --quick      # under a minute; ends with one line RESULT {json}
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
from omniload_dask.batching.cost import CostModel, transformer_coefficients
from omniload_dask.batching.mixing import Mixer, NeedMore

SEQ_LEN = 8192
MICRO = 4
WEIGHTS = np.array([0.5, 0.3, 0.2])
MODEL_8B = {"hidden": 4096, "layers": 32, "heads": 32, "kv_heads": 8, "ffn": 14336,
            "vocab": 128256, "gated": True}  # fmt: skip
TINY = {"hidden": 64, "layers": 2, "heads": 4, "ffn": 256, "vocab": 256, "gated": True}


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


def coordinator_timing(dp: int, steps: int, seed: int) -> dict[str, Any]:
    """The data plane's own per-step planning (draw, balance, recipes) on real files."""
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
        draw = Coordinator._draw

        def timed(self: Coordinator) -> bool:
            t0, c0 = time.perf_counter(), time.process_time()
            done = draw(self)
            if done:
                times.append((time.perf_counter() - t0) * 1e3)
                cpu.append((time.process_time() - c0) * 1e3)
            return done

        Coordinator._draw = timed  # type: ignore[method-assign]
        try:
            effs = []
            for t in range(steps):
                plane.step(t)
                effs.append(plane.coord.history[-1].efficiency)
        finally:
            Coordinator._draw = draw  # type: ignore[method-assign]
        stats = plane.coord.stats()
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
def real_compute(steps: int, dp: int, seed: int) -> dict[str, Any]:
    """Forward + backward of a tiny transformer (TINY) over each rank's pieces, on CPU.

    As in varlen training, the dense layers run on the packed tokens of a rank and attention
    runs per piece (causal). Time is the process's CPU time with one torch thread, the best of
    three runs, so other processes on a shared machine disturb it little.
    """
    import torch
    import torch.nn.functional as F

    torch.manual_seed(seed)
    torch.set_num_threads(1)
    h, heads, f, vocab = TINY["hidden"], TINY["heads"], TINY["ffn"], TINY["vocab"]

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.n1, self.n2 = torch.nn.LayerNorm(h), torch.nn.LayerNorm(h)
            self.qkv = torch.nn.Linear(h, 3 * h, bias=False)
            self.out = torch.nn.Linear(h, h, bias=False)
            self.w1, self.w3 = torch.nn.Linear(h, f, bias=False), torch.nn.Linear(h, f, bias=False)
            self.w2 = torch.nn.Linear(f, h, bias=False)

        def forward(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
            qkv = self.qkv(self.n1(x)).view(-1, 3, heads, h // heads)
            outs = []
            for part in qkv.split(sizes):  # attention within each piece only
                q, k, v = part.permute(1, 2, 0, 3).unsqueeze(1).unbind(0)
                outs.append(F.scaled_dot_product_attention(q, k, v, is_causal=True)[0])
            a = torch.cat(outs, dim=1).permute(1, 0, 2).reshape(-1, h)
            x = x + self.out(a)
            y = self.n2(x)
            return x + self.w2(F.silu(self.w1(y)) * self.w3(y))

    emb = torch.nn.Embedding(vocab, h)
    blocks = torch.nn.ModuleList([Block() for _ in range(TINY["layers"])])
    head = torch.nn.Linear(h, vocab, bias=False)

    def run(pieces: np.ndarray) -> float:
        sizes = pieces.tolist()
        ids = torch.randint(0, vocab, (int(pieces.sum()),))
        best = float("inf")
        for _ in range(3):
            t0 = time.process_time()
            x = emb(ids)
            for block in blocks:
                x = block(x, sizes)
            F.cross_entropy(head(x), ids).backward()
            best = min(best, time.process_time() - t0)
        return best

    seq, micro = 2048, 2
    cost = CostModel(*transformer_coefficients(**TINY))  # type: ignore[arg-type]
    shape = Shape(scale=0.25)  # web ~100, code ~375, long 2k-16k tokens
    stream = Stream(seed, shape)
    ranks = [Stream(seed * 1000 + 7 + r, shape, split=seq) for r in range(dp)]
    run(np.array([64, 256]))  # warm-up
    xs: list[tuple[float, float, int, float]] = []
    ys: list[float] = []
    effs: dict[str, list[float]] = {"balanced": [], "baseline": []}
    for _ in range(steps):
        lengths, src = stream.next(dp * micro * seq)
        buckets = [Bucket(seq, micro)]
        bucket, by_length = route(lengths, src, buckets)
        plan = balance(lengths, bucket, buckets, dp, cost, by_length=by_length)
        balanced = [plan.length[plan.group == g] for g in range(dp)]
        _, baseline = baseline_costs(ranks, micro, seq, cost)
        for name, per_rank in (("balanced", balanced), ("baseline", baseline)):
            measured = []
            for pieces in per_rank:
                seconds = run(pieces)
                measured.append(seconds)
                n = pieces.astype(np.float64)
                xs.append((n.sum(), (n * n).sum(), len(n), float(cost(pieces).sum())))
                ys.append(seconds)
            effs[name].append(float(np.mean(measured) / np.max(measured)))
    x, y = np.asarray(xs), np.asarray(ys)
    coef, *_ = np.linalg.lstsq(x[:, :3], y, rcond=None)
    fitted = x[:, :3] @ coef
    linear, quadratic = transformer_coefficients(**TINY)  # type: ignore[arg-type]
    return {
        "model": TINY,
        "ranks_measured": len(y),
        "correlation_modelled_cost_vs_time": float(np.corrcoef(x[:, 3], y)[0, 1]),
        "fit_seconds_per_token": float(coef[0]),
        "fit_seconds_per_token_squared": float(coef[1]),
        "fit_seconds_per_piece": float(coef[2]),
        "fit_r2": float(1 - ((y - fitted) ** 2).sum() / ((y - y.mean()) ** 2).sum()),
        "fitted_quadratic_over_linear": float(coef[1] / coef[0]),
        "modelled_quadratic_over_linear": quadratic / linear,
        "measured_efficiency_balanced": float(np.mean(effs["balanced"])),
        "measured_efficiency_baseline": float(np.mean(effs["baseline"])),
    }


# ------------------------------------------------------------------ main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps: under a minute")
    parser.add_argument("--steps", type=int, default=None, help="steps per DP size")
    parser.add_argument("--dp", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--compare", action="store_true", help="also LPT without refinement")
    parser.add_argument("--no-torch", action="store_true", help="skip the real-compute check")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
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
    for dp, fill in runs:
        r = simulate(dp, steps, cost, args.seed, fill=fill)
        result["simulation"].append(r)
        name = str(dp) if fill == 1.0 else f"{dp}@{fill:g}"
        print(f"{name:>8} {r['documents_per_step']:>6.0f} {r['efficiency_mean']:>9.4f} "
              f"{r['efficiency_worst']:>7.4f} {r['step_time_vs_bound']:>9.4f} "
              f"{r['baseline_efficiency_mean']:>9.4f} {r['speedup_vs_baseline']:>8.3f} "
              f"{r['padding_fraction']:>8.3%} {r['budget_underfill']:>9.3%} "
              f"{r['cuts_per_step']:>6.1f} {r['micro_batch_efficiency']:>9.4f} "
              f"{r['planning_ms_median']:>8.2f} {r['planning_cpu_ms_median']:>7.2f}")  # fmt: skip
    if args.compare:
        result["lpt_only"] = []
        print("LPT without the refinement pass:")
        for dp in args.dp:
            r = simulate(dp, steps, cost, args.seed, refine=False)
            result["lpt_only"].append(r)
            print(f"{dp:>8} eff mean {r['efficiency_mean']:.4f} worst {r['efficiency_worst']:.4f} "
                  f"plan ms {r['planning_ms_median']:.2f} cpu ms "
                  f"{r['planning_cpu_ms_median']:.2f}")  # fmt: skip
    timing = coordinator_timing(128, 2 if args.quick else 5, args.seed)
    result["data_plane_step"] = timing
    print(f"data-plane step at dp {timing['dp']} on real files ({timing['documents_per_step']:.0f} "
          f"documents): draw + balance + recipes {timing['step_ms_median']:.2f} ms median "
          f"({timing['step_cpu_ms_median']:.2f} ms CPU), {timing['step_ms_min']:.2f} ms min, "
          f"efficiency {timing['efficiency_mean']:.4f}")  # fmt: skip
    if not args.no_torch:
        rc = real_compute(2 if args.quick else 4, 8, args.seed)
        result["real_compute"] = rc
        print(f"real compute (tiny transformer, CPU, {rc['ranks_measured']} rank batches): "
              f"corr(modelled cost, time) {rc['correlation_modelled_cost_vs_time']:.4f}; fit "
              f"time = {rc['fit_seconds_per_token']:.3e} L + {rc['fit_seconds_per_token_squared']:.3e}"
              f" L^2 + {rc['fit_seconds_per_piece']:.3e}/piece (R^2 {rc['fit_r2']:.3f}); quadratic"
              f"/linear fitted {rc['fitted_quadratic_over_linear']:.2e} vs modelled "
              f"{rc['modelled_quadratic_over_linear']:.2e}; measured efficiency balanced "
              f"{rc['measured_efficiency_balanced']:.3f}, baseline "
              f"{rc['measured_efficiency_baseline']:.3f}")  # fmt: skip
    result["load_average"] = os.getloadavg()[0]  # timings are wall clock on a shared machine
    print(f"load average during the run: {result['load_average']:.2f}")
    print("RESULT " + json.dumps(result, sort_keys=True))


if __name__ == "__main__":
    main()

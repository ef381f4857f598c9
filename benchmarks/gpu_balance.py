"""Real compute on a GPU: do balanced global batches make ranks finish together?

    python benchmarks/gpu_balance.py [--quick]        # needs a CUDA GPU and torch

The heavy-tailed mix of benchmarks/balance.py (web-like, code-like and 8k-64k documents,
token weights 0.5 / 0.3 / 0.2) feeds DP 8 ranks with 4 micro-batches of 8192 tokens each, two
ways: omniload-dask's balanced split of one global batch, and the per-rank baseline (each rank
packing its own stream). Every rank's step -- forward + backward of a 0.6B-parameter
Llama-shaped transformer (bf16, varlen causal attention within documents) over its
micro-batches -- is timed on the GPU, one rank after another, with CUDA events. Reported:

- how well the cost model predicts measured time (correlation; fitted per-token and
  per-token-squared coefficients against the model-derived ones),
- measured balance efficiency (mean/max of the ranks' step times) for both,
- the measured step-time ratio baseline / balanced (a synchronous step waits for its slowest
  rank).

Ends with ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from balance import Shape, Stream, baseline_costs

from omniload_dask.batching.balance import Bucket, balance, route
from omniload_dask.batching.cost import CostModel, transformer_coefficients

MODEL = {"hidden": 2048, "layers": 12, "heads": 16, "kv_heads": 16, "ffn": 5632,
         "vocab": 32000, "gated": True}  # fmt: skip
SEQ, MICRO, DP = 8192, 4, 8


def build(torch, F):
    h, heads, f, vocab = MODEL["hidden"], MODEL["heads"], MODEL["ffn"], MODEL["vocab"]
    d = h // heads

    def attention_loop(q, k, v, cu):
        outs = []
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
            qq, kk, vv = (t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            outs.append(
                F.scaled_dot_product_attention(qq, kk, vv, is_causal=True)[0].transpose(0, 1)
            )
        return torch.cat(outs)

    def attention_jagged(q, k, v, cu):
        nest = [
            torch.nested.nested_tensor_from_jagged(t, offsets=cu).transpose(1, 2) for t in (q, k, v)
        ]
        out = F.scaled_dot_product_attention(*nest, is_causal=True)
        return out.transpose(1, 2).values()

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.n1, self.n2 = torch.nn.RMSNorm(h), torch.nn.RMSNorm(h)
            self.qkv = torch.nn.Linear(h, 3 * h, bias=False)
            self.out = torch.nn.Linear(h, h, bias=False)
            self.w1, self.w3 = torch.nn.Linear(h, f, bias=False), torch.nn.Linear(h, f, bias=False)
            self.w2 = torch.nn.Linear(f, h, bias=False)
            self.attend = attention_jagged

        def forward(self, x, cu):
            q, k, v = self.qkv(self.n1(x)).view(-1, 3, heads, d).unbind(1)
            x = x + self.out(self.attend(q, k, v, cu).reshape(-1, h))
            y = self.n2(x)
            return x + self.w2(F.silu(self.w1(y)) * self.w3(y))

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(vocab, h)
            self.blocks = torch.nn.ModuleList([Block() for _ in range(MODEL["layers"])])
            self.head = torch.nn.Linear(h, vocab, bias=False)

        def forward(self, ids, cu):
            x = self.emb(ids)
            for block in self.blocks:
                x = block(x, cu)
            return self.head(x)

    model = Model().cuda().to(torch.bfloat16)
    # Varlen attention through nested (jagged) tensors if this torch supports it on the GPU;
    # check it against a plain loop over documents first.
    q, k, v = (torch.randn(300, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cu = torch.tensor([0, 17, 150, 300], device="cuda")
    mode = "jagged"
    try:
        same = torch.allclose(
            attention_jagged(q, k, v, cu), attention_loop(q, k, v, cu), atol=2e-2, rtol=2e-2
        )
    except Exception as exc:  # any failure means: use the loop
        print(f"jagged attention unavailable ({type(exc).__name__}: {exc}); looping")
        same = False
    if not same:
        mode = "loop"
        for block in model.blocks:
            block.attend = attention_loop
    return model, mode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--seed", type=int, default=3)
    args = parser.parse_args()
    import torch
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to measure")
        print("RESULT " + json.dumps({"benchmark": "gpu_balance", "skipped": "no GPU"}))
        return 0
    steps = args.steps or (3 if args.quick else 8)
    torch.manual_seed(0)
    model, mode = build(torch, F)
    vocab = MODEL["vocab"]
    linear, quadratic = transformer_coefficients(**MODEL)
    cost = CostModel(linear, quadratic)

    def run_rank(micro_batches: list[np.ndarray]) -> float:
        """Forward + backward over a rank's micro-batches (pieces per micro-batch), in s."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        inputs = []
        for pieces in micro_batches:
            cu = torch.tensor(np.concatenate([[0], np.cumsum(pieces)]), device="cuda")
            ids = torch.randint(0, vocab, (int(pieces.sum()),), device="cuda")
            inputs.append((ids, cu))
        start.record()
        for ids, cu in inputs:
            F.cross_entropy(model(ids, cu).float(), ids).backward()
        end.record()
        torch.cuda.synchronize()
        model.zero_grad(set_to_none=True)
        return start.elapsed_time(end) / 1e3

    def micro_split(pieces: np.ndarray) -> list[np.ndarray]:
        """The baseline's pieces into micro-batches of at most SEQ tokens, in order."""
        out, cur, room = [], [], SEQ
        for p in pieces.tolist():
            if p > room and cur:
                out.append(np.asarray(cur))
                cur, room = [], SEQ
            cur.append(p)
            room -= p
        if cur:
            out.append(np.asarray(cur))
        return out

    for _ in range(3):  # warm-up (kernels, allocator)
        run_rank([np.array([512, 3000, 4680]), np.array([8192])])
    stream = Stream(args.seed, Shape())
    ranks = [Stream(args.seed * 1000 + 17 + r, Shape(), split=SEQ) for r in range(DP)]
    buckets = [Bucket(SEQ, MICRO)]
    xs, ys = [], []
    times = {"balanced": [], "baseline": []}
    t_start = time.time()
    for _ in range(steps):
        lengths, src = stream.next(DP * MICRO * SEQ)
        bucket, by_length = route(lengths, src, buckets)
        plan = balance(lengths, bucket, buckets, DP, cost, by_length=by_length)
        balanced = [
            [
                plan.length[(plan.group == g) & (plan.micro == m)]
                for m in range(plan.num_micro_steps)
            ]
            for g in range(DP)
        ]
        _, base_pieces = baseline_costs(ranks, MICRO, SEQ, cost)
        baseline = [micro_split(p) for p in base_pieces]
        for name, per_rank in (("balanced", balanced), ("baseline", baseline)):
            measured = []
            for mbs in per_rank:
                mbs = [m for m in mbs if len(m)]
                seconds = run_rank(mbs)
                measured.append(seconds)
                n = np.concatenate(mbs).astype(np.float64)
                xs.append((n.sum(), (n * n).sum(), float(cost(n).sum())))
                ys.append(seconds)
            times[name].append(measured)
    x, y = np.asarray(xs), np.asarray(ys)
    coef, *_ = np.linalg.lstsq(np.column_stack([x[:, 0], x[:, 1], np.ones(len(y))]), y, rcond=None)
    step = {k: np.asarray(v) for k, v in times.items()}
    eff = {k: float((v.mean(axis=1) / v.max(axis=1)).mean()) for k, v in step.items()}
    tokens = {"balanced": DP * MICRO * SEQ, "baseline": DP * MICRO * SEQ}
    result = {
        "benchmark": "gpu_balance",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "attention": mode,
        "model": MODEL,
        "dp": DP,
        "micro_batches": MICRO,
        "seq_len": SEQ,
        "steps": steps,
        "rank_steps_measured": len(y),
        "correlation_modelled_cost_vs_time": float(np.corrcoef(x[:, 2], y)[0, 1]),
        "fit_seconds_per_token": float(coef[0]),
        "fit_seconds_per_token_squared": float(coef[1]),
        "fitted_quadratic_over_linear": float(coef[1] / coef[0]),
        "modelled_quadratic_over_linear": quadratic / linear,
        "measured_efficiency_balanced": eff["balanced"],
        "measured_efficiency_baseline": eff["baseline"],
        "step_seconds_balanced": float(step["balanced"].max(axis=1).mean()),
        "step_seconds_baseline": float(step["baseline"].max(axis=1).mean()),
        "speedup_vs_baseline": float(
            step["baseline"].max(axis=1).sum() / step["balanced"].max(axis=1).sum()
        ),
        "tokens_per_step": tokens["balanced"],
        "wall_seconds": round(time.time() - t_start, 1),
    }
    print(f"{result['device']}, torch {result['torch']}, attention {mode}")
    print(
        f"cost model vs measured time: correlation {result['correlation_modelled_cost_vs_time']:.4f}"
        f", fitted b/a {result['fitted_quadratic_over_linear']:.3e} "
        f"(model {result['modelled_quadratic_over_linear']:.3e})"
    )
    print(
        f"measured balance efficiency: balanced {eff['balanced']:.4f}, "
        f"baseline {eff['baseline']:.4f}; step time {result['step_seconds_balanced']:.3f} s vs "
        f"{result['step_seconds_baseline']:.3f} s (x{result['speedup_vs_baseline']:.3f})"
    )
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

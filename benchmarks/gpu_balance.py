"""Balance judged by measured time on the training device: a GPU when there is one.

    python benchmarks/gpu_balance.py [--quick]             # CUDA if torch sees a GPU, else CPU
    python benchmarks/gpu_balance.py --device cpu --quick  # the CPU path (a tiny model)

The measured part of ``benchmarks/balance.py`` (:func:`balance.measured_balance`) at the
device's scale: the cost is calibrated on the device (``omniload_dask.calibrate``), then DP 8
ranks' steps are timed for the unbalanced per-rank packing and for the balancer with the
plan's default cost, the transformer formula and the calibrated cost, on the heavy-tailed mix
of ``balance.py`` (web-like, code-like and 8k-64k documents at ``seq_len`` 8192).

- CUDA: a 0.6B-parameter Llama-shaped transformer (hidden 2048, 12 layers, 16 heads, FFN 5632
  gated, vocabulary 32000), bfloat16, 4 micro-batches of 8192 tokens per rank, varlen
  attention as one ``scaled_dot_product_attention`` call on jagged nested tensors (checked
  against a per-document loop first, which it falls back to), timed with CUDA events. This
  path is written but has not run in this project's sessions (no GPU was lent); its figures
  are still to be recorded.
- CPU: the tiny transformer of ``balance.py`` (2 micro-batches of 2048 tokens), one thread,
  thread CPU time: the same code path, so that it keeps working without a GPU.

Ends with ``RESULT {json}`` (the keys of ``balance.py``'s measured part).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from balance import RC_MICRO, RC_SEQ, TINY, RealCompute, measured_balance, print_measured, run_key

MODEL = {"hidden": 2048, "layers": 12, "heads": 16, "kv_heads": 16, "ffn": 5632,
         "vocab": 32000, "gated": True}  # fmt: skip
GPU_SEQ, GPU_MICRO, DP = 8192, 4, 8


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", help="cuda, cuda:1, cpu (default: cuda if there is one)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--fill", type=float, nargs="+", default=[1.0, 0.9])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=3)
    args = parser.parse_args()
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda"):
        setup = RealCompute(MODEL, GPU_SEQ, GPU_MICRO, device)
    else:
        setup = RealCompute(TINY, RC_SEQ, RC_MICRO, device)
    steps = args.steps or (2 if args.quick else 6)
    rc = measured_balance(setup, [DP], steps, args.seed, args.fill, repeats=args.repeats,
                          quick=args.quick)  # fmt: skip
    print(f"torch {torch.__version__}, attention {rc['attention']}")
    print_measured(rc)
    head = rc["by_dp"][run_key(DP, args.fill[0])]
    result = {"benchmark": "gpu_balance", "torch": torch.__version__, "measured": rc}
    for name, value in head["measured_efficiency"].items():
        result[f"measured_efficiency_{name.replace('identical', 'identical_work')}"] = value
    result["speedup_calibrated_vs_unbalanced"] = (
        head["step_seconds"]["unbalanced"] / head["step_seconds"]["calibrated"]
    )
    result["calibration_error_pct"] = rc["calibration"]["held_back"]["mean_abs_rel_error_pct"]
    print("RESULT " + json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())

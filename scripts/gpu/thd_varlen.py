"""Check on a GPU that ``thd_batch``'s packed layout gives per-document attention.

    python scripts/gpu/thd_varlen.py [--steps 4] [--pad-multiple 4]

Real micro-batches from a job over ``plans/tiny_trainers.yaml`` (after ``omniload demo-data
plans/demo-data``) are put in TE's THD layout by ``thd_batch`` with every document padded to a
multiple of ``--pad-multiple`` (as context parallelism pads to ``2*cp``). Attention over the
packed row with torch's fused variable-length kernel (``torch.nn.attention.varlen``, given
``cu_seqlens_padded``) must equal, on every real token, causal attention over that document
alone; padding must change nothing. The cp slices of the same padded batch (cp 2 and 4) must
hold every padded position exactly once. Prints one line per check and a final
``RESULT {json}``; exits 1 on any mismatch. Needs CUDA (the fused kernel has no CPU path).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from omniload_dask import Job, load_plan  # noqa: E402
from omniload_dask.integrations.megatron import thd_batch, thd_partition_index  # noqa: E402

HEADS, HEAD_DIM = 8, 64
ROOM = 2  # the padded row may be longer than the loader's seq_len (a model buffer with room)


def varlen_causal(q, k, v, cu: torch.Tensor, max_len: int) -> torch.Tensor:
    """torch's fused varlen attention, causal (torch 2.10 names it ``is_causal``, later
    releases a ``window_size`` of (-1, 0))."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    if "is_causal" in inspect.signature(varlen_attn).parameters:
        return varlen_attn(q, k, v, cu, cu, max_len, max_len, is_causal=True)
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, window_size=(-1, 0))


def check_micro_batch(mb: dict, multiple: int, gen: torch.Generator) -> tuple[float, int]:
    """The largest |varlen - per-document| over real tokens, and the documents checked."""
    b = thd_batch(mb, pad_multiple=multiple, capacity=ROOM * int(mb["seq_len"]))
    total = b["tokens"].shape[1]
    q, k, v = (
        torch.randn(total, HEADS, HEAD_DIM, generator=gen, device="cuda", dtype=torch.bfloat16)
        for _ in range(3)
    )
    cu_pad = b["cu_seqlens_padded"].cuda()
    packed = varlen_causal(q, k, v, cu_pad, b["max_seqlen"])
    worst = 0.0
    cu = b["cu_seqlens"].tolist()
    starts = cu_pad.tolist()
    for i in range(len(cu) - 1):
        n, s = cu[i + 1] - cu[i], starts[i]
        if n == 0:
            continue
        one = [t[s : s + n].transpose(0, 1)[None].float() for t in (q, k, v)]
        alone = F.scaled_dot_product_attention(*one, is_causal=True)[0].transpose(0, 1)
        worst = max(worst, float((packed[s : s + n].float() - alone).abs().max()))
    return worst, len(cu) - 1


def check_slices(mb: dict, multiple: int) -> bool:
    """Every cp rank's slice of the padded batch, together, holds each position once."""
    b = thd_batch(mb, pad_multiple=multiple, capacity=ROOM * int(mb["seq_len"]))
    for cp in (2, 4):
        if multiple % (2 * cp):
            continue
        held = torch.cat([thd_partition_index(b["cu_seqlens_padded"], cp, r) for r in range(cp)])
        if not torch.equal(held.sort().values, torch.arange(b["tokens"].shape[1])):
            return False
        for r in range(cp):
            sliced = thd_batch(
                mb, cp_size=cp, cp_rank=r, pad_multiple=multiple, capacity=ROOM * int(mb["seq_len"])
            )
            index = thd_partition_index(b["cu_seqlens_padded"], cp, r)
            if not torch.equal(sliced["tokens"][0], b["tokens"][0][index]):
                return False
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--pad-multiple", type=int, default=8)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("thd_varlen: needs a CUDA device", file=sys.stderr)
        return 2
    plan = load_plan(str(ROOT / "plans" / "tiny_trainers.yaml"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    worst, docs, micro, slices_ok = 0.0, 0, 0, True
    with Job.start(plan, dp=1) as job:
        for mb in job.feeder(dp_rank=0, max_steps=args.steps):
            err, n = check_micro_batch(mb, args.pad_multiple, gen)
            worst, docs, micro = max(worst, err), docs + n, micro + 1
            slices_ok &= check_slices(mb, args.pad_multiple)
    ok = worst < 2e-2 and slices_ok and docs > 0  # bf16 inputs, fp32 reference
    print(f"varlen vs per-document attention: {micro} micro-batches, {docs} documents, "
          f"max |diff| {worst:.2e}")  # fmt: skip
    print(f"cp slices cover each padded position once: {slices_ok}")
    print("RESULT " + json.dumps({
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "micro_batches": micro, "documents": docs, "max_abs_diff": worst,
        "slices_ok": slices_ok, "ok": ok,
    }))  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

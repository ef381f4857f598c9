"""Train a tiny causal transformer on omniload-dask feeder batches (CPU, one process).

    python examples/train_tiny.py --plan plans/quickstart.yaml --steps 30

The job runs on an embedded LocalCluster with this process as the only trainer rank (dp=1).
Batches arrive packed ("varlen"): documents are concatenated, ``cu_seqlens`` marks their
boundaries, and attention must not cross them. FlashAttention takes ``cu_seqlens`` directly;
this example builds the equivalent block-diagonal causal mask so it runs anywhere.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
from torch import nn

from omniload_dask import Job, load_plan


class TinyLM(nn.Module):
    def __init__(
        self, vocab: int, dim: int = 128, layers: int = 2, heads: int = 4, max_pos: int = 4096
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_pos, dim)
        layer = nn.TransformerEncoderLayer(
            dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(dim, vocab)

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor
    ) -> torch.Tensor:
        x = self.embed(input_ids) + self.pos(position_ids.clamp(max=self.pos.num_embeddings - 1))
        mask = varlen_causal_mask(cu_seqlens, len(input_ids))
        return self.head(self.blocks(x[None], mask=mask)[0])


def varlen_causal_mask(cu_seqlens: torch.Tensor, n: int) -> torch.Tensor:
    """True where attention is forbidden: across documents, or to later tokens."""
    doc = torch.bucketize(torch.arange(n), cu_seqlens[1:].long(), right=True)
    same_doc = doc[:, None] == doc[None, :]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    return ~(same_doc & causal)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--plan", default=str(Path(__file__).parents[1] / "plans" / "quickstart.yaml")
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--make-demo-data", action="store_true")
    args = parser.parse_args()
    if args.make_demo_data:
        from omniload_dask.demo import make_demo_data

        make_demo_data(Path(args.plan).resolve().parent / "demo-data")
    torch.manual_seed(0)
    plan = load_plan(args.plan)
    with Job.start(plan, dp=1, tp=1, pp=1, cp=1, dashboard_address=None) as job:
        vocab = int(job.info["tokenizer"]["vocab_size"])
        model = TinyLM(vocab)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        feeder = job.feeder(dp_rank=0, max_steps=args.steps)
        t0 = time.perf_counter()
        for micro_batches in feeder.steps():
            tokens = sum(int(mb["num_tokens"]) for mb in micro_batches)
            total = 0.0
            for mb in micro_batches:
                logits = model(mb["input_ids"], mb["position_ids"], mb["cu_seqlens"])
                # The loss rule: the sum of the token losses over the step's loss tokens on
                # every DP rank (global_loss_tokens, the same on each), and gradients summed
                # across DP ranks (all_reduce SUM; under DDP, which averages, multiply the loss
                # by the DP size). Every token then weighs the same whatever rank or
                # micro-batch the balancer put it in; a mean per rank or per micro-batch would
                # weigh a token by how full its micro-batch was.
                loss = nn.functional.cross_entropy(
                    logits, mb["labels"], ignore_index=-100, reduction="sum"
                ) / max(1, int(mb["global_loss_tokens"]))
                loss.backward()
                total += loss.item()
            opt.step()
            opt.zero_grad()
            step = micro_batches[0]["step"]
            print(
                f"step {step:4d}  loss {total:.4f}  ({math.exp(min(total, 20)):.1f} ppl)  "
                f"{len(micro_batches)} micro-batches, {tokens} tokens, "
                f"{time.perf_counter() - t0:.1f}s",
                flush=True,
            )


if __name__ == "__main__":
    main()

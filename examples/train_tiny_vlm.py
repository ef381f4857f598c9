"""Train a tiny vision-language model on omniload-dask feeder batches (CPU, one process).

    python examples/train_tiny_vlm.py --plan plans/vlm.yaml --steps 20 --make-demo-data

Each micro-batch holds the pixel patches of its images and, per token position,
``image_token_map``: -1 for text, else the index of the image token in the concatenated
(merged) encoder output. The model encodes every image's patches, merges each window of
``merge**2`` consecutive patches into one token, and scatters those tokens into the sequence
where the placeholders sit::

    embeds = embed(input_ids)
    embeds[map >= 0] = merged_encoder_output[map[map >= 0]]

Then a small causal transformer runs over the packed documents, as in examples/train_tiny.py.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch import nn

from omniload_dask import Job, load_plan


class TinyVLM(nn.Module):
    def __init__(self, vocab: int, patch: int, merge: int, dim: int = 96) -> None:
        super().__init__()
        self.merge = merge
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(4096, dim)
        self.patch_in = nn.Linear(patch * patch * 3, dim)  # a one-layer "vision encoder"
        self.merger = nn.Linear(merge * merge * dim, dim)
        layer = nn.TransformerEncoderLayer(dim, 4, 4 * dim, 0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, 2)
        self.head = nn.Linear(dim, vocab)

    def forward(self, mb: dict) -> torch.Tensor:
        ids, token_map = mb["input_ids"], mb["image_token_map"]
        x = self.embed(ids) + self.pos(mb["position_ids"].clamp(max=4095))
        patches = mb["pixel_patches"]
        if len(patches):
            pixels = patches.reshape(len(patches), -1).float() / 255.0
            encoded = self.patch_in(pixels)  # (patches, dim), merge windows contiguous
            merged = self.merger(encoded.reshape(-1, self.merge * self.merge * encoded.shape[1]))
            at = token_map >= 0
            x = x.clone()
            x[at] = x[at] + merged[token_map[at]]
        doc = torch.bucketize(torch.arange(len(ids)), mb["cu_seqlens"][1:].long(), right=True)
        mask = ~((doc[:, None] == doc[None, :]) & torch.ones(len(ids), len(ids)).bool().tril())
        return self.head(self.blocks(x[None], mask=mask)[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--plan", default=str(Path(__file__).parents[1] / "plans" / "vlm.yaml"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--make-demo-data", action="store_true")
    args = parser.parse_args()
    if args.make_demo_data:
        from omniload_dask.demo import make_demo_data

        make_demo_data(Path(args.plan).resolve().parent / "demo-data")
    torch.manual_seed(0)
    plan = load_plan(args.plan)
    assert plan.images is not None, "the plan has no image sources"
    with Job.start(plan, dp=1, dashboard_address=None) as job:
        vocab = int(job.info["tokenizer"]["vocab_size"])
        model = TinyVLM(vocab, plan.images.patch_size, plan.images.merge)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        t0 = time.perf_counter()
        for micro_batches in job.feeder(dp_rank=0, max_steps=args.steps).steps():
            tokens = sum(int(mb["num_tokens"]) for mb in micro_batches)
            total = 0.0
            images = 0
            for mb in micro_batches:
                logits = model(mb)
                loss = (
                    nn.functional.cross_entropy(
                        logits, mb["labels"], ignore_index=-100, reduction="sum"
                    )
                    / tokens
                )
                loss.backward()
                total += loss.item()
                images += len(mb["image_doc"])
            opt.step()
            opt.zero_grad()
            print(
                f"step {micro_batches[0]['step']:4d}  loss {total:.4f}  {images} images, "
                f"{tokens} tokens, {time.perf_counter() - t0:.1f}s",
                flush=True,
            )


if __name__ == "__main__":
    main()

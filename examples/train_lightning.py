"""Train a tiny causal transformer with Lightning (DDP over gloo) on omniload-dask batches.

    python -m omniload_dask.cli demo-data plans/demo-data        # once
    torchrun --nproc-per-node 2 examples/train_lightning.py --out runs/lightning --steps 8
    torchrun --nproc-per-node 2 examples/train_lightning.py --out runs/lightning --steps 8 --resume

``OmniloadDataModule`` starts the job on rank 0 (an embedded Dask cluster) when Lightning asks
for the train loader; each rank gets its own packed micro-batches, one optimizer step per global
batch (``accumulate_grad_batches`` = the plan's micro-batches). The feeder's position is in
every Lightning checkpoint; ``--resume`` continues from the last one with exactly the batches an
uninterrupted run would have had. ``--kill-after-step N`` kills rank 0 (SIGKILL) right after
the checkpoint of step N. Every ``--eval-steps`` steps Lightning's validation loop reads a
pass over the plan's validation stream (the same batches each time) and rank 0 prints the
eval loss.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import signal
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn

from omniload_dask.integrations.lightning import OmniloadDataModule

PLAN = Path(__file__).parents[1] / "plans" / "tiny_trainers.yaml"


def varlen_causal_mask(cu_seqlens: torch.Tensor, n: int) -> torch.Tensor:
    """True where attention is forbidden: across documents, or to later tokens."""
    doc = torch.bucketize(torch.arange(n), cu_seqlens[1:].long(), right=True)
    return ~((doc[:, None] == doc[None, :]) & torch.ones(n, n, dtype=torch.bool).tril())


class TinyLM(pl.LightningModule):
    def __init__(self, vocab: int, dim: int = 64, record: str | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(4096, dim)
        layer = nn.TransformerEncoderLayer(dim, 4, 2 * dim, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, 2)
        self.head = nn.Linear(dim, vocab)
        self.record = record
        self.step_loss = 0.0
        self.eval_sums = torch.zeros(2)  # this validation run's loss and tokens, this rank

    def note(self, mb: dict, name: str) -> None:
        """Append a digest of ``mb`` to ``--record``/``name`` (what this rank read)."""
        if self.record:
            with open(os.path.join(self.record, name), "a") as f:
                digest = hashlib.sha1(
                    mb["input_ids"].numpy().tobytes() + mb["labels"].numpy().tobytes()
                ).hexdigest()
                line = {"step": int(mb["step"]), "micro_step": int(mb["micro_step"])}
                f.write(json.dumps({**line, "digest": digest}) + "\n")

    def loss_sum(self, mb: dict) -> torch.Tensor:
        """The summed next-token loss of a packed micro-batch (documents attend only within)."""
        n = len(mb["input_ids"])
        x = self.embed(mb["input_ids"]) + self.pos(mb["position_ids"])
        logits = self.head(self.blocks(x[None], mask=varlen_causal_mask(mb["cu_seqlens"], n))[0])
        return nn.functional.cross_entropy(logits, mb["labels"], ignore_index=-100, reduction="sum")

    def validation_step(self, mb: dict, batch_idx: int) -> None:
        self.note(mb, f"eval-rank{self.global_rank}.jsonl")
        count = (mb["labels"] != -100).sum()
        self.eval_sums += torch.stack([self.loss_sum(mb).detach(), count.float()])

    def on_validation_epoch_end(self) -> None:
        sums, self.eval_sums = self.eval_sums, torch.zeros(2)
        dist.all_reduce(sums)  # over every rank's share of the pass
        if self.global_rank == 0:
            loss = float(sums[0] / sums[1].clamp(min=1))
            print(f"step {self.global_step} eval_loss {loss:.4f}", flush=True)

    def training_step(self, mb: dict, batch_idx: int) -> torch.Tensor:
        self.note(mb, f"rank{self.global_rank}.jsonl")
        total = self.loss_sum(mb)
        # Every token weighs the same whatever rank or micro-batch holds it: divide by the
        # step's count over all ranks (DDP averages gradients over ranks, hence * world size).
        if "global_loss_tokens" in mb:
            loss = total * self.trainer.world_size / max(1, int(mb["global_loss_tokens"]))
        else:  # per micro-batch mean, averaged over the step's micro-batches
            count = max(1, int((mb["labels"] != -100).sum()))
            loss = total / count / int(mb["num_micro_steps"])
        self.step_loss += float(loss.detach()) / (
            self.trainer.world_size if "global_loss_tokens" in mb else 1
        )
        return loss

    def on_train_batch_end(self, outputs, mb, batch_idx: int) -> None:
        if int(mb["micro_step"]) == int(mb["num_micro_steps"]) - 1:
            if self.global_rank == 0:
                print(f"step {int(mb['step']) + 1} loss {self.step_loss:.4f}", flush=True)
            self.step_loss = 0.0

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


class KillAfter(pl.Callback):
    """Kills rank 0 once the checkpoint of step ``step`` is written (a crash to resume from)."""

    def __init__(self, step: int | None) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if trainer.global_step == self.step and int(batch["micro_step"]) == 0:
            dist.barrier()
            if trainer.global_rank == 0:
                print(f"killing rank 0 after step {trainer.global_step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)


def last_checkpoint(folder: str) -> str | None:
    """The checkpoint of the highest step in ``folder`` (named ``step<N>.ckpt``)."""
    found = [
        (int(m.group(1)), f) for f in os.listdir(folder) if (m := re.match(r"step(\d+)\.ckpt$", f))
    ]
    return os.path.join(folder, max(found)[1]) if found else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--plan", default=str(PLAN))
    parser.add_argument("--out", default="runs/lightning")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--save-steps", type=int, default=2)
    parser.add_argument("--eval-steps", type=int, default=2)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--kill-after-step", type=int, default=None)
    parser.add_argument("--record", default=None, help="folder for per-rank batch digests")
    args = parser.parse_args()
    if args.record:
        os.makedirs(args.record, exist_ok=True)
    data = OmniloadDataModule(args.plan, max_steps=args.steps)
    torch.manual_seed(0)
    saver = pl.callbacks.ModelCheckpoint(
        dirpath=args.out,
        filename="step{step}",
        auto_insert_metric_name=False,
        every_n_train_steps=args.save_steps,
        save_top_k=-1,
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
        strategy="ddp",
        max_steps=args.steps,
        accumulate_grad_batches=data.micro_batches,
        val_check_interval=args.eval_steps * data.micro_batches,  # (counted in micro-batches)
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,  # each rank's feeder already yields that rank's share
        callbacks=[saver, KillAfter(args.kill_after_step)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = TinyLM(vocab_size(args.plan), record=args.record)
    resume = last_checkpoint(args.out) if args.resume and os.path.isdir(args.out) else None
    trainer.fit(model, datamodule=data, ckpt_path=resume)


def vocab_size(plan_path: str) -> int:
    """The tokenizer's vocabulary size, from the plan's tokenizer file (before any job runs)."""
    from tokenizers import Tokenizer

    from omniload_dask import load_plan

    return Tokenizer.from_file(str(load_plan(plan_path).tokenizer.path)).get_vocab_size()


if __name__ == "__main__":  # the embedded cluster starts its workers as new processes (spawn)
    main()

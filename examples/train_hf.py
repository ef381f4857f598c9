"""Train a tiny Llama with ``transformers.Trainer`` on omniload-dask batches (CPU, torchrun).

    python -m omniload_dask.cli demo-data plans/demo-data        # once
    torchrun --nproc-per-node 2 examples/train_hf.py --out runs/hf --steps 8
    torchrun --nproc-per-node 2 examples/train_hf.py --out runs/hf --steps 8 --resume

Rank 0 starts the job (an embedded Dask cluster) and the ranks share it; each rank's feeder
yields that rank's packed micro-batches, which ``OmniloadTrainer`` trains on without a second
sharding, one global batch per optimizer step (``gradient_accumulation_steps`` = the plan's
micro-batches). Every checkpoint folder holds the feeder's position; ``--resume`` continues
from the last checkpoint with exactly the batches an uninterrupted run would have had.
``--kill-after-step N`` kills rank 0 (SIGKILL) right after the checkpoint of step N, to try it.
Every ``--eval-steps`` steps the Trainer evaluates on a pass over the plan's validation stream
(the same batches each time) and rank 0 prints the eval loss. The model is made from a config:
nothing is downloaded.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from omniload_dask import load_plan
from omniload_dask.integrations.hf import (
    OmniloadEvalIterable,
    OmniloadIterable,
    OmniloadTrainer,
    load_rank_state,
)
from omniload_dask.integrations.launch import SharedJob

PLAN = Path(__file__).parents[1] / "plans" / "tiny_trainers.yaml"


class Report(TrainerCallback):
    """Prints the loss per step on rank 0; kills rank 0 after checkpoint ``kill_after``."""

    def __init__(self, kill_after: int | None) -> None:
        self.kill_after = kill_after

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs and "loss" in logs:
            print(f"step {state.global_step} loss {logs['loss']:.4f}", flush=True)
        if state.is_world_process_zero and logs and "eval_loss" in logs:
            print(f"step {state.global_step} eval_loss {logs['eval_loss']:.4f}", flush=True)

    def on_step_begin(self, args, state, control, **kwargs):
        if self.kill_after is not None and state.global_step == self.kill_after:
            dist.barrier()  # every rank has written its part of the checkpoint
            if dist.get_rank() == 0:
                print(f"killing rank 0 after step {state.global_step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)


def recorder(path: str | None, name: str):
    """A function that appends a digest of each micro-batch it sees to ``path``/``name``."""
    if path is None:
        return None
    os.makedirs(path, exist_ok=True)
    out = open(os.path.join(path, name), "a")  # noqa: SIM115 (lives as long as the run)

    def record(mb) -> None:
        digest = hashlib.sha1(mb["input_ids"].numpy().tobytes() + mb["labels"].numpy().tobytes())
        line = {
            "step": int(mb["step"]),
            "micro_step": int(mb["micro_step"]),
            "digest": digest.hexdigest(),
        }
        out.write(json.dumps(line) + "\n")
        out.flush()

    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--plan", default=str(PLAN))
    parser.add_argument("--out", default="runs/hf")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--save-steps", type=int, default=2)
    parser.add_argument("--eval-steps", type=int, default=2)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--kill-after-step", type=int, default=None)
    parser.add_argument("--record", default=None, help="folder for per-rank batch digests")
    args = parser.parse_args()
    plan = load_plan(args.plan)
    micro = plan.batch.micro_batches
    training = TrainingArguments(
        output_dir=args.out,
        max_steps=args.steps,
        per_device_train_batch_size=1,  # one packed micro-batch per item
        gradient_accumulation_steps=micro,  # one optimizer step per global batch
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        save_strategy="steps",
        save_steps=args.save_steps,
        eval_strategy="steps",
        eval_steps=args.eval_steps,
        per_device_eval_batch_size=1,
        logging_steps=1,
        use_cpu=True,
        ddp_backend="gloo",
        report_to=[],
        disable_tqdm=True,
        seed=0,
    )
    rank = training.process_index  # sets up torch.distributed (gloo) under torchrun
    checkpoint = get_last_checkpoint(args.out) if args.resume else None
    start = load_rank_state(checkpoint, rank)["step"] if checkpoint else 0
    shared = SharedJob.start(plan, dp=training.world_size, start_step=start)
    feeder = shared.feeder(max_steps=args.steps)
    data = OmniloadIterable(feeder, on_batch=recorder(args.record, f"rank{rank}.jsonl"))
    evals = OmniloadEvalIterable(  # pass k over the validation stream, for evaluation k
        lambda k: shared.feeder(stream="validation", pass_index=k),
        on_batch=recorder(args.record, f"eval-rank{rank}.jsonl"),
    )
    vocab = int(shared.info["tokenizer"]["vocab_size"])
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=plan.batch.seq_len,
    )
    model = LlamaForCausalLM(config)
    trainer = OmniloadTrainer(
        model=model,
        args=training,
        train_dataset=data,
        eval_dataset=evals,
        callbacks=[Report(args.kill_after_step)],
    )
    trainer.train(resume_from_checkpoint=checkpoint)
    feeder.close()
    shared.close()
    dist.destroy_process_group()


if __name__ == "__main__":  # the embedded cluster starts its workers as new processes (spawn)
    main()

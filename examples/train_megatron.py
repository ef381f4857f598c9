"""Train a tiny Megatron-Core GPTModel on omniload-dask batches (CPU, 2 ranks over gloo).

    python -m omniload_dask.cli demo-data plans/demo-data        # once
    torchrun --nproc-per-node 2 examples/train_megatron.py --out runs/megatron --steps 8
    torchrun --nproc-per-node 2 examples/train_megatron.py --out runs/megatron --steps 8 --resume

Rank 0 starts the job (an embedded Dask cluster); every rank's feeder yields that rank's packed
micro-batches, put in TE's THD layout by ``thd_batch``. The model is megatron-core's
``GPTModel`` with its local (non-Transformer-Engine) layers, made from a config. The local
attention does not take ``PackedSeqParams`` (TE's does, on a GPU), so here the documents of a
packed row are kept apart by a block-diagonal causal ``attention_mask`` built from the batch's
``cu_seqlens_padded``. Every ``--save-steps`` steps ``step<N>/`` gets the model and optimizer
(rank 0) and each rank's feeder position; ``--resume`` continues from the last complete one
with exactly the batches an uninterrupted run would have had. ``--kill-after-step N`` kills
rank 0 (SIGKILL) right after the checkpoint of step N. Every ``--eval-steps`` steps the ranks
read a pass over the plan's validation stream and rank 0 prints the eval loss.

On a CPU-only torch three parts of megatron-core need a CUDA device, and the example steers
around each with megatron-core's own API (see ``cpu_setup``): its DDP wrapper (torch's is used
instead), the dropout RNG tracker, and the attention score buffer. Its ``dist_checkpointing``
cannot save without CUDA either, so checkpoints are ``torch.save`` files.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import signal
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from omniload_dask import load_plan
from omniload_dask.integrations.launch import SharedJob
from omniload_dask.integrations.megatron import thd_batch

PLAN = Path(__file__).parents[1] / "plans" / "tiny_trainers.yaml"
HEADS = 4


def cpu_setup(seq_len: int) -> None:
    """Megatron-core on a CPU-only torch: tensor and pipeline parallel size 1, and the two
    places its forward pass would otherwise ask for a CUDA device."""
    parallel_state.initialize_model_parallel(1, 1)
    # The training RNG tracker forks the CUDA generator around dropout; the inference tracker
    # does not fork (dropout is 0 here, so nothing random happens inside it).
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True)
    # Local attention takes its score buffer from a global pool that allocates on the CUDA
    # device; one CPU buffer as large as the longest micro-batch needs is reused instead.
    pool = parallel_state.get_global_memory_buffer()
    pool.buffer[("mpu", torch.float32)] = torch.empty(HEADS * seq_len * seq_len)


def document_mask(cu_seqlens: torch.Tensor, n: int) -> torch.Tensor:
    """[1, 1, n, n], True where attention is forbidden: across documents, or to later tokens."""
    doc = torch.bucketize(torch.arange(n), cu_seqlens[1:].long(), right=True)
    allowed = (doc[:, None] == doc[None, :]) & torch.ones(n, n, dtype=torch.bool).tril()
    return ~allowed[None, None]


def loss_sum(model: Any, mb: dict[str, Any]) -> torch.Tensor:
    """The summed next-token loss of one packed micro-batch."""
    b = thd_batch(mb)  # cp = 1: one row, documents unpadded
    labels = b["labels"].clamp(min=0)  # non-targets (-100) are masked out by loss_mask
    mask = document_mask(b["cu_seqlens_padded"], b["tokens"].shape[1])
    per_token = model(b["tokens"], b["position_ids"], mask, labels=labels)
    return (per_token * b["loss_mask"]).sum()


def recorder(folder: str | None, name: str):
    """Appends each micro-batch's digest to ``folder/name`` (what this rank read)."""

    def record(mb: dict[str, Any]) -> None:
        if folder:
            digest = hashlib.sha1(
                mb["input_ids"].numpy().tobytes() + mb["labels"].numpy().tobytes()
            ).hexdigest()
            line = {"step": int(mb["step"]), "micro_step": int(mb["micro_step"]), "digest": digest}
            with open(os.path.join(folder, name), "a") as f:
                f.write(json.dumps(line) + "\n")

    return record


def last_checkpoint(folder: str) -> str | None:
    """The complete checkpoint (``step<N>/done`` written) of the highest step in ``folder``."""
    if not os.path.isdir(folder):
        return None
    found = [
        (int(m.group(1)), os.path.join(folder, f))
        for f in os.listdir(folder)
        if (m := re.match(r"step(\d+)$", f)) and os.path.exists(os.path.join(folder, f, "done"))
    ]
    return max(found)[1] if found else None


def save(folder: str, step: int, model: Any, opt: Any, feeder: Any) -> None:
    """``folder/step<step>/``: model and optimizer (rank 0; DDP keeps replicas equal), each
    rank's feeder position, and ``done`` once every rank has written its part."""
    path = os.path.join(folder, f"step{step}")
    rank = dist.get_rank()
    os.makedirs(path, exist_ok=True)
    if rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f"{path}/model.pt")
    torch.save(feeder.state_dict(), f"{path}/feeder-rank{rank}.pt")
    dist.barrier()
    if rank == 0:
        Path(path, "done").touch()


def evaluate(shared: SharedJob, model: Any, k: int, record: Any) -> float:
    """Pass ``k`` over the validation stream (every rank its share): the mean token loss."""
    sums = torch.zeros(2)
    feeder = shared.feeder(stream="validation", pass_index=k)
    with torch.no_grad():
        for mb in feeder:
            record(mb)
            sums += torch.stack([loss_sum(model, mb), (mb["labels"] != -100).sum().float()])
    feeder.close()
    dist.all_reduce(sums)
    return float(sums[0] / sums[1].clamp(min=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--plan", default=str(PLAN))
    parser.add_argument("--out", default="runs/megatron")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--save-steps", type=int, default=2)
    parser.add_argument("--eval-steps", type=int, default=2)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--kill-after-step", type=int, default=None)
    parser.add_argument("--record", default=None, help="folder for per-rank batch digests")
    args = parser.parse_args()
    if args.record:
        os.makedirs(args.record, exist_ok=True)
    plan = load_plan(args.plan)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cpu_setup(plan.batch.seq_len)
    checkpoint = last_checkpoint(args.out) if args.resume else None
    state = torch.load(f"{checkpoint}/feeder-rank{rank}.pt") if checkpoint else None
    shared = SharedJob.start(plan, dp=world, start_step=state["step"] if state else 0)
    feeder = shared.feeder(max_steps=args.steps)
    torch.manual_seed(0)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=HEADS,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(),
        vocab_size=int(shared.info["tokenizer"]["vocab_size"]),
        max_sequence_length=plan.batch.seq_len,
        position_embedding_type="learned_absolute",  # rotary tables are built on the GPU
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    if checkpoint and state:
        saved = torch.load(f"{checkpoint}/model.pt")
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        feeder.load_state_dict(state)
    ddp = torch.nn.parallel.DistributedDataParallel(model)  # gloo all-reduce, averaging
    record = recorder(args.record, f"rank{rank}.jsonl")
    for micro_batches in feeder.steps():
        step = int(micro_batches[0]["step"])
        if step == args.kill_after_step:
            dist.barrier()  # the checkpoint of this step is complete
            if rank == 0:
                print(f"killing rank 0 after step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        total = torch.zeros(1)
        for mb in micro_batches:
            record(mb)
            # Every token weighs the same whatever rank or micro-batch holds it: the sum over
            # the step's loss tokens on all ranks; DDP averages gradients, hence * world.
            loss = loss_sum(ddp, mb) / max(1, int(mb["global_loss_tokens"]))
            (loss * world).backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total)
        if rank == 0:
            print(f"step {step + 1} loss {float(total):.4f}", flush=True)
        if (step + 1) % args.save_steps == 0:
            save(args.out, step + 1, model, opt, feeder)
        if (step + 1) % args.eval_steps == 0:
            k = (step + 1) // args.eval_steps - 1
            eval_loss = evaluate(shared, model, k, recorder(args.record, f"eval-rank{rank}.jsonl"))
            if rank == 0:
                print(f"step {step + 1} eval_loss {eval_loss:.4f}", flush=True)
    feeder.close()
    shared.close()
    dist.destroy_process_group()


if __name__ == "__main__":  # the job's workers and megatron-core's writers start by spawn
    main()

"""Train a tiny torchtitan Llama 3 with torchtitan's own Trainer on omniload-dask batches (one GPU).

    python -m omniload_dask.cli demo-data plans/demo-data        # once
    torchrun --nproc-per-node 1 examples/train_torchtitan.py --out runs/titan \\
        --training.steps 30 --checkpoint.interval 5 --validator.freq 5
    # the same with --kill-after-step 15, then again without it: it resumes at step 16

The process starts the job (an embedded Dask cluster), then builds torchtitan's config the way
its users do: a config function (``omniload_debugmodel``, torchtitan's Llama 3 debug model and
training setup with the tokenizer's vocabulary) given to its ``ConfigManager`` with ``--module``
and ``--config``, every other argument a torchtitan override (``--training.steps``,
``--checkpoint.interval``, ``--validator.freq``, ...). The config's ``dataloader`` and its
validator's ``dataloader`` are :class:`OmniloadDataLoader` configs: the training stream, and a
pass over the plan's validation stream (the same batches every time). torchtitan's Trainer
normalises the loss by the step's valid tokens (its gradient accumulation steps are the plan's
micro-batches), checkpoints with DCP (the feeder's position included) every
``--checkpoint.interval`` steps, and resumes from its latest checkpoint in ``--out``.
``--kill-after-step K`` kills the process (SIGKILL) right after the checkpoint of step K.

``--record FILE`` appends one JSON line per event: each micro-batch trained or validated on
(``kind`` train / validation, its step, micro_step and digest), each step's loss and each
validation loss, for ``examples/gpu_check_torchtitan.py`` to compare runs. torchtitan's models
run on CUDA (its device is CUDA whenever no other accelerator is found), so this runs on a GPU;
one DP rank (NCCL puts one rank on a GPU). No download: the model is made from a config and the
tokenizer file is the demo data's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

from omniload_dask import Job, load_plan
from omniload_dask.errors import JobError
from omniload_dask.integrations.torchtitan import OmniloadDataLoader
from omniload_dask.integrations.versions import parse_version
from omniload_dask.internals import comms

PLAN = Path(__file__).parents[1] / "plans" / "tiny_trainers.yaml"
RUN: dict[str, Any] = {}  # what the config function needs from main: the job, plan, paths


def record_line(path: str, line: dict[str, Any]) -> None:
    """Append ``line`` to the record file (a killed run keeps what it wrote)."""
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")


class RecordedLoader(OmniloadDataLoader):
    """The omniload loader, writing each micro-batch's digest to the record file and checking
    that torchtitan takes one step's micro-batches per optimizer step."""

    @dataclass(kw_only=True, slots=True)
    class Config(OmniloadDataLoader.Config):
        record: str = ""
        """The record file (empty: none)."""
        kind: str = "train"
        """``train`` or ``validation``, written with each digest."""
        micro_batches: int = 0
        """torchtitan's gradient accumulation steps; a step of another count is an error."""

    def __init__(self, config: RecordedLoader.Config, **kwargs: Any) -> None:
        super().__init__(config=config, **kwargs)

        def on_batch(mb: dict[str, Any]) -> None:
            count = int(mb["num_micro_steps"])
            if config.micro_batches and count != config.micro_batches:
                raise JobError(
                    f"step {int(mb['step'])} has {count} micro-batches, torchtitan accumulates "
                    f"{config.micro_batches}: set --training.global_batch_size to the plan's"
                )
            digest = hashlib.sha1(
                mb["input_ids"].numpy().tobytes() + mb["labels"].numpy().tobytes()
            )
            line = {
                "kind": config.kind,
                "step": int(mb["step"]),
                "micro_step": int(mb["micro_step"]),
            }
            record_line(config.record, {**line, "digest": digest.hexdigest()})

        self.on_batch = on_batch


def omniload_debugmodel() -> Any:
    """torchtitan's Llama 3 debug config, its data from the job ``main`` started."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    plan, dp = RUN["plan"], RUN["dp"]
    vocab, seq_len = RUN["vocab_size"], plan.batch.seq_len
    micro = plan.batch.global_tokens // (seq_len * dp)  # this DP rank's rows per step
    config = llama3_debugmodel()
    spec = model_registry("debugmodel")  # dim 256, 6 layers, flex attention (document masks)
    model = spec.model
    model.vocab_size = vocab  # the demo tokenizer's vocabulary, not the debug model's 2048
    model.tok_embeddings.num_embeddings = vocab
    model.lm_head.out_features = vocab
    config.model_spec = spec
    config.loss = ChunkedLossWrapper.Config(
        loss_fn=CrossEntropyLoss.Config(global_vocab_size=vocab)
    )
    config.optimizer = default_adamw(lr=3e-3)
    config.hf_assets_path = os.path.dirname(plan.tokenizer.path)  # its tokenizer.json; unused
    config.dump_folder = RUN["out"]
    config.training.seq_len = seq_len
    config.training.local_batch_size = 1  # one packed row per micro-batch
    config.training.global_batch_size = micro * dp  # gradient accumulation = the plan's
    config.training.steps = 30
    config.training.disable_cuda_graphs = True  # the document masks differ batch to batch
    common = {"job": RUN["job"], "address": RUN["address"], "pad_to": seq_len}
    config.dataloader = RecordedLoader.Config(
        **common, record=RUN["record"], kind="train", micro_batches=micro
    )
    config.validator.enable = True
    config.validator.freq = 5
    config.validator.steps = -1  # the whole pass: it ends where the plan's stream does
    config.validator.dataloader = RecordedLoader.Config(
        **common, stream="validation", record=RUN["record"], kind="validation"
    )
    config.checkpoint = CheckpointManager.Config(
        enable=True, interval=5, last_save_model_only=False, keep_latest_k=0
    )
    return config


def hook(trainer: Any, record: str, kill_after: int | None) -> None:
    """Record torchtitan's logged losses; kill the process after the checkpoint of a step."""
    metrics, checkpointer = trainer.metrics_processor, trainer.checkpointer
    log, log_validation, save = metrics.log, metrics.log_validation, checkpointer.save
    load = checkpointer.load

    def on_load(*args: Any, **kwargs: Any) -> Any:
        out = load(*args, **kwargs)
        record_line(record, {"kind": "start", "step": int(trainer.step)})  # resumed after it
        return out

    def on_log(step: int, loss: float, *args: Any, **kwargs: Any) -> None:
        record_line(record, {"kind": "loss", "step": int(step), "loss": float(loss)})
        print(f"step {step} loss {float(loss):.4f}", flush=True)
        log(step, loss, *args, **kwargs)

    def on_validation(loss: float, step: int, **kwargs: Any) -> None:
        record_line(record, {"kind": "val_loss", "step": int(step), "loss": float(loss)})
        print(f"step {step} eval_loss {float(loss):.4f}", flush=True)
        log_validation(loss=loss, step=step, **kwargs)

    def on_save(curr_step: int, *args: Any, **kwargs: Any) -> None:
        save(curr_step, *args, **kwargs)
        if kill_after is not None and curr_step == kill_after:
            record_line(record, {"kind": "killed", "step": curr_step})
            print(f"killing the run after the checkpoint of step {curr_step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    metrics.log, metrics.log_validation = on_log, on_validation
    checkpointer.save, checkpointer.load = on_save, on_load


def v02_config(overrides: list[str]) -> tuple[Any, Callable[[], Any]]:
    """torchtitan 0.2's job config and its Trainer's maker: a registered train spec and a TOML
    job config (``examples/torchtitan_v02.py``); the loaders are the same recorded ones."""
    from torchtitan.train import Trainer
    from torchtitan_v02 import job_config, register

    plan, dp = RUN["plan"], RUN["dp"]
    micro = plan.batch.global_tokens // (plan.batch.seq_len * dp)

    def loader_config(kind: str, stream: str | None) -> RecordedLoader.Config:
        return RecordedLoader.Config(
            job=RUN["job"],
            address=RUN["address"],
            pad_to=plan.batch.seq_len,
            stream=stream,
            record=RUN["record"],
            kind=kind,
            micro_batches=micro if kind == "train" else 0,
        )

    register(RUN, loader_config, RecordedLoader)
    config = job_config(RUN, overrides)
    return config, lambda: Trainer(config)


def last_checkpoint_step(folder: Path) -> int:
    """The step of torchtitan's latest complete checkpoint in ``folder`` (0: none).

    A job started afresh begins its stream at its ``start_step``, so a resumed run starts its
    job at the step torchtitan resumes from (one stream step per optimizer step: the recorded
    loader checks it); the loader's saved position then continues exactly there."""
    steps = [
        int(path.name.split("-", 1)[1])
        for path in folder.glob("step-*")
        if (path / ".metadata").exists() and path.name.split("-", 1)[1].isdigit()
    ]
    return max(steps, default=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--plan", default=str(PLAN))
    parser.add_argument("--out", default="runs/titan", help="torchtitan's dump folder")
    parser.add_argument("--record", default="", help="a JSON-lines file of batches and losses")
    parser.add_argument("--kill-after-step", type=int, default=None)
    args, overrides = parser.parse_known_args()
    dp = int(os.environ.get("WORLD_SIZE", "1"))
    if dp != 1:
        raise SystemExit("this example trains one DP rank: torchrun --nproc-per-node 1")
    plan = load_plan(args.plan)
    import torch
    from torchtitan.tools.logging import init_logger

    init_logger()
    start = last_checkpoint_step(Path(args.out) / "checkpoint")
    with Job.start(plan, dp=dp, dashboard_address=None, start_step=start) as job:
        RUN.update(
            plan=plan,
            dp=dp,
            out=args.out,
            record=args.record,
            job=job.name,
            address=comms.scheduler_address(job.client),
            vocab_size=int(job.info["tokenizer"]["vocab_size"]),
            eos_id=job.info["tokenizer"]["eos_id"],
        )
        if parse_version(version("torchtitan")) < (0, 3):
            config, build = v02_config(overrides)
        else:  # torchtitan's own entry: a config function named by --module/--config
            from torchtitan.config import ConfigManager

            argv = ["--module", "__main__", "--config", "omniload_debugmodel", *overrides]
            config = ConfigManager().parse_args(argv)
            build = config.build
        every = config.checkpoint.interval
        if args.kill_after_step is not None and args.kill_after_step % every:
            raise SystemExit(f"--kill-after-step must be a checkpoint step (every {every})")
        trainer = build()
        hook(trainer, args.record, args.kill_after_step)
        try:
            trainer.train()
        finally:
            trainer.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":  # the embedded cluster starts its workers as new processes (spawn)
    main()

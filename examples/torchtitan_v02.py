"""The torchtitan 0.2 path of ``examples/train_torchtitan.py``: a train spec, a TOML job config.

torchtitan 0.2 has no config classes for loaders: a model is named by a registered
``TrainSpec`` whose ``build_dataloader_fn(dp_world_size, dp_rank, tokenizer, job_config)``
makes the training loader and whose ``build_validator_fn`` makes the validator, and the job is
a ``JobConfig`` from its ``ConfigManager`` (a TOML file, then ``--section.field`` overrides).
So this registers ``omniload_llama3``: torchtitan's Llama 3 spec with the tokenizer's
vocabulary, the omniload loader, and a validator whose loader is one pass over the plan's
validation stream each time it is iterated (0.2 builds the validator's loader once and iterates
it at every validation). Packed documents are kept apart by flex attention's block-causal mask,
which torchtitan 0.2 draws at the tokenizer's EOS token (the plan's ``eos``, ending every
document); ``--model.flavor debugmodel`` trains with plain causal SDPA instead.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from omniload_dask.integrations.torchtitan import OmniloadDataLoader

SPEC = "omniload_llama3"


def register(run: dict[str, Any], loader_config: Callable[..., Any], loader_cls: type) -> None:
    """Register the ``omniload_llama3`` train spec over the job in ``run``.

    ``loader_config(kind=..., stream=...)`` gives a loader config, ``loader_cls`` builds from it.
    """
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.components.validate import Validator
    from torchtitan.models.llama3 import get_train_spec, llama3_args
    from torchtitan.protocols.train_spec import register_train_spec

    class ValidationPasses(BaseDataLoader):
        """Each iteration is a fresh pass over the validation stream (the same batches)."""

        def __init__(self, dp_rank: int, dp_world_size: int) -> None:
            self.dp_rank, self.dp_world_size = dp_rank, dp_world_size

        def __iter__(self) -> Iterator[Any]:
            config = loader_config(kind="validation", stream="validation")
            yield from loader_cls(
                config=config, dp_rank=self.dp_rank, dp_world_size=self.dp_world_size
            )

        def state_dict(self) -> dict[str, Any]:
            return {}  # a pass always starts at the stream's beginning

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            pass

    class OmniloadValidator(Validator):
        """torchtitan's validator with the omniload validation loader (no HF dataset)."""

        def __init__(self, **kw: Any) -> None:
            self.job_config, self.tokenizer = kw["job_config"], kw["tokenizer"]
            self.parallel_dims, self.loss_fn = kw["parallel_dims"], kw["loss_fn"]
            self.validation_dataloader = ValidationPasses(kw["dp_rank"], kw["dp_world_size"])
            self.validation_context = kw["validation_context"]
            self.maybe_enable_amp = kw["maybe_enable_amp"]
            self.metrics_processor = kw["metrics_processor"]
            self.pp_schedule = kw.get("pp_schedule")
            self.pp_has_first_stage = kw.get("pp_has_first_stage")
            self.pp_has_last_stage = kw.get("pp_has_last_stage")

    def build_tokenizer(job_config: Any) -> Any:
        tokenizer = HuggingFaceTokenizer(job_config.model.hf_assets_path)
        tokenizer.eos_id = run["eos_id"]  # the plan's eos: flex attention's document ends
        return tokenizer

    def build_dataloader(
        dp_world_size: int, dp_rank: int, tokenizer: Any, job_config: Any
    ) -> OmniloadDataLoader:
        config = loader_config(kind="train", stream=None)
        loader: OmniloadDataLoader = loader_cls(
            config=config, dp_rank=dp_rank, dp_world_size=dp_world_size
        )
        return loader

    base = get_train_spec()
    args = {
        name: replace(copy.deepcopy(llama3_args[name]), vocab_size=run["vocab_size"])
        for name in ("debugmodel", "debugmodel_flex_attn")
    }
    spec = replace(
        base,
        model_args=args,
        build_tokenizer_fn=build_tokenizer,
        build_dataloader_fn=build_dataloader,
        build_validator_fn=lambda **kw: OmniloadValidator(**kw),
    )
    register_train_spec(SPEC, spec)


def job_config(run: dict[str, Any], overrides: list[str]) -> Any:
    """torchtitan's ``JobConfig``: a TOML file of this example's setup, then ``overrides``.

    The model's initial weights come from the plan's seed (``debug.seed``), so two runs start
    alike and their losses after a resume can be compared, not only their batches."""
    from torchtitan.config import ConfigManager

    plan, dp, out = run["plan"], run["dp"], Path(run["out"])
    seq_len = plan.batch.seq_len
    micro = plan.batch.global_tokens // (seq_len * dp)  # this DP rank's rows per step
    assets = os.path.dirname(os.path.abspath(plan.tokenizer.path))
    toml = f"""
[job]
dump_folder = "{out.resolve()}"
[model]
name = "{SPEC}"
flavor = "debugmodel_flex_attn"
hf_assets_path = "{assets}"
[optimizer]
lr = 3e-3
[lr_scheduler]
warmup_steps = 2
[training]
seq_len = {seq_len}
local_batch_size = 1
global_batch_size = {micro * dp}
steps = 30
[metrics]
log_freq = 1
[parallelism]
data_parallel_shard_degree = {dp}
[checkpoint]
enable = true
interval = 5
last_save_model_only = false
keep_latest_k = 0
[validation]
enable = true
freq = 5
steps = -1
[debug]
seed = {plan.seed}
"""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "omniload_llama3.toml"
    path.write_text(toml)
    return ConfigManager().parse_args(["--job.config_file", str(path), *overrides])

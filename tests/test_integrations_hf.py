from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import json

import torch

from omniload_dask.errors import JobError
from tests.trainer_runs import eval_losses, losses, recorded, torchrun, uninterrupted

pytestmark = pytest.mark.slow


def test_hf_example_trains_is_killed_and_resumes_with_every_ranks_stream_exact(tmp_path):
    from omniload_dask.demo import make_demo_data
    from tests.trainer_runs import REPO

    make_demo_data(REPO / "plans" / "demo-data")
    out, first, second = tmp_path / "out", tmp_path / "rec1", tmp_path / "rec2"
    common = ["--out", str(out), "--steps", "5", "--save-steps", "2"]
    killed = torchrun("train_hf.py", *common, "--record", str(first), "--kill-after-step", "2")
    assert killed.returncode != 0, killed.stdout[-2000:]  # rank 0 was killed
    assert "killing rank 0 after step 2" in killed.stdout, killed.stderr[-3000:]
    assert (out / "checkpoint-2" / "omniload-rank1.json").exists()
    resumed = torchrun("train_hf.py", *common, "--record", str(second), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    before, after, reference = recorded(first), recorded(second), uninterrupted(5)
    for rank in (0, 1):
        trained = [b for b in before[rank] if b[0] < 2]  # steps 0 and 1 were trained
        assert trained == reference[rank][: len(trained)] and len(trained) == 4
        assert after[rank] == reference[rank][4:]  # steps 2, 3, 4: none skipped or repeated
    all_losses = losses(killed.stdout) + losses(resumed.stdout)
    assert len(all_losses) == 5
    assert all_losses[-1] < all_losses[0]
    # an evaluation at step 2 before the kill, one at step 4 after the resume: the same pass
    assert eval_losses(killed.stdout) and eval_losses(resumed.stdout), killed.stdout[-2000:]
    for rank in (0, 1):
        evals, again = (
            recorded(first, name="eval-rank")[rank],
            recorded(second, name="eval-rank")[rank],
        )
        assert evals and again and again == evals * (len(again) // len(evals))


def test_hf_batch_gives_a_llama_the_padding_free_fields_and_its_loss_matches_per_document():
    from transformers import LlamaConfig, LlamaForCausalLM

    from omniload_dask.integrations.hf import hf_batch

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=50,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    ).eval()
    docs = [torch.randint(0, 50, (n,)) for n in (5, 9, 3)]
    ids = torch.cat(docs)
    labels = torch.cat([torch.cat([d[1:], torch.tensor([-100])]) for d in docs])
    mb = {
        "input_ids": ids,
        "labels": labels,
        "position_ids": torch.cat([torch.arange(len(d)) for d in docs]),
        "cu_seqlens": torch.tensor([0, 5, 14, 17], dtype=torch.int32),
        "max_seqlen": 9,
    }
    batch = hf_batch(mb)
    assert batch["cu_seq_lens_q"].dtype == torch.int32 and batch["max_length_k"] == 9
    packed = model(**batch).loss
    per_doc = [model(input_ids=d[None], labels=d[None]).loss * (len(d) - 1) for d in docs]
    assert torch.allclose(packed, sum(per_doc) / (len(ids) - 3), atol=1e-5)


def test_hf_batch_refuses_a_cp_slice():
    from omniload_dask.integrations.hf import hf_batch

    with pytest.raises(JobError, match="cp=1"):
        hf_batch({"cp_size": 2})


def test_an_unsupported_framework_version_is_a_clear_error_naming_the_range():
    from omniload_dask.integrations.versions import require

    with pytest.raises(JobError, match=r"transformers 3\.9\.0 is not supported.*>= 4\.56, < 6"):
        require("transformers", "4.56", "6", version="3.9.0")
    with pytest.raises(JobError, match="not installed"):
        require("no-such-framework-xyz", "1", "2")


def test_trainer_evaluate_reads_a_validation_pass_and_two_evaluations_agree(tmp_path):
    from distributed import Client
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

    from omniload_dask import Job, local_cluster
    from omniload_dask.integrations.hf import (
        OmniloadEvalIterable,
        OmniloadIterable,
        OmniloadTrainer,
    )
    from tests.datagen import validation_plan

    plan = validation_plan(tmp_path, "hf-eval", {"steps": 2})
    seen: list[int] = []
    with local_cluster(1, dashboard_address=None) as cluster, Client(cluster) as client:
        job = Job.start(plan, client=client)

        def make(k):
            seen.append(k)
            return job.feeder(rank=0, stream="validation", pass_index=k)

        torch.manual_seed(0)
        model = LlamaForCausalLM(
            LlamaConfig(vocab_size=260, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
        )  # fmt: skip
        args = TrainingArguments(
            output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], disable_tqdm=True,
            per_device_eval_batch_size=1, max_steps=1,
        )  # fmt: skip
        trainer = OmniloadTrainer(
            model=model,
            args=args,
            train_dataset=OmniloadIterable(job.feeder(rank=0, max_steps=1)),
            eval_dataset=OmniloadEvalIterable(make),
        )
        first, second = trainer.evaluate(), trainer.evaluate()
        job.stop()
    assert seen == [0, 1]
    assert first["eval_loss"] == second["eval_loss"] and first["eval_loss"] > 0


def test_a_resumed_trainer_goes_on_with_the_validation_rotation(tmp_path):
    from distributed import Client
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

    from omniload_dask import Job, local_cluster
    from omniload_dask.integrations.hf import (
        OmniloadEvalIterable,
        OmniloadIterable,
        OmniloadTrainer,
    )
    from tests.datagen import validation_plan

    plan = validation_plan(tmp_path, "hf-rotation", {"steps": 1, "rotation": 3})
    seen: list[int] = []

    def run(job, steps, resume=None):
        def make(k):
            seen.append(k)
            return job.feeder(rank=0, stream="validation", pass_index=k)

        torch.manual_seed(0)
        model = LlamaForCausalLM(
            LlamaConfig(vocab_size=260, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
        )  # fmt: skip
        args = TrainingArguments(
            output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], disable_tqdm=True,
            per_device_eval_batch_size=1, max_steps=steps, eval_strategy="steps", eval_steps=1,
            save_steps=1, save_only_model=False,
        )  # fmt: skip
        OmniloadTrainer(
            model=model,
            args=args,
            train_dataset=OmniloadIterable(job.feeder(rank=0, max_steps=steps)),
            eval_dataset=OmniloadEvalIterable(make),
        ).train(resume_from_checkpoint=resume)

    with local_cluster(1, dashboard_address=None) as cluster, Client(cluster) as client:
        job = Job.start(plan, client=client)
        run(job, 2)
        assert seen == [0, 1]
        run(job, 3, resume=True)  # from the checkpoint of step 2: the third pass is next
        job.stop()
    assert seen == [0, 1, 2]
    saved = json.loads((tmp_path / "out" / "checkpoint-3" / "omniload-rank0.json").read_text())
    assert saved["eval_passes"] == 3

"""``global_loss_tokens``: every micro-batch carries its step's count of loss tokens over every
DP rank and micro-batch, counted by the dealer from what the read tasks report (the records'
holes), equal to what the ranks' labels hold, also across blocks, cp slices and resume; and
the loss rule it serves, on two gloo processes: a sum of token losses over
``global_loss_tokens`` with gradients summed across DP gives one process's gradients over the
whole global batch, a per-rank mean averaged by DDP does not."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from omniload_dask.batching.formats import IGNORE_INDEX
from omniload_dask.batching.labels import Holes, count_loss_tokens, loss_positions
from omniload_dask.batching.wire import expand
from omniload_dask.plan import parse_plan
from omniload_dask.testing import InlineDataPlane, check_resume_equivalence

from .chatdata import CHATML, conversations, sentence
from .datagen import plan_dict, texts, write_jsonl


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Conversations (JSONL, two files), prompt/completion pairs (Parquet) and plain text."""
    import random

    root = tmp_path_factory.mktemp("sft")
    convs = conversations(80, seed=11)
    (root / "chat").mkdir()
    for part in range(2):
        lines = [json.dumps({"messages": c}) for c in convs[part::2]]
        (root / "chat" / f"{part}.jsonl").write_text("\n".join(lines) + "\n")
    rng = random.Random(4)
    pairs = [(sentence(rng, 3, 40), sentence(rng, 1, 30)) for _ in range(60)]
    (root / "qa").mkdir()
    table = pa.table({"prompt": [p for p, _ in pairs], "completion": [c for _, c in pairs]})
    pq.write_table(table, root / "qa" / "a.parquet", row_group_size=8)
    write_jsonl(root / "web" / "a.jsonl", texts(60, seed=2, mean_words=60))
    return root


def sft_plan(root: Path, train_on: str = "assistant", **overrides: Any) -> Any:
    sources = [
        {"name": "chat", "format": "jsonl", "path": str(root / "chat"), "weight": 2,
         "chat": {"layout": "messages", "train_on": train_on, "template": CHATML}},
        {"name": "qa", "format": "parquet", "path": str(root / "qa"), "weight": 1,
         "chat": {"layout": "prompt_completion"}},
        {"name": "web", "format": "jsonl", "path": str(root / "web"), "weight": 1},
    ]  # fmt: skip
    return parse_plan(plan_dict(sources, on_error="skip", **overrides))


def step_counts(plane: InlineDataPlane, step: int) -> tuple[int, set[int]]:
    """The labels that are not -100 over every rank's micro-batches of ``step`` (each rank
    its own part: a cp slice with context parallelism), and the ``global_loss_tokens`` they
    carry; each micro-batch's ``num_loss_tokens`` checked against its labels."""
    total, carried = 0, set()
    for ref in plane.fetch(step).values():
        for mb in plane.batches[ref].micro_batches:
            labels = expand(mb)["labels"]
            own = int((labels != IGNORE_INDEX).sum())
            assert int(mb["num_loss_tokens"]) == own
            total += own
            carried.add(int(mb["global_loss_tokens"]))
    return total, carried


def test_holes_count_what_the_labels_of_the_pieces_hold() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        lengths = rng.integers(1, 12, int(rng.integers(1, 6)))
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        target = rng.random(int(offsets[-1])) < 0.6
        holes = Holes.of(offsets, target)
        assert holes is not None or target.all()
        if holes is not None:
            back = Holes.from_wire(*holes.to_wire())
            assert np.array_equal(back.bounds, holes.bounds)
            assert np.array_equal(back.spans, holes.spans)
        records = rng.integers(0, len(lengths), 6)
        lo = np.array([rng.integers(0, lengths[r]) for r in records])
        hi = np.array(
            [rng.integers(a + 1, lengths[r] + 1) for a, r in zip(lo, records, strict=True)]
        )
        cu = np.concatenate([[0], np.cumsum(hi - lo)])
        mask = np.concatenate(
            [
                target[offsets[r] + a : offsets[r] + b]
                for r, a, b in zip(records, lo, hi, strict=True)
            ]
        )
        want = int(loss_positions(cu, int(cu[-1]), None, mask).sum())
        assert count_loss_tokens(lo, hi, holes, records) == want
    # a unit read in portions: the portions' holes, records numbered on
    a = Holes.of(np.array([0, 3, 5]), np.array([0, 1, 1, 0, 1], dtype=bool))
    joined = Holes.join([(2, a), (1, None), (2, a)])
    assert joined is not None
    assert joined.bounds.tolist() == [0, 1, 2, 2, 3, 4]
    assert Holes.join([(2, None)]) is None
    assert Holes.of(np.array([0, 4]), np.ones(4, dtype=bool)) is None  # plain text: none


def test_global_loss_tokens_is_the_sum_over_every_rank_and_micro_batch(corpus: Path) -> None:
    from hypothesis import HealthCheck, example, given, settings
    from hypothesis import strategies as st

    @settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        dp=st.integers(1, 4),
        micro=st.integers(1, 3),
        cp=st.integers(1, 2),
        truncate=st.booleans(),
        seq_len=st.sampled_from([128, 384, 2048]),
        train_on=st.sampled_from(["assistant", "all", "last_assistant"]),
        blocks=st.sampled_from([0, 1]),
        parts=st.booleans(),
        seed=st.integers(0, 40),
    )
    # (a budget of one document under truncate; a short split step that holds only prompt tokens)
    @example(dp=1, micro=1, cp=1, truncate=True, seq_len=2048, train_on="assistant", blocks=0,
             parts=False, seed=0)  # fmt: skip
    @example(dp=1, micro=1, cp=1, truncate=False, seq_len=128, train_on="last_assistant",
             blocks=0, parts=False, seed=1)  # fmt: skip
    def check(
        dp: int,
        micro: int,
        cp: int,
        truncate: bool,
        seq_len: int,
        train_on: str,
        blocks: int,
        parts: bool,
        seed: int,
    ) -> None:
        if truncate:
            seq_len = 2048  # (whole conversations: shorter caps skip most of them)
        budget = int(seq_len * micro * dp * (0.8 if truncate else 0.9))
        if truncate:  # (a step must hold one whole document of seq_len tokens)
            budget = max(budget, seq_len)
        batch: dict[str, Any] = {"seq_len": seq_len, "micro_batches": micro}
        batch |= {"global_tokens": budget}
        if truncate:
            batch["long_documents"] = "truncate"
        loader: dict[str, Any] = {"groups_per_task": blocks}  # 1: a block per DP group
        if parts:
            loader["task_seconds"] = 0.5
        plan = sft_plan(corpus, train_on, batch=batch, layout={"dp": dp, "cp": cp},
                        loader=loader, seed=seed)  # fmt: skip
        timing = (lambda read, shard: 0.3 * (len(shard) + shard.skipped)) if parts else None
        plane = InlineDataPlane(plan, timing=timing)
        for step in range(4):
            total, carried = step_counts(plane, step)
            assert carried == {total}, (step, carried, total)
            totals.append(total)

    totals: list[int] = []
    check()
    # A short step may hold only prompt tokens (a count of 0 is right there); the property is
    # not vacuous as long as the examples counted loss tokens at all.
    assert sum(totals) > 0


def test_a_step_built_in_several_blocks_carries_the_whole_steps_count(corpus: Path) -> None:
    plan = sft_plan(
        corpus,
        batch={"seq_len": 256, "micro_batches": 2, "global_tokens": 4 * 2 * 256 - 100},
        layout={"dp": 4},
        loader={"groups_per_task": 1},
    )
    plane = InlineDataPlane(plan)
    for step in range(3):
        total, carried = step_counts(plane, step)
        keys = {ref.rsplit(":", 1)[0] for ref in plane.fetch(step).values()}
        assert len(keys) == 4  # four constructions, none of which saw the whole step
        per_rank = defaultdict(int)
        for rank, ref in plane.fetch(step).items():
            for mb in plane.batches[ref].micro_batches:
                per_rank[rank] += int(mb["num_loss_tokens"])
        assert carried == {total} and max(per_rank.values()) < total


def test_resume_keeps_the_counts(corpus: Path, tmp_path: Path) -> None:
    plan = sft_plan(
        corpus,
        batch={"seq_len": 256, "global_tokens": 900},
        checkpoint={"url": str(tmp_path / "ckpt"), "compact_every": 3},
    )
    assert check_resume_equivalence(plan, 6, [2, 5]) > 0


@pytest.mark.parametrize("cp", [1, 2])
def test_image_placeholders_are_counted_out_of_the_steps_total(tmp_path: Path, cp: int) -> None:
    from .datagen import image_plan, write_image_sources

    root = write_image_sources(tmp_path)
    plan = image_plan(
        root,
        batch={"seq_len": 48, "micro_batches": 4, "global_tokens": 48 * 4 * 2 - 30},
        layout={"dp": 2, "cp": cp},
    )
    plane = InlineDataPlane(plan)
    placeholders = 0
    for step in range(3):
        total, carried = step_counts(plane, step)
        assert carried == {total}
        for batch in plane.step(step).values():
            for mb in batch.micro_batches:
                placeholders += int((mb["image_token_map"] >= 0).sum())
    assert placeholders > 0  # (the count had image tokens to leave out)


@pytest.mark.parametrize("where", ["loop", "process"])
def test_a_job_on_a_cluster_hands_every_rank_the_steps_count(
    corpus: Path, where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from omniload_dask import Job
    from omniload_dask.cluster import dealing
    from omniload_dask.testing import assert_batches_equal

    if where == "process":  # the dealing process counts from the holes it is sent
        monkeypatch.setattr(dealing, "INLINE_MS", -1.0)
        monkeypatch.setattr(dealing, "PROCESS_MIN_GROUPS", 1)

    plan = sft_plan(
        corpus,
        name="loss-tokens",
        batch={"seq_len": 2048, "micro_batches": 2, "global_tokens": 6000,
               "long_documents": "truncate"},
        layout={"dp": 2},
    )  # fmt: skip
    plane = InlineDataPlane(plan)
    with Job.start(plan, workers=1, dashboard_address=None) as job:
        for rank in range(2):
            with job.feeder(rank=rank, max_steps=3, output="numpy") as feeder:
                for mb in feeder:
                    want = plane.step(int(mb["step"]))[rank].micro_batches[int(mb["micro_step"])]
                    got = {k: v for k, v in mb.items() if k != "doc_source_name"}
                    assert_batches_equal(want, got)  # (global_loss_tokens among the fields)
        assert job.stats()["planning_in"] == ("process" if where == "process" else "thread")
    for step in range(3):
        total, carried = step_counts(plane, step)
        assert carried == {total}


# -- the loss rule: two processes (gloo) against one process over the same global batch --


def _model(vocab: int) -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(vocab, 8), torch.nn.Linear(8, vocab)).double()


def _loss_sum(model: Any, mb: dict[str, Any]) -> Any:
    """The sum of a micro-batch's token losses (its labels that are not -100)."""
    import torch

    logits = model(torch.as_tensor(mb["input_ids"]))
    labels = torch.as_tensor(mb["labels"])
    return torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")


def _grads(model: Any) -> list[Any]:
    return [p.grad.detach().clone() for p in model.parameters()]


def _train_rank(rank: int, world: int, folder: str) -> None:
    """One DP rank: its micro-batches of the step, both rules; rank 0 saves the gradients."""
    import pickle

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world
    )
    vocab, ranks = pickle.loads(Path(folder, "batches.pkl").read_bytes())
    mine = ranks[rank]
    out = {}
    # the rule: sum of token losses / global_loss_tokens, gradients summed across DP
    model = _model(vocab)
    for mb in mine:
        (_loss_sum(model, mb) / int(mb["global_loss_tokens"])).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
    out["global"] = _grads(model)
    # the bias: a mean over the rank's own tokens, then DDP's average of the ranks
    model = _model(vocab)
    own = sum(int(mb["num_loss_tokens"]) for mb in mine)
    for mb in mine:
        (_loss_sum(model, mb) / own).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        p.grad /= world
    out["per_rank"] = _grads(model)
    if rank == 0:
        torch.save(out, Path(folder, "grads.pt"))
    dist.destroy_process_group()


def test_gradients_on_two_ranks_equal_one_process_over_the_global_batch(
    corpus: Path, tmp_path: Path
) -> None:
    import pickle

    import torch
    import torch.multiprocessing as mp

    from omniload_dask import Job

    plan = sft_plan(
        corpus,
        name="loss-rule",
        batch={"seq_len": 2048, "micro_batches": 2, "global_tokens": 6000,
               "long_documents": "truncate"},
        layout={"dp": 2},
    )  # fmt: skip
    with Job.start(plan, workers=1, dashboard_address=None) as job:
        vocab = int(job.info["tokenizer"]["vocab_size"])
        ranks = []
        for rank in range(2):
            with job.feeder(rank=rank, max_steps=1, output="numpy") as feeder:
                ranks.append([dict(mb) for mb in feeder])
    tokens = [int(mb["num_loss_tokens"]) for mine in ranks for mb in mine]
    per_rank = [sum(int(mb["num_loss_tokens"]) for mb in mine) for mine in ranks]
    assert len(set(tokens)) == len(tokens) and per_rank[0] != per_rank[1]  # (unequal counts)
    assert {int(mb["global_loss_tokens"]) for mine in ranks for mb in mine} == {sum(tokens)}
    (tmp_path / "batches.pkl").write_bytes(pickle.dumps((vocab, ranks)))

    context = mp.start_processes(
        _train_rank, args=(2, str(tmp_path)), nprocs=2, join=False, start_method="spawn"
    )
    for _ in range(240):  # (bounded: 120 s)
        if context.join(timeout=0.5):
            break
    else:
        for process in context.processes:
            process.kill()
        pytest.fail("the two gloo ranks did not finish")
    got = torch.load(tmp_path / "grads.pt")

    model = _model(vocab)  # one process, the whole global batch, mean over all its targets
    for mine in ranks:
        for mb in mine:
            (_loss_sum(model, mb) / sum(tokens)).backward()
    want = _grads(model)
    for a, b in zip(got["global"], want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    assert not all(
        torch.allclose(a, b, rtol=1e-6, atol=0) for a, b in zip(got["per_rank"], want, strict=True)
    )

"""``batch.pack_pool`` with ``batch.buckets``: each bucket packed from the window on its own.

Every document is delivered once and whole until the pool drains, no step holds more
micro-batches of a bucket than the plan declares, every bucket's head is placed, a resume from
any step gives the uninterrupted stream, and each bucket's micro-batches hold no more padding
than the in-order draw's on the same data."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from omniload_dask.errors import PlanError
from omniload_dask.plan import Plan
from omniload_dask.plan.parse import parse_plan
from omniload_dask.testing import InlineDataPlane, check_resume_equivalence

from .datagen import plan_dict, read_records, write_jsonl
from .test_pack_pool import plan_checkpoint, resumes_as_inline, steps_until_end

hypothesis = pytest.importorskip("hypothesis")

WORDS = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta", "iota", "kappa"]
# dp 2: 1024 tokens of short micro-batches and 2048 of long ones a step (or twice that)
SMALL = [{"seq_len": 256, "micro_batches": 2}, {"seq_len": 1024, "micro_batches": 1}]
LARGE = [{"seq_len": 256, "micro_batches": 4}, {"seq_len": 1024, "micro_batches": 2}]


def _texts(n: int, seed: int, median: float, sigma: float, prefix: str) -> list[str]:
    """Documents of log-normal word counts (chat turns and longer answers alike)."""
    rng = np.random.default_rng(seed)
    words = np.maximum(1, rng.lognormal(np.log(median), sigma, n).astype(int))
    return [
        f"{prefix}{i} " + " ".join(WORDS[j] for j in rng.integers(0, 10, k))
        for i, k in enumerate(words.tolist())
    ]


@pytest.fixture
def mixed_lengths(tmp_path: Path) -> Path:
    """Two sources: short documents (most under 256 bytes) and long ones (most over)."""
    write_jsonl(tmp_path / "chat" / "a.jsonl", _texts(300, 1, 25, 0.7, "c"))
    write_jsonl(tmp_path / "docs" / "b.jsonl", _texts(150, 2, 110, 0.5, "d"))
    return tmp_path


def _plan(root: Path, pool: int, buckets: list[dict[str, Any]], **batch: Any) -> Plan:
    sources = [
        {"name": n, "format": "jsonl", "path": str(root / n / "*.jsonl"), "unit_bytes": 8192}
        for n in ("chat", "docs")
    ]
    plan = plan_dict(sources, layout={"dp": 2})
    plan["batch"] = {"buckets": buckets, "long_documents": "truncate", "pack_pool": pool, **batch}
    return parse_plan(plan)


def _run(plan: Plan, steps: int) -> tuple[Counter[Any], dict[int, float], int]:
    """Pieces (source, id, offset, tokens) delivered in up to ``steps`` steps (fewer where the
    stream ends), the padding share of each bucket's micro-batches (by seq_len), and the steps
    run; every rank's step has each bucket's declared micro-batches, none over its seq_len."""
    declared = Counter({b.seq_len: b.micro_batches for b in plan.batch.buckets})
    plane = InlineDataPlane(plan)
    pieces: Counter[Any] = Counter()
    empty: Counter[int] = Counter()
    capacity: Counter[int] = Counter()
    ran = 0
    for t, batches in steps_until_end(plane, steps):
        ran += 1
        for batch in batches.values():
            seq_lens = [int(mb["seq_len"]) for mb in batch.micro_batches]
            if plan.batch.pack_pool:
                assert Counter(seq_lens) == declared, (t, seq_lens)
            for mb, seq_len in zip(batch.micro_batches, seq_lens, strict=True):
                sizes = np.diff(mb["cu_seqlens"]).tolist()
                pieces.update(zip(mb["doc_source"].tolist(), mb["doc_id"].tolist(),
                                  mb["doc_offset"].tolist(), sizes, strict=True))  # fmt: skip
                used = int(mb["cu_seqlens"][-1])
                assert used <= seq_len
                capacity[seq_len] += seq_len
                empty[seq_len] += seq_len - used
    return pieces, {s: empty[s] / capacity[s] for s in sorted(capacity)}, ran


def test_a_pool_with_buckets_parses_and_a_part_under_seq_len_is_refused(
    mixed_lengths: Path,
) -> None:
    plan = _plan(mixed_lengths, 16, SMALL)
    assert plan.batch.pack_pool == 16 and len(plan.batch.buckets) == 2
    shares = [{"seq_len": 256, "share": 0.25}, {"seq_len": 1024, "share": 0.75}]
    assert _plan(mixed_lengths, 16, shares, global_tokens=4096).batch.pack_pool == 16
    # a budget whose part for the long bucket (0.1 x 4096) is under its seq_len
    shares = [{"seq_len": 256, "share": 0.9}, {"seq_len": 1024, "share": 0.1}]
    with pytest.raises(PlanError, match=r"batch\.pack_pool.*batch\.buckets\[1\] gets 409"):
        _plan(mixed_lengths, 16, shares, global_tokens=4096)
    with pytest.raises(PlanError, match=r"batch\.pack_pool.*needs whole documents"):
        _plan(mixed_lengths, 16, SMALL, long_documents="split")


@pytest.mark.parametrize(("buckets", "pool", "fill"), [(SMALL, 16, 1.0), (LARGE, 48, 0.85)])
def test_every_document_once_and_whole_in_its_buckets_declared_micro_batches(
    mixed_lengths: Path, buckets: list[dict[str, Any]], pool: int, fill: float
) -> None:
    capacity = 2 * sum(b["seq_len"] * b["micro_batches"] for b in buckets)
    plan = _plan(mixed_lengths, pool, buckets, global_tokens=int(fill * capacity))
    plan = replace(plan, sources=type(plan.sources)(replace(s, epochs=1) for s in plan.sources))
    cap = {i: plan.batch.document_cap_for(s.name) for i, s in enumerate(plan.sources)}
    full = {(i, sid): min(len(tokens), cap[i]) for i, sid, tokens in read_records(plan)}
    pieces, _, ran = _run(plan, 400)
    assert ran < 400  # the stream ended: every source ran out and the pool drained
    seen = Counter((s, sid) for s, sid, _, _ in pieces.elements())
    assert set(seen) == set(full)  # nothing lost
    assert max(seen.values()) == 1  # nothing repeated
    for source, sid, offset, n in pieces:
        assert offset == 0 and n == full[(source, sid)]  # nothing cut


def test_each_buckets_padding_is_at_most_the_in_order_draws(mixed_lengths: Path) -> None:
    better = 0
    for buckets in (SMALL, LARGE):
        _, pooled, _ = _run(_plan(mixed_lengths, 32, buckets), 40)
        _, in_order, _ = _run(_plan(mixed_lengths, 0, buckets), 40)
        for seq_len in (256, 1024):
            assert pooled[seq_len] <= in_order[seq_len], (buckets, pooled, in_order)
            better += pooled[seq_len] < in_order[seq_len]
    assert better  # (so the comparison can fail: the pool packs tighter)


def test_every_buckets_head_is_placed_and_the_balancer_packs_the_step_as_drawn() -> None:
    """Each bucket's head fits its micro-batches and is placed; the step stays within its
    budget and its buckets' micro-batches; and the balancer, given the step's documents in
    the order the draw committed them, needs no micro-batch beyond those declared."""
    from hypothesis import example, given, settings
    from hypothesis import strategies as st

    from omniload_dask.core.dealer import StepDealer
    from omniload_dask.core.pool_buckets import BucketPool, pack_buckets

    @settings(max_examples=100, deadline=None)
    @given(
        dp=st.integers(1, 3),
        micro=st.tuples(st.integers(1, 3), st.integers(1, 2)),
        fill=st.sampled_from([0.7, 0.9, 1.0]),
        window=st.lists(st.integers(1, 256), min_size=1, max_size=24),
    )
    # (a step that the balancer packs into the declared micro-batches only in the drawn order)
    @example(dp=3, micro=(1, 1), fill=1.0, window=[3, 9, 9, 17, 53, 65, 1, 30, 62])
    def check(dp: int, micro: tuple[int, int], fill: float, window: list[int]) -> None:
        seqs = (64, 256)
        capacity = dp * (micro[0] * seqs[0] + micro[1] * seqs[1])
        raw = plan_dict([{"name": "a", "format": "jsonl", "path": "x.jsonl"}], layout={"dp": dp})
        raw["batch"] = {
            "buckets": [
                {"seq_len": s, "micro_batches": m} for s, m in zip(seqs, micro, strict=True)
            ],
            "global_tokens": int(fill * capacity),
            "long_documents": "truncate",
            "pack_pool": 8,
        }
        try:
            plan = parse_plan(raw)
        except PlanError:  # (a budget or a part under a seq_len: refused at parse time)
            return
        pool = BucketPool.of(plan.batch, dp, plan.source_names)
        lengths = np.array(window, dtype=np.int64)
        placed, head = pack_buckets(lengths, np.zeros(len(lengths), np.int64), pool)
        assert placed[head].all()
        assert head[0] and int(lengths[placed].sum()) <= pool.budget
        short = lengths <= seqs[0]
        for mine, b in ((short, 0), (~short, 1)):
            assert int(lengths[placed & mine].sum()) <= pool.bins[b] * seqs[b]
        # the step as committed: the heads first, then the others, each in mix order
        step = np.concatenate([lengths[placed & head], lengths[placed & ~head]])
        split = StepDealer(plan).assign(np.zeros(len(step), np.int64), step, None, 0,
                                        int((placed & head).sum()))  # fmt: skip
        assert len(split.micro_capacity) == sum(micro)

    check()


def test_resume_at_any_step_equals_the_uninterrupted_stream(
    mixed_lengths: Path, tmp_path: Path
) -> None:
    for i, (buckets, together) in enumerate(((SMALL, 1), (LARGE, 3))):
        plan = _plan(mixed_lengths, 32, buckets)
        plan = replace(plan, checkpoint=plan_checkpoint(str(tmp_path / f"ckpt-{i}")))
        assert _held(plan, 10)  # documents wait across the restored steps
        assert check_resume_equivalence(plan, 10, [1, 4, 7], together=together) > 0


def _held(plan: Plan, steps: int) -> int:
    """Steps after which some source's checkpointed cursor holds holes (a document waits)."""
    plane = InlineDataPlane(replace(plan, checkpoint=None))
    held = 0
    for t in range(steps):
        plane.step(t)
        state = plane.coord.state_dict()
        held += any(len(s["state"]) > 10 for s in state["sources"])
    return held


def test_a_job_with_a_pool_and_buckets_resumes_exactly_on_a_real_cluster(
    mixed_lengths: Path, tmp_path: Path
) -> None:
    plan = _plan(mixed_lengths, 32, SMALL)
    assert _held(plan, 5)
    resumes_as_inline(plan, str(tmp_path / "ckpt"))

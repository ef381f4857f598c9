"""``batch.pack_pool``: a draw that lets whole documents wait for a later step.

Every document is delivered once and whole until the sources run out (the pool drains), a
resume from any step gives the uninterrupted stream, and the step's micro-batches hold no
more padding than the in-order draw's on the same data."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from omniload_dask import Job
from omniload_dask.errors import PlanError
from omniload_dask.plan import Plan
from omniload_dask.testing import InlineDataPlane, check_resume_equivalence

from .conftest import make_plan
from .datagen import read_records

hypothesis = pytest.importorskip("hypothesis")


def _plan(root: Path, pool: int, **batch: Any) -> Plan:
    shape = {"seq_len": 256, "micro_batches": 2, "long_documents": "truncate"}
    shape.update(batch)
    shape.setdefault("global_tokens", 2 * shape["seq_len"] * shape["micro_batches"])
    return make_plan(root, batch={**shape, "pack_pool": pool}, layout={"dp": 2})


def _records(plan: Plan) -> dict[tuple[int, int], int]:
    """Tokens of every record (capped at the plan's cap), by (source, sample id)."""
    cap = plan.batch.document_cap
    return {(i, sid): min(len(tokens), cap) for i, sid, tokens in read_records(plan)}


def steps_until_end(plane: InlineDataPlane, steps: int) -> Iterator[tuple[int, Any]]:
    """``(t, its batches)`` of ``plane``'s steps ``0..steps-1``, up to where its stream ends."""
    for t in range(steps):
        if plane.coord.view.end_step is not None and t >= plane.coord.view.end_step:
            return
        try:
            batches = plane.step(t)
        except RuntimeError:  # (the stream ended at t)
            return
        yield t, batches


def _run(plan: Plan, steps: int) -> tuple[Counter[Any], float, int]:
    """Pieces (source, id, offset, tokens) delivered in up to ``steps`` steps (fewer where the
    stream ends), the padding share of their micro-batches, and the steps run."""
    plane = InlineDataPlane(plan)
    pieces: Counter[Any] = Counter()
    empty = capacity = ran = 0
    for _t, batches in steps_until_end(plane, steps):
        ran += 1
        for batch in batches.values():
            for mb in batch.micro_batches:
                sizes = np.diff(mb["cu_seqlens"]).tolist()
                pieces.update(zip(mb["doc_source"].tolist(), mb["doc_id"].tolist(),
                                  mb["doc_offset"].tolist(), sizes, strict=True))  # fmt: skip
                capacity += plan.batch.seq_len
                empty += plan.batch.seq_len - int(mb["cu_seqlens"][-1])
    return pieces, empty / max(capacity, 1), ran


def test_every_document_once_and_whole_until_the_pool_drains(small_sources: Path) -> None:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    @settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        seq_len=st.sampled_from([256, 384]),
        micro=st.integers(1, 2),
        pool=st.sampled_from([1, 8, 40]),
        fill=st.sampled_from([0.8, 1.0]),
        seed=st.integers(0, 50),
    )
    def check(seq_len: int, micro: int, pool: int, fill: float, seed: int) -> None:
        plan = _plan(small_sources, pool, seq_len=seq_len, micro_batches=micro,
                     global_tokens=int(fill * 2 * seq_len * micro))  # fmt: skip
        plan = replace(plan, seed=seed, sources=type(plan.sources)(
            replace(s, epochs=1) for s in plan.sources))  # fmt: skip
        full = _records(plan)
        pieces, _, ran = _run(plan, 400)
        assert ran < 400  # the stream ended: every source ran out and the pool drained
        seen = Counter((s, sid) for s, sid, _, _ in pieces.elements())
        assert set(seen) == set(full)  # nothing lost
        assert max(seen.values()) == 1  # nothing repeated
        for source, sid, offset, n in pieces:
            assert offset == 0 and n == full[(source, sid)]  # nothing cut

    check()


def test_resume_at_any_step_equals_the_uninterrupted_stream(
    small_sources: Path, tmp_path: Path
) -> None:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    runs = iter(range(1000))

    @settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        pool=st.sampled_from([24, 40]), micro=st.integers(1, 2), together=st.sampled_from([1, 3])
    )
    def check(pool: int, micro: int, together: int) -> None:
        url = str(tmp_path / f"ckpt-{next(runs)}")
        plan = _plan(small_sources, pool, micro_batches=micro)
        plan = replace(plan, checkpoint=plan_checkpoint(url))
        assert _steps_with_holes(plan, 10) > 0  # documents wait across the restored steps
        assert check_resume_equivalence(plan, 10, [1, 4, 7], together=together) > 0

    check()


def _steps_with_holes(plan: Plan, steps: int) -> int:
    """Steps after which some source's checkpointed cursor holds holes (a document waits)."""
    plane = InlineDataPlane(replace(plan, checkpoint=None))
    held = 0
    for t in range(steps):
        plane.step(t)
        state = plane.coord.state_dict()
        held += any(len(s["state"]) > 10 for s in state["sources"])
    return held


def plan_checkpoint(url: str) -> Any:
    """The checkpoint spec of a plan that names ``url``."""
    return make_plan(Path("."), checkpoint={"url": url}).checkpoint


def test_the_oldest_half_budget_is_always_placed_so_no_document_waits_long() -> None:
    """The head of a window (its oldest documents within half the budget) always fits, so
    each step's window moves on by about half a budget and a document waits a few steps."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from omniload_dask.core.pool import HEAD, pack_window

    @settings(max_examples=100, deadline=None)
    @given(
        bins=st.integers(1, 8),
        capacity=st.integers(8, 64),
        fill=st.floats(0.5, 1.0),
        data=st.data(),
    )
    def check(bins: int, capacity: int, fill: float, data: Any) -> None:
        budget = max(capacity, int(fill * bins * capacity))
        sizes = st.integers(1, capacity)
        lengths = np.array(data.draw(st.lists(sizes, min_size=1, max_size=60)), dtype=np.int64)
        placed = pack_window(lengths, bins, capacity, budget)
        head = max(1, int(np.searchsorted(lengths.cumsum(), HEAD * budget, side="right")))
        assert placed[:head].all()
        assert int(lengths[placed].sum()) <= budget

    check()


def test_padding_is_at_most_the_in_order_draws(small_sources: Path) -> None:
    for micro, fill in ((1, 1.0), (2, 1.0), (2, 0.9)):
        shape = {"micro_batches": micro, "global_tokens": int(fill * 2 * 256 * micro)}
        _, pooled, _ = _run(_plan(small_sources, 24, **shape), 12)
        _, in_order, _ = _run(_plan(small_sources, 0, **shape), 12)
        assert pooled <= in_order, (micro, fill, pooled, in_order)
    assert pooled < in_order  # (so the comparison can fail: the pool packs tighter)


def test_bad_pool_values_are_refused_at_parse_time(small_sources: Path) -> None:
    cases = [
        ({"pack_pool": -1}, "must be >= 0"),
        ({"pack_pool": "many"}, "pack_pool"),
        ({"pack_pool": 8, "long_documents": "split"}, "needs whole documents"),
        ({"pack_pool": 8, "global_tokens": None, "global_documents": 8}, "needs a token budget"),
    ]
    for batch, message in cases:
        full = {"seq_len": 256, "micro_batches": 2, "global_tokens": 1024,
                "long_documents": "truncate", **batch}  # fmt: skip
        with pytest.raises(PlanError, match=r"batch\.pack_pool"):
            make_plan(small_sources, batch=full)
        with pytest.raises(PlanError, match=message):
            make_plan(small_sources, batch=full)


def test_a_job_with_a_pool_resumes_exactly_on_a_real_cluster(
    small_sources: Path, tmp_path: Path
) -> None:
    plan = _plan(small_sources, 40)
    assert _steps_with_holes(plan, 5) > 0
    resumes_as_inline(plan, str(tmp_path / "ckpt"))


def resumes_as_inline(plan: Plan, url: str) -> None:
    """A two-group job of ``plan`` checkpointing to ``url`` gives steps 0-4, and one resumed
    from step 3 gives steps 3-9, each as the inline data plane gives it (documents, offsets
    and boundaries of every micro-batch)."""
    saved = replace(plan, checkpoint=plan_checkpoint(url))
    ref = {t: {g: _digest(b.micro_batches) for g, b in bs.items()}
           for t, bs in InlineDataPlane(plan).stream(10)}  # fmt: skip
    with Job.start(saved, workers=2, dashboard_address=None) as job:
        feeders = [job.feeder(dp_rank=g, output="numpy") for g in range(2)]
        for t in range(5):
            for g, f in enumerate(feeders):
                assert _digest(next(f.steps())) == ref[t][g]
        job.flush_checkpoint()
    with Job.start(saved, workers=2, resume=3, dashboard_address=None) as job:
        assert job.info["resumed"] and job.info["start_step"] == 3
        feeders = [job.feeder(dp_rank=g, output="numpy") for g in range(2)]
        for t in range(3, 10):
            for g, f in enumerate(feeders):
                assert _digest(next(f.steps())) == ref[t][g], (t, g)


def _digest(micro_batches: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return [
        (tuple(mb["doc_source"].tolist()), tuple(mb["doc_id"].tolist()),
         tuple(mb["doc_offset"].tolist()), tuple(mb["cu_seqlens"].tolist()))
        for mb in micro_batches
    ]  # fmt: skip

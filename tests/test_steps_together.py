"""Steps dealt together: the same splits and the same stream as steps dealt one by one.

The scheduler plugin's dealing thread takes every step that can be drawn (up to
``dealing.STEPS_AT_ONCE``) and deals them side by side (``StepDealer.deal_steps``; pass 2's
rounds over groups and passes 3 to 5 in one set of numpy calls for all of them). The balancer
has one code path, a step alone being the case of one; that a step's split does not depend on
the steps beside it is what these tests check: every split must be the one its step alone
gets, to the last bit, and the stream the one drawn step by step.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omniload_dask.batching.balance import (
    Assignment,
    Bucket,
    RoutedDocuments,
    balance,
    balance_steps,
)
from omniload_dask.batching.balance.refine import STEPS_UP_TO
from omniload_dask.plan import parse_plan
from omniload_dask.plan.cost import CostModel
from omniload_dask.testing import InlineDataPlane, batch_digest

from .datagen import plan_dict


def sources_of(root):
    """conftest.make_plan's three sources, as dicts."""
    return [
        {"name": "web", "format": "jsonl", "path": str(root / "web" / "*.jsonl"),
         "weight": 2, "unit_bytes": 4096},
        {"name": "code", "format": "jsonl", "path": str(root / "code" / "*.jsonl.zst"),
         "weight": 1},
        {"name": "books", "format": "parquet", "path": str(root / "books"), "text": "body",
         "weight": 1},
    ]  # fmt: skip


SEQ = 64
FIELDS = ("doc", "start", "length", "cost", "group", "micro", "micro_capacity", "micro_bucket")


def assert_same_split(a: Assignment, b: Assignment) -> None:
    for name in FIELDS:
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert (a.cuts, a.spilled, a.bound, a.groups) == (b.cuts, b.spilled, b.bound, b.groups)


def heavy_tailed_step(rng: np.random.Generator, groups: int, micro: int, fill: float):
    """Short documents with a heavy tail and a few long ones, to ``fill`` of the capacity."""
    budget = groups * micro * SEQ * fill
    lengths: list[int] = []
    while sum(lengths) < budget:
        short = min(int(rng.pareto(1.2) * 6) + 1, SEQ)
        lengths.append(short if rng.random() < 0.9 else int(rng.integers(SEQ, 5 * SEQ)))
    return np.asarray(lengths[:-1] or [1], dtype=np.int64)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    groups=st.integers(2, STEPS_UP_TO),
    micro=st.integers(1, 3),
    steps=st.integers(2, 9),
    cut=st.booleans(),
    quadratic=st.sampled_from([1 / 16, 1 / 256, 1 / 4096]),
)
def test_steps_side_by_side_split_exactly_as_each_alone(seed, groups, micro, steps, cut, quadratic):
    rng = np.random.default_rng(seed)
    cost = CostModel(1.0, quadratic)
    buckets = [Bucket(SEQ, micro)]
    drawn = [
        heavy_tailed_step(rng, groups, micro, float(rng.choice([1.0, 0.99, 0.8, 0.3])))
        for _ in range(steps)
    ]
    together = balance_steps(
        [RoutedDocuments(n, np.zeros(len(n), int)) for n in drawn], buckets, groups, cost, cut=cut
    )
    for lengths, got in zip(drawn, together, strict=True):
        assert_same_split(balance(lengths, np.zeros(len(lengths), int), buckets, groups,
                                  cost, cut=cut), got)  # fmt: skip


def test_steps_of_different_shapes_and_sizes_beyond_the_limit_split_as_each_alone():
    # Steps that need more micro-batches than declared go side by side with their own kind;
    # two buckets, or more groups than STEPS_UP_TO, are dealt one by one.
    rng = np.random.default_rng(5)
    cost = CostModel(1.0, 1 / 64)
    cases = [
        ([Bucket(SEQ, 1)], 8, [1.0, 1.6, 0.9, 2.4, 1.0]),  # (fill > 1: more micro-batches)
        ([Bucket(SEQ, 2), Bucket(4 * SEQ, 1)], 4, [0.9, 0.95, 1.0]),
        ([Bucket(SEQ, 1)], STEPS_UP_TO + 4, [1.0, 0.97]),
    ]
    for buckets, groups, fills in cases:
        drawn = [heavy_tailed_step(rng, groups, 1, f) for f in fills]
        routes = [np.minimum((n > SEQ).astype(int), len(buckets) - 1) for n in drawn]
        together = balance_steps(
            [RoutedDocuments(n, b) for n, b in zip(drawn, routes, strict=True)],
            buckets,
            groups,
            cost,
        )
        for n, b, got in zip(drawn, routes, together, strict=True):
            assert_same_split(balance(n, b, buckets, groups, cost), got)


@pytest.mark.parametrize("together", [3, 8])
def test_the_data_plane_draws_the_same_stream_with_steps_dealt_together(small_sources, together):
    # Token-scheduled weights read the tokens drawn before a step: with steps in flight they
    # must count those too. A finite stream must end at the same step, after them.
    plan = parse_plan(plan_dict(
        [{**s, "epochs": 1} for s in sources_of(small_sources)],
        name="together",
        layout={"dp": 4},
        batch={"seq_len": 256, "micro_batches": 1, "global_tokens": 1024},
        mixing={"by": "tokens", "over": "tokens", "interpolate": "linear",
                "schedule": [{"at": 0, "weights": {"web": 0.7, "code": 0.2, "books": 0.1}},
                             {"at": 20000, "weights": {"web": 0.2, "code": 0.4, "books": 0.4}}]},
    ))  # fmt: skip
    one = InlineDataPlane(plan)
    many = InlineDataPlane(plan, together=together)
    sizes: list[int] = []
    deal_steps = many.coord.components.dealer.deal_steps

    def counted(drawn):
        sizes.append(len(drawn))
        return deal_steps(drawn)

    many.coord.components.dealer.deal_steps = counted  # type: ignore[method-assign]
    steps = 0
    while one.coord.view.end_step is None or steps < one.coord.view.end_step:
        a, b = one.step(steps), many.step(steps)
        assert sorted(a) == sorted(b)
        for g in a:
            assert batch_digest(a[g]) == batch_digest(b[g])
        steps += 1
        assert steps < 500
    assert many.coord.view.end_step == one.coord.view.end_step == steps
    assert 1 < max(sizes) <= together  # (steps were dealt together)
    assert [f.efficiency for f in many.coord.view.history] == [
        f.efficiency for f in one.coord.view.history
    ]


def test_the_refinement_knobs_apply_to_steps_side_by_side(monkeypatch):
    # Who tunes the balancer through refine's module constants (benchmarks/real_balance.py
    # sets SMALL_CUT_ROUNDS) tunes both ways of dealing the same.
    from omniload_dask.batching.balance import refine

    monkeypatch.setattr(refine, "SMALL_CUT_ROUNDS", 2)
    monkeypatch.setattr(refine, "ROUNDS", 3)
    rng = np.random.default_rng(11)
    cost, buckets = CostModel(1.0, 1 / 16), [Bucket(SEQ, 1)]
    drawn = [heavy_tailed_step(rng, 8, 1, 1.0) for _ in range(6)]
    together = balance_steps(
        [RoutedDocuments(n, np.zeros(len(n), int)) for n in drawn], buckets, 8, cost
    )
    for n, got in zip(drawn, together, strict=True):
        assert_same_split(balance(n, np.zeros(len(n), int), buckets, 8, cost), got)

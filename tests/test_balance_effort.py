"""``layout.balance: fast``: the balancer's cheap passes only; the global stream stays the same."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import omniload_dask.batching.balance.split as split
from omniload_dask.batching.balance import Bucket, balance, route
from omniload_dask.batching.wire import expand
from omniload_dask.errors import PlanError
from omniload_dask.plan import parse_plan
from omniload_dask.testing import InlineDataPlane

from .conftest import make_plan
from .datagen import plan_dict
from .test_balance import COST, SEQ, check_assignment, lengths_st


@settings(max_examples=100, deadline=None)
@given(lengths=lengths_st, groups=st.integers(1, 6), micro=st.integers(1, 3), cut=st.booleans())
def test_a_fast_split_loses_nothing_keeps_every_limit_and_repeats_itself(
    lengths, groups, micro, cut
):
    lengths = np.asarray(lengths, dtype=np.int64)
    buckets = [Bucket(SEQ, micro)]
    bucket, by_length = route(lengths, np.zeros(len(lengths), int), buckets)
    kw = {"by_length": by_length, "cut": cut, "effort": "fast"}
    plan = balance(lengths, bucket, buckets, groups, COST, **kw)
    check_assignment(plan, lengths, buckets, groups, cut)
    again = balance(lengths, bucket, buckets, groups, COST, **kw)
    for name in ("doc", "start", "length", "group", "micro"):
        assert np.array_equal(getattr(plan, name), getattr(again, name)), name


def test_fast_skips_the_pair_rounds_and_the_polish_and_full_runs_them(monkeypatch):
    calls: list[str] = []
    real_refine, real_polish = split.refine_pass, split.polish

    def spy(name, real):
        def run(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)

        return run

    monkeypatch.setattr(split, "refine_pass", spy("refine", real_refine))
    monkeypatch.setattr(split, "polish", spy("polish", real_polish))
    lengths = np.random.default_rng(0).integers(1, 2 * SEQ, 12)  # (few documents a group)
    bucket = np.zeros(len(lengths), int)
    fast = balance(lengths, bucket, [Bucket(SEQ, 1)], 8, COST, effort="fast")
    assert calls == []
    full = balance(lengths, bucket, [Bucket(SEQ, 1)], 8, COST)
    assert calls == ["refine", "polish"]
    assert full.efficiency > fast.efficiency  # (what the skipped passes buy on this step)


def _pieces(plan_data_or_plan, steps: int) -> tuple[list[Counter], list[list[list[int]]]]:
    """Per step: tokens delivered per document, and each rank's documents in order."""
    run = InlineDataPlane(plan_data_or_plan)
    tokens, split_by_rank = [], []
    for _, batches in run.stream(steps):
        seen: Counter = Counter()
        ranks = []
        for rank in sorted(batches):
            docs: list[int] = []
            for mb in batches[rank].micro_batches:
                mb = expand(mb)
                cu = np.asarray(mb["cu_seqlens"])
                for k, doc in enumerate(np.asarray(mb["doc_id"]).tolist()):
                    seen[doc] += int(cu[k + 1] - cu[k])
                    docs.append(doc)
            ranks.append(docs)
        tokens.append(seen)
        split_by_rank.append(ranks)
    return tokens, split_by_rank


def test_fast_balance_changes_only_the_split_never_which_tokens_form_a_step(small_sources):
    batch = {"seq_len": 512, "micro_batches": 1, "global_tokens": 2048}
    cost = {"linear": 1.0, "quadratic": 0.02}  # (attention-heavy: the passes have work to do)
    plans = [
        make_plan(small_sources, layout={"dp": 4, "balance": b}, batch=batch, cost=cost)
        for b in ("full", "fast")
    ]
    assert plans[0].stream_fingerprint() == plans[1].stream_fingerprint()
    (full_tokens, full_split), (fast_tokens, fast_split) = (_pieces(p, 6) for p in plans)
    assert full_tokens == fast_tokens
    assert full_split != fast_split  # (the settings differ here, so the check means something)


def test_the_plan_says_fast_and_leaves_the_default_unsaid():
    base = plan_dict([{"name": "a", "format": "jsonl", "path": "x.jsonl"}])
    assert parse_plan(base).layout.balance == "full"
    assert "balance" not in parse_plan(base).to_dict()["layout"]
    fast = parse_plan({**base, "layout": {"dp": 2, "balance": "fast"}})
    assert fast.layout.balance == "fast"
    assert parse_plan(fast.to_dict()).layout.balance == "fast"
    with pytest.raises(PlanError, match=r"layout\.balance.*quick"):
        parse_plan({**base, "layout": {"dp": 2, "balance": "quick"}})

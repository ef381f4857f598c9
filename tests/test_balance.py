"""Partitioning and packing: properties over random and adversarial length distributions."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omniload_dask.batching.balance import Assignment, Bucket, balance, route, split_documents
from omniload_dask.batching.balance.pieces import Bins, Pieces
from omniload_dask.batching.balance.refine import refine
from omniload_dask.plan.cost import CostModel

SEQ = 64
COST = CostModel(1.0, 1.0 / 16)  # attention matters: a full piece costs 5x its tokens


def test_split_documents_cuts_into_seq_len_pieces():
    doc, start = split_documents(np.array([5, 10, 11, 1]), 5)
    assert doc.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert start.tolist() == [0, 0, 5, 0, 5, 10, 0]
    doc, start = split_documents(np.array([5, 10]), np.array([2, 8]))
    assert doc.tolist() == [0, 0, 0, 1, 1] and start.tolist() == [0, 2, 4, 0, 8]


def test_worked_example_from_the_docstring():
    lengths = np.array([6, 5, 3, 2])
    plan = balance(lengths, np.zeros(4, int), [Bucket(8, 1)], 2, CostModel(1.0, 0.0))
    assert plan.efficiency == 1.0
    assert plan.group_tokens.tolist() == [8, 8]
    assert [sorted(lengths[plan.doc[b]].tolist()) for g in plan.bins for b in g] == [[2, 6], [3, 5]]


def test_route_pins_sources_and_sends_long_documents_to_long_sequences():
    buckets = [Bucket(16, 2), Bucket(64, 1), Bucket(32, 1, pinned=True)]
    lengths = np.array([10, 16, 17, 70, 5, 40])
    sources = np.array([0, 0, 0, 0, 1, 1])
    bucket, by_length = route(lengths, sources, buckets, pinned={1: 2})
    assert bucket.tolist() == [0, 0, 1, 1, 2, 2]
    assert by_length.tolist() == [True] * 4 + [False] * 2


def test_an_over_full_long_bucket_hands_its_shortest_documents_down():
    buckets = [Bucket(16, 4), Bucket(64, 1)]  # 2 groups: the long bucket holds 128 tokens
    lengths = np.array([60, 50, 20, 40])
    bucket, by_length = route(lengths, np.zeros(4, int), buckets)
    plan = balance(lengths, bucket, buckets, 2, COST, by_length=by_length)
    kept = {int(plan.doc[i]) for i in np.flatnonzero(plan.micro_bucket[plan.micro] == 1)}
    assert kept == {0, 1}  # 20 and 40 (170 > 128 tokens) went to 16-token sequences
    assert plan.spilled == 2 and plan.num_micro_steps == 5
    check_assignment(plan, lengths, buckets, 2, cut=True)


def check_assignment(
    plan: Assignment, lengths: np.ndarray, buckets: list[Bucket], groups: int, cut: bool,
    cost: CostModel = COST,
) -> None:  # fmt: skip
    """No token lost or delivered twice, every limit kept, no micro-batch more than needed."""
    for d, n in enumerate(lengths.tolist()):
        mine = np.flatnonzero(plan.doc == d)
        mine = mine[np.argsort(plan.start[mine])]
        ends = plan.start[mine] + plan.length[mine]
        assert plan.start[mine][0] == 0 and ends[-1] == n
        assert np.array_equal(plan.start[mine][1:], ends[:-1])  # contiguous, no overlap
        assert np.all(plan.length[mine] > 0)
        size = plan.micro_capacity[plan.micro[mine]]
        assert np.all(plan.length[mine] <= size)
        if not cut:  # documents are only split at their bucket's seq_len
            assert len(mine) == max(1, -(-n // int(size[0])))
    assert np.all(plan.micro_tokens <= plan.micro_capacity[None, :])
    assert np.allclose(plan.cost, cost(plan.length))
    for b, spec in enumerate(buckets):
        count = int((plan.micro_bucket == b).sum())
        tokens = int(plan.length[plan.micro_bucket[plan.micro] == b].sum())
        needed = max(spec.micro_batches, -(-tokens // (groups * spec.seq_len)))
        assert count >= needed
        if cut:
            assert count == needed


lengths_st = st.one_of(
    st.lists(st.integers(1, 3 * SEQ), max_size=150),  # uniform
    st.lists(st.sampled_from([1, 2, SEQ]), max_size=150),  # tiny or full: worst for packing
    st.lists(st.integers(1, 8).map(lambda k: 2**k), max_size=150),  # powers of two
    st.builds(lambda n, v: [v] * n, st.integers(0, 120), st.integers(1, 2 * SEQ)),  # all equal
)


@settings(max_examples=150, deadline=None)
@given(
    lengths=lengths_st,
    groups=st.integers(1, 6),
    micro=st.integers(1, 4),
    two_buckets=st.booleans(),
    cut=st.booleans(),
)
def test_pieces_are_never_lost_or_duplicated_and_limits_hold(
    lengths, groups, micro, two_buckets, cut
):
    lengths = np.asarray(lengths, dtype=np.int64)
    buckets = [Bucket(SEQ, micro)] + ([Bucket(4 * SEQ, 1)] if two_buckets else [])
    bucket, by_length = route(lengths, np.zeros(len(lengths), int), buckets)
    plan = balance(lengths, bucket, buckets, groups, COST, by_length=by_length, cut=cut)
    check_assignment(plan, lengths, buckets, groups, cut)
    again = balance(lengths, bucket, buckets, groups, COST, by_length=by_length, cut=cut)
    for name in ("doc", "start", "length", "group", "micro", "micro_capacity"):
        assert np.array_equal(getattr(plan, name), getattr(again, name)), name


@settings(max_examples=150, deadline=None)
@given(lengths=lengths_st, groups=st.integers(2, 8), cut=st.booleans())
def test_with_room_to_spare_no_group_exceeds_the_mean_by_more_than_one_piece(lengths, groups, cut):
    # The list-scheduling bound: max <= mean + the costliest piece, so efficiency is at least
    # mean / (mean + c_max); with many small pieces that is close to 1.
    lengths = np.asarray(lengths, dtype=np.int64)
    micro = 2 * max(1, -(-int(lengths.sum()) // (groups * SEQ)))  # half the capacity is spare
    plan = balance(
        lengths, np.zeros(len(lengths), int), [Bucket(SEQ, micro)], groups, COST, cut=cut
    )
    costs = plan.group_costs
    assert costs.max() <= costs.mean() + plan.cost.max(initial=0) + 1e-9


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), groups=st.integers(2, 16), full=st.booleans())
def test_heavy_tailed_batches_stay_above_98_percent_efficiency(seed, groups, full):
    # Short documents with a heavy tail, 1 in 100 a long one (three full pieces), budgets at or
    # just below capacity: the DESIGN.md target of 0.98 holds (measured worst over 400 seeds:
    # 0.998).
    rng = np.random.default_rng(seed)
    micro = 8
    budget = groups * micro * SEQ * (1.0 if full else 0.98)
    lengths: list[int] = []
    while sum(lengths) < budget:
        short = min(int(rng.pareto(1.5) * 4) + 1, SEQ // 2)
        lengths.append(short if rng.random() < 0.99 else 3 * SEQ)
    lengths_arr = np.asarray(lengths[:-1], dtype=np.int64)
    plan = balance(lengths_arr, np.zeros(len(lengths_arr), int), [Bucket(SEQ, micro)], groups,
                   CostModel(1.0, 1.0 / (6 * SEQ)))  # fmt: skip
    assert plan.num_micro_steps == micro
    assert plan.efficiency >= 0.98


def test_refinement_fixes_the_classic_lpt_worst_case():
    # LPT gives {32, 24, 24} and {32, 24, 8}; the best split is {32, 32} and {24, 24, 24, 8}.
    lengths = np.array([32, 32, 24, 24, 24, 8])
    buckets = [Bucket(SEQ, 2)]
    lpt = balance(lengths, np.zeros(6, int), buckets, 2, COST, refine=False)
    refined = balance(lengths, np.zeros(6, int), buckets, 2, COST)
    assert lpt.efficiency < 0.9 and refined.efficiency == 1.0
    check_assignment(refined, lengths, buckets, 2, cut=True)


def test_when_both_groups_are_full_only_an_exchange_moves_attention_cost():
    # Heavy: two full pieces; light: sixteen short ones; no token room on either side. Giving
    # one full piece for eight short ones evens the pair exactly.
    length = np.array([SEQ, SEQ] + [8] * 16)
    n = len(length)
    zeros = np.zeros(n, dtype=np.int64)
    p = Pieces.new(zeros.copy(), zeros.copy(), length, zeros.copy(), np.zeros(n), COST)
    bins = Bins.new(np.array([SEQ]), np.array([2]), 2)  # group 0: bins 0, 1; group 1: 2, 3
    p.bin = np.array([0, 1] + [2] * 8 + [3] * 8)
    bins.room = bins.capacity - np.bincount(p.bin, length, 4).astype(np.int64)
    bins.load = np.bincount(p.bin, p.cost, 4)
    assert not bins.room.any()
    refine(p, bins, 1, 2, COST, cut=False)
    group = bins.group[p.bin]
    assert np.bincount(group, p.cost, 2).tolist() == [COST(np.array([SEQ]))[0] + 8 * 12.0] * 2
    assert sorted(np.bincount(group, minlength=2).tolist()) == [9, 9]  # one full + eight short
    assert (np.bincount(p.bin, length, 4) == SEQ).all()  # every micro-batch still full


def test_hybrid_balance_beats_backbone_only_when_encoders_cost():
    """Images add encoder cost per document: balancing on it (hybrid) evens the ranks' real
    cost; balancing on the backbone alone leaves the encoder work where it falls."""
    rng = np.random.default_rng(0)
    n, groups = 256, 8
    lengths = rng.integers(200, 400, n)
    patches = np.where(rng.random(n) < 0.5, rng.integers(64, 1024, n), 0)
    cost = CostModel(linear=1.0, quadratic=1e-4, encoder_linear=2.0, encoder_quadratic=2e-3)
    extra = cost.encoder(patches)
    buckets = [Bucket(4096, 4)]
    bucket = np.zeros(n, dtype=np.int64)
    hybrid = balance(lengths, bucket, buckets, groups, cost, extra=extra)
    backbone = balance(lengths, bucket, buckets, groups, cost)

    def true_efficiency(a):
        first = a.start == 0
        loads = np.bincount(a.group, cost(a.length) + np.where(first, extra[a.doc], 0.0), groups)
        return loads.mean() / loads.max()

    assert hybrid.efficiency == pytest.approx(true_efficiency(hybrid))
    assert true_efficiency(hybrid) > 0.98
    assert true_efficiency(hybrid) > true_efficiency(backbone) + 0.05
    # Every document still placed whole and once, within the token limits.
    assert sorted(hybrid.doc.tolist()) == list(range(n))
    assert (hybrid.micro_tokens <= 4096).all()


def test_the_structural_bound_caps_a_split_that_keeps_pieces_whole():
    # Without cutting, the group that holds the costliest piece costs at least that much.
    lengths = np.array([SEQ, 8, 8, 8])
    plan = balance(lengths, np.zeros(4, int), [Bucket(SEQ, 1)], 4, COST, cut=False)
    assert plan.bound == pytest.approx(COST(lengths).sum() / 4 / COST(np.array([SEQ]))[0])
    assert plan.efficiency <= plan.bound + 1e-12
    assert plan.cuts == 0 and plan.empty_micro_batches == 0


@pytest.mark.parametrize("sparse", [False, True])
def test_four_to_eight_documents_per_group_reach_98_percent_on_the_mean(sparse):
    # One document in eight is long; attention costs a sixth of the rest at a full micro-batch
    # (an 8B model's share at 8k tokens is a seventh). Tight: the step fills its micro-batches
    # (the bound is 1). Sparse: one long micro-batch per group, half full, and a long document
    # alone costs more than a group's share (the bound is far below 1): only cut pieces can be
    # even. Cut where split allows, the steps reach 0.98 on the mean, and never run more than
    # half a percent slower than whole pieces would (pass 4 polishes both, and whole pieces
    # sometimes get a little more out of it: at most 0.26% on these steps).
    effs, bounds = [], []
    for seed in range(60):
        rng = np.random.default_rng(seed)
        groups, per_group = int(rng.integers(2, 65)), int(rng.integers(4, 9))
        n = groups * per_group
        long = (4 * SEQ, 8 * SEQ) if sparse else (2 * SEQ, 6 * SEQ)
        lengths = np.where(rng.random(n) < 0.125, rng.integers(*long, n), rng.integers(1, SEQ, n))
        seq = 8 * SEQ if sparse else SEQ
        micro = 1 if sparse else max(1, -(-int(lengths.sum()) // (groups * SEQ)))
        buckets, cost = [Bucket(seq, micro)], CostModel(1.0, 1.0 / (6 * seq))
        plan = balance(lengths, np.zeros(n, int), buckets, groups, cost)
        check_assignment(plan, lengths, buckets, groups, cut=True, cost=cost)
        assert (plan.group_tokens > 0).all()
        whole = balance(lengths, np.zeros(n, int), buckets, groups, cost, cut=False)
        assert whole.efficiency <= whole.bound + 1e-12
        if whole.num_micro_steps == plan.num_micro_steps:  # (cut=False may need one more)
            assert plan.group_costs.max() <= whole.group_costs.max() * (1 + 5e-3)
        effs.append(plan.efficiency)
        bounds.append(whole.bound)
    assert np.mean(effs) >= 0.98 and min(effs) >= 0.95
    assert (np.mean(bounds) < 0.9) if sparse else (min(bounds) == 1.0)


def test_attention_heavy_costs_stay_even_where_every_group_is_full():
    # Attention four times the rest at a full micro-batch, every micro-batch nearly full: the
    # hardest case for whole pieces (only exchanges of as many tokens move cost); the mean
    # stays at 0.98.
    effs = []
    for seed in range(60):
        rng = np.random.default_rng(seed)
        groups, per_group = int(rng.integers(2, 65)), int(rng.integers(4, 9))
        n = groups * per_group
        lengths = np.where(rng.random(n) < 0.125, rng.integers(2 * SEQ, 6 * SEQ, n),
                           rng.integers(1, SEQ, n))  # fmt: skip
        micro = max(1, -(-int(lengths.sum()) // (groups * SEQ)))
        plan = balance(lengths, np.zeros(n, int), [Bucket(SEQ, micro)], groups, COST)
        check_assignment(plan, lengths, [Bucket(SEQ, micro)], groups, cut=True)
        effs.append(plan.efficiency)
    assert np.mean(effs) >= 0.98 and min(effs) >= 0.95


def test_fewer_documents_than_groups_still_give_every_group_work_when_cutting_is_allowed():
    lengths = np.array([5 * SEQ, 3 * SEQ, 40])  # 3 documents, 16 groups of one micro-batch
    plan = balance(lengths, np.zeros(3, int), [Bucket(SEQ, 1)], 16, COST)
    check_assignment(plan, lengths, [Bucket(SEQ, 1)], 16, cut=True)
    assert plan.bound < 0.6 and plan.efficiency >= 0.98
    assert plan.empty_micro_batches == 0
    kept = balance(lengths, np.zeros(3, int), [Bucket(SEQ, 1)], 16, COST, cut=False)
    assert kept.empty_micro_batches == 16 - 9  # 9 pieces of at most SEQ tokens: 7 groups idle


@pytest.mark.parametrize(
    "cost",
    [
        COST,
        CostModel(function=lambda n: np.full(len(n), 3.0)),
        CostModel(function=lambda n: 1e4 - n),
    ],
    ids=["quadratic", "flat", "falling"],
)
def test_pieces_go_by_decreasing_cost_whatever_the_cost_function(cost):
    # The radix sort by length is a shortcut taken only where it gives the same order.
    from omniload_dask.batching.balance.pieces import by_cost

    rng = np.random.default_rng(3)
    length = rng.integers(1, 300, 500)
    zeros = np.zeros(500, dtype=np.int64)
    for extra in (np.zeros(500), np.where(rng.random(500) < 0.1, 50.0, 0.0)):
        p = Pieces.new(zeros, zeros, length, zeros, extra, cost)
        ids = np.flatnonzero(rng.random(500) < 0.7)
        assert np.array_equal(by_cost(p, ids), ids[np.argsort(-p.cost[ids], kind="stable")])


def test_split_documents_matches_the_piece_by_piece_cut_for_any_lengths_and_limits():
    rng = np.random.default_rng(11)
    for trial in range(200):
        n = int(rng.integers(0, 40))
        lengths = rng.integers(0, 50, n)
        limit = int(rng.integers(1, 12)) if trial % 2 else rng.integers(1, 12, n)
        doc, start = split_documents(lengths, limit)
        want_doc, want_start = [], []
        for d, length in enumerate(lengths.tolist()):
            size = limit if isinstance(limit, int) else int(limit[d])
            for k in range(max(1, -(-length // size))):
                want_doc.append(d)
                want_start.append(k * size)
        assert doc.tolist() == want_doc and start.tolist() == want_start


def test_group_loads_sort_as_a_stable_argsort_even_one_ulp_apart():
    from omniload_dask.batching.sorting import stable_order_of_floats

    rng = np.random.default_rng(5)
    for trial in range(300):
        n = int(rng.integers(0, 2500))
        kind = trial % 4
        if kind == 0:  # distinct loads
            values = rng.uniform(0.0, 1e12, n)
        elif kind == 1:  # many ties (pieces of equal cost)
            values = rng.integers(0, 5, n) * 1e9
        elif kind == 2:  # loads that differ in the last bits only (sums in another order)
            base = rng.uniform(1.0, 2.0, n)
            values = np.where(rng.random(n) < 0.5, base, np.nextafter(base, 0.0))
            values[: n // 2] = values[0] if n else 0.0
        else:  # negative values: the stable sort itself
            values = rng.normal(0.0, 1.0, n)
        got = stable_order_of_floats(values)
        assert np.array_equal(got, np.argsort(values, kind="stable")), trial


def test_first_use_numbers_values_in_order_of_first_use_with_or_without_a_sort():
    from omniload_dask.batching.sorting import first_use

    rng = np.random.default_rng(4)
    for trial in range(400):
        n = int(rng.integers(0, 200))
        span = int(rng.choice([1, 5, 40, 1000, 10**9]))  # narrow: no sort; wide: the sort
        values = rng.integers(0, span, n)
        used, number = first_use(values)
        expected = list(dict.fromkeys(values.tolist()))
        assert used.tolist() == expected, trial
        assert number.tolist() == [expected.index(v) for v in values.tolist()], trial
        assert used.dtype == number.dtype == np.int64


def test_a_probe_scores_its_pairs_on_their_own_groups_as_in_the_whole_step():
    from omniload_dask.batching.balance import cuts, pairs
    from omniload_dask.batching.balance.pairs import Pairs, probed
    from omniload_dask.batching.balance.whole import whole_round

    def every_pair(heavy, light):  # (a probe of all the pairs)
        n = len(heavy)
        return Pairs(heavy, light, np.zeros(n, np.int64), np.arange(n), n, 1)

    rng = np.random.default_rng(2)
    groups = 40
    lengths = np.where(rng.random(400) < 0.1, rng.integers(SEQ, 3 * SEQ, 400),
                       rng.integers(1, SEQ // 2, 400))  # fmt: skip
    micro = -(-int(lengths.sum()) // (groups * SEQ)) + 1
    plan = balance(lengths, np.zeros(400, int), [Bucket(SEQ, micro)], groups, COST,
                   refine=False)  # fmt: skip
    load = plan.group_costs
    p = Pieces.new(plan.doc, plan.start, plan.length, np.zeros(len(plan.doc), np.int64),
                   np.zeros(len(plan.doc)), COST)  # fmt: skip
    bins = Bins.new(np.array([SEQ]), np.array([micro]), groups)
    bins.group, bins.slot = np.arange(groups * micro) % groups, np.arange(groups * micro) // groups
    p.bin = plan.micro * groups + plan.group
    bins.room = bins.capacity - np.bincount(p.bin, p.length, len(bins.room)).astype(np.int64)
    bins.load = np.bincount(p.bin, p.cost, len(bins.room))
    order = np.argsort(-load, kind="stable")
    heavy, light = order[:6], order[::-1][:6]
    for cost in (None, COST):
        whole, _ = whole_round(p, bins, load, Pairs.of_one_step(load, heavy, light), cost)
        alone, _ = whole_round(*probed(p, bins, load, every_pair(heavy, light)), cost)
        assert np.array_equal(whole, alone)
    # Below PROBE_ALONE_FROM pairs a round reads its probe from its own scores: the same
    # answer as weighing the probe alone first, whether the probe finds a change or not.
    for count in (12, 20):
        heavy, light = order[:count], order[::-1][:count]
        for cost in (None, COST):
            these = Pairs.of_one_step(load, heavy, light)
            got = [whole_round(p, bins, load, these, cost)[0]]
            got += [cuts.cut_round(p, bins, load, these, COST)[0]]
            saved = pairs.PROBE_ALONE_FROM
            pairs.PROBE_ALONE_FROM = 1
            try:
                first = [whole_round(p, bins, load, these, cost)[0]]
                first += [cuts.cut_round(p, bins, load, these, COST)[0]]
            finally:
                pairs.PROBE_ALONE_FROM = saved
            for a, b in zip(got, first, strict=True):
                assert np.array_equal(a, b)

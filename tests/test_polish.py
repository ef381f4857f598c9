"""Pass 4 of the balancer: exchanges of up to two pieces for up to two between full groups."""

from __future__ import annotations

import numpy as np
import pytest

import omniload_dask.batching.balance.polish as polish_pass
from omniload_dask.batching.balance import Bucket, balance
from omniload_dask.batching.balance.pieces import Bins, Pieces
from omniload_dask.batching.balance.polish import POLISH_UP_TO, polish
from omniload_dask.plan.cost import CostModel

from .test_balance import check_assignment


def _placed(length: list[int], where: list[int], seq: int, micro: int, groups: int,
            cost: CostModel) -> tuple[Pieces, Bins]:  # fmt: skip
    """Pieces of ``length`` put into the bins ``where`` of ``groups`` x ``micro`` bins."""
    n = len(length)
    zeros = np.zeros(n, dtype=np.int64)
    p = Pieces.new(np.arange(n), zeros.copy(), np.asarray(length), zeros.copy(), np.zeros(n), cost)
    bins = Bins.new(np.array([seq]), np.array([micro]), groups)
    p.bin = np.asarray(where, dtype=np.int64)
    bins.room = bins.capacity - np.bincount(p.bin, p.length, len(bins.room)).astype(np.int64)
    bins.load = np.bincount(p.bin, p.cost, len(bins.room))
    return p, bins


def _polish_two_full_groups(lengths: list[int], where: list[int], seq: int) -> list[float]:
    """Polish two groups of one full ``seq``-token micro-batch each (cost L^2); their costs."""
    p, bins = _placed(lengths, where, seq=seq, micro=1, groups=2, cost=CostModel(0.0, 1.0))
    polish(p, bins, 1, 2)
    loads = sorted(np.bincount(bins.group[p.bin], p.cost, 2).tolist())
    assert (np.bincount(p.bin, p.length, 2) == seq).all()  # both still full
    assert bins.room.tolist() == [0, 0] and sorted(bins.load.tolist()) == loads
    return loads


def test_worked_example_from_the_docstring():
    assert _polish_two_full_groups([5, 3, 4, 2, 1, 1], [0, 0, 1, 1, 1, 1], seq=8) == [26.0, 30.0]


def test_one_piece_for_a_pair_evens_what_no_swap_can():
    # Heavy 6 + 6 (72), light 5 + 4 + 2 + 1 (46), both full: no swap keeps the tokens; a 6
    # for {5, 1} or {4, 2} (as many tokens) makes 62 and 56, and nothing evens them further.
    assert _polish_two_full_groups([6, 6, 5, 4, 2, 1], [0, 0, 1, 1, 1, 1], seq=12) == [56.0, 62.0]


def test_a_micro_batch_that_had_pieces_keeps_some():
    square = CostModel(0.0, 1.0)
    # The heavy group's only piece could go whole to the empty-handed light group for
    # nothing back; that would leave its micro-batch empty, so nothing changes.
    p, bins = _placed([6, 1], [0, 1], seq=8, micro=1, groups=2, cost=square)
    before = p.bin.copy()
    polish(p, bins, 1, 2)
    assert p.bin.tolist() == before.tolist()


@pytest.mark.parametrize("micro", [1, 3])
def test_polish_keeps_every_limit_never_raises_the_peak_and_is_deterministic(micro):
    rng = np.random.default_rng(7)
    seq = 256
    cost = CostModel(1.0, 1.0 / 32)
    lifted = 0
    for _ in range(25):
        groups = int(rng.integers(2, 17))
        n = groups * micro * int(rng.integers(3, 9))
        length = rng.integers(1, seq // 2, n)
        # a first fit by tokens: full micro-batches, unevenly costly
        where, room = np.empty(n, np.int64), np.full(groups * micro, seq)
        for i in range(n):
            fits = np.flatnonzero(room >= length[i])
            if not len(fits):
                where, length = where[:i], length[:i]
                break
            where[i] = fits[0]
            room[fits[0]] -= length[i]
        p, bins = _placed(length.tolist(), where.tolist(), seq, micro, groups, cost)
        twin = _placed(length.tolist(), where.tolist(), seq, micro, groups, cost)
        held = np.bincount(p.bin, minlength=len(bins.room)) > 0
        peak = np.bincount(bins.group[p.bin], p.cost, groups).max()
        polish(p, bins, 1, groups)
        polish(*twin, 1, groups)
        assert p.bin.tolist() == twin[0].bin.tolist()  # same inputs, same plan
        tokens = np.bincount(p.bin, p.length, len(bins.room))
        assert (tokens <= seq).all() and (bins.room == seq - tokens).all()
        assert (np.bincount(p.bin, minlength=len(bins.room))[held] > 0).all()
        loads = np.bincount(bins.group[p.bin], p.cost, groups)
        assert loads.max() <= peak + 1e-9
        lifted += loads.max() < peak * (1 - 1e-3)
    assert lifted >= 10  # it does lower the peak on many of these steps


def test_balance_polishes_small_dp_sizes_only():
    rng = np.random.default_rng(3)
    seq = 512
    cost = CostModel(1.0, 1.0 / 64)
    for groups in (8, POLISH_UP_TO + 1):
        lengths = rng.integers(1, seq, groups * 6)
        buckets = [Bucket(seq, max(1, -(-int(lengths.sum()) // (groups * seq))))]
        kept = polish_pass.POLISH_UP_TO
        try:
            polish_pass.POLISH_UP_TO = 0
            plain = balance(lengths, np.zeros(len(lengths), int), buckets, groups, cost)
        finally:
            polish_pass.POLISH_UP_TO = kept
        polished = balance(lengths, np.zeros(len(lengths), int), buckets, groups, cost)
        check_assignment(polished, lengths, buckets, groups, cut=True, cost=cost)
        if groups > POLISH_UP_TO:
            assert polished.group.tolist() == plain.group.tolist()
        else:
            assert polished.group_costs.max() <= plain.group_costs.max() + 1e-9

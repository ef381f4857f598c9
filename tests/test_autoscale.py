"""Auto-partitioning: measured costs size reads (portions, quotas, workers), never the stream."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from omniload_dask.core import autoscale
from omniload_dask.core.autoscale import Meter, portion_count, quotas, recommend_workers
from omniload_dask.core.events import WorkersChanged
from omniload_dask.plan import READ_SLOTS_PER_THREAD
from omniload_dask.testing import InlineDataPlane, assert_batches_equal

from .conftest import make_plan, record_reads


def test_meter_keeps_recent_costs_per_size_record_and_token():
    m = Meter()
    assert m.per_size is None and m.per_record is None and m.per_token is None
    m.add(1.0, size=100, records=100, tokens=1000)
    assert m.per_record == pytest.approx(0.01) and m.per_token == pytest.approx(0.001)
    for _ in range(60):  # the source got 10x dearer: the meter follows within ~10 tasks
        m.add(10.0, size=100, records=100, tokens=1000)
    assert m.per_record == pytest.approx(0.1, rel=0.01)
    m.add(float("nan"), 1, 1, 1)
    assert m.tasks == 61


@pytest.mark.parametrize(
    ("size", "per_size", "target", "cap", "portions"),
    [
        (100, None, 0.5, 100, 1),  # not measured yet: whole units
        (100, 0.001, 0.5, 100, 1),  # 0.1 s: small enough
        (100, 0.02, 0.5, 100, 4),  # 2 s -> 4 portions of 0.5 s
        (100, 0.02, 0.0, 100, 1),  # task_seconds 0: never split
        (3, 10.0, 0.5, 3, 3),  # no more portions than records
        (10_000, 1.0, 0.5, 10_000, autoscale.MAX_PORTIONS),
    ],
)
def test_portion_count_aims_at_the_target_task_time(size, per_size, target, cap, portions):
    assert portion_count(size, per_size, target, cap) == portions


def test_quotas_follow_weight_times_cost():
    # The module docstring's example: text 32 ms, images 640 ms of reads per step, 8 slots.
    assert quotas(np.array([0.032, 0.640]), 8).tolist() == [1, 7]
    # Equal work, equal slots; a source not read now gets none; unmeasured counts as average.
    assert quotas(np.array([1.0, 1.0, 0.0]), 8).tolist() == [4, 4, 0]
    assert quotas(np.array([np.nan, 1.0, 3.0]), 12).tolist() == [4, 2, 6]
    assert quotas(np.array([np.nan, np.nan]), 4).tolist() == [2, 2]
    assert quotas(np.array([0.0, 0.0]), 4).tolist() == [0, 0]
    # The quotas add up to the slots exactly, or to one per source read now when that is more.
    rng = np.random.default_rng(0)
    for _ in range(200):
        work = rng.choice([0.0, np.nan, 0.001, 0.02, 0.5], size=int(rng.integers(1, 9)))
        slots = int(rng.integers(1, 40))
        q = quotas(work, slots)
        active = int((work != 0).sum())
        assert q.sum() == (max(slots, active) if active else 0)
        assert ((q >= 1) == (work != 0)).all()


def test_recommend_workers_from_work_and_the_trainers_pace():
    # 0.672 s of reads per step, trainers take 10 steps/s and never wait: 9 one-thread workers.
    assert recommend_workers(0.672, 10.0, 0.0, 1, current=4) == 9
    # Over-provisioned: 0.1 s per step at 2 steps/s is a quarter of one thread.
    assert recommend_workers(0.1, 2.0, 0.0, 1, current=8) == 1
    # Trainers wait most of each step: their own pace is faster than what they get.
    waiting = recommend_workers(0.5, 2.0, 0.4, 2, current=1)
    assert waiting == pytest.approx(0.5 / 0.1 * autoscale.HEADROOM / 2, abs=1)
    assert recommend_workers(None, 3.0, 0.0, 1, current=3) == 3  # nothing measured yet


def _costly(plan, seconds_per_record):
    """A timing hook: every read of source i takes ``seconds_per_record[i]`` per record."""

    def timing(read, shard):
        return seconds_per_record[read.source] * max(len(shard) + shard.skipped, 1)

    return timing


def _max_in_flight(plane: InlineDataPlane, steps: int) -> np.ndarray:
    """Steps through the stream; the most read tasks of each source in flight at once."""
    n = len(plane.plan.sources)
    peak = np.zeros(n, dtype=np.int64)
    original = plane._run

    def run(actions):
        original(actions)
        pending = np.bincount([r.source for r in plane._pending], minlength=n)
        np.maximum(peak, pending, out=peak)

    plane._run = run  # type: ignore[method-assign]
    for t in range(steps):
        plane.step(t)
    return peak


def test_in_flight_reads_stay_within_quotas_that_follow_weight_times_cost(small_sources):
    plan = make_plan(
        small_sources,
        batch={"seq_len": 256, "global_tokens": 2048},
        loader={"workers": 4, "read_ahead": 8, "lookahead": 4, "prefetch": 4, "task_seconds": 0},
    )
    timing = _costly(plan, [0.001, 0.001, 0.02])  # books cost 20x per record
    plane = InlineDataPlane(plan, timing=timing)
    for t in range(4):
        plane.step(t)
    stats = plane.coord.view.stats()["sources"]
    q = [s["quota"] for s in stats]
    slots = 4 * READ_SLOTS_PER_THREAD  # 4 workers of one tokenizing thread, two reads each
    assert sum(q) == slots * plan.loader.reads_per_slot
    work = plane.coord.components.reads.read_work(
        plane.coord.view.weights_at(plane.coord.view.next_step)
    )
    expect = quotas(work, slots * plan.loader.reads_per_slot)
    assert q == expect.tolist()
    assert q[2] == max(q)  # the dearest source per token gets the most slots
    # Reads in flight never exceed a source's quota (plus the one a waiting draw needs).
    peak = _max_in_flight(plane, 12)
    assert (peak <= np.asarray(q) + 1).all()


def test_weights_by_documents_give_read_slots_by_the_tokens_they_bring(small_sources):
    """Mixed by documents into a token budget, a source of few long documents holds most of
    a step's tokens: its reads get the slots and the window that its tokens ask for, not
    those of its document weight (with which it had one read in flight, and every draw
    waited for it). Reads cost the same per token in every source here."""
    plan = make_plan(
        small_sources,
        batch={"seq_len": 256, "global_tokens": 2048},
        mixing={"by": "documents"},
        loader={"workers": 4, "task_seconds": 0},
    )

    def per_token(read, shard):
        return 1e-5 * max(len(shard.tokens), 1)

    plane = InlineDataPlane(plan, timing=per_token)
    for t in range(4):
        plane.step(t)
    reads, coord = plane.coord.components.reads, plane.coord
    weights = coord.view.weights_at(coord.view.next_step)
    shares = reads.budget_shares(weights)
    lengths = coord.components.sources.mean_lengths()
    assert shares.sum() == pytest.approx(1.0)
    assert shares == pytest.approx(weights * lengths / np.dot(weights, lengths))
    # web has half of the documents but the shortest; books a quarter, the longest.
    assert weights[0] > weights[2] and lengths[2] > 3 * lengths[0]
    assert shares[2] > shares[0]
    q = [s["quota"] for s in coord.view.stats()["sources"]]
    slots = 4 * READ_SLOTS_PER_THREAD * plan.loader.reads_per_slot  # 4 workers' reads in flight
    assert q[2] > q[0] and q == quotas(reads.read_work(weights), slots).tolist()
    work = reads.read_work(weights)
    assert work == pytest.approx(shares * 2048 * np.asarray([m.per_token for m in reads.meters]))


def test_weights_by_tokens_into_a_document_budget_give_shares_of_the_documents(small_sources):
    """The other way round: shares of tokens, a budget of documents. A source of long
    documents brings few of a step's documents for its share of the tokens."""
    plan = make_plan(
        small_sources,
        batch={"seq_len": 256, "global_tokens": None, "global_documents": 16},
        loader={"workers": 4, "task_seconds": 0},
    )
    plane = InlineDataPlane(plan)
    for t in range(4):
        plane.step(t)
    reads, coord = plane.coord.components.reads, plane.coord
    weights = coord.view.weights_at(coord.view.next_step)
    lengths = coord.components.sources.mean_lengths()
    shares = reads.budget_shares(weights)
    assert (lengths > 0).all() and lengths[2] > 3 * lengths[0]
    assert shares == pytest.approx((weights / lengths) / (weights / lengths).sum())
    assert shares[2] < weights[2] / weights.sum()
    stats = coord.view.stats()["sources"]
    assert [s["read_window"] for s in stats] == [
        reads.window(i, float(shares[i])) for i in range(len(shares))
    ]


def test_quotas_react_to_weight_changes_and_worker_counts(small_sources):
    plan = make_plan(small_sources, loader={"workers": 2, "task_seconds": 0})
    plane = InlineDataPlane(plan, timing=_costly(plan, [0.001, 0.001, 0.001]))
    for t in range(3):
        plane.step(t)
    coord = plane.coord
    before = coord.components.reads.read_quotas(coord.view.weights_at(coord.view.next_step))
    coord.set_weights({"web": 0.1, "code": 0.1, "books": 10})
    after = coord.components.reads.read_quotas(coord.view.weights_at(coord.view.next_step))
    assert after[2] > before[2] and after[0] <= before[0]
    coord.handle(WorkersChanged(8, 16))  # cluster.scale(8), two threads each
    scaled = coord.components.reads.read_quotas(coord.view.weights_at(coord.view.next_step))
    assert scaled.sum() == 16 * plan.loader.reads_per_slot and scaled[2] > after[2]
    assert coord.view.stats()["worker_threads"] == 16


def test_slow_units_are_read_in_portions_that_report_as_one(small_sources):
    plan = make_plan(small_sources, loader={"task_seconds": 0.5})
    plane = InlineDataPlane(plan, timing=_costly(plan, [0.0, 0.0, 0.5]))  # 16 rows: 8 s
    reads = record_reads(plane)
    for t in range(6):
        plane.step(t)
    books = [r for r in reads if r.source == 2]
    split = [r for r in books if "-p" in r.key]
    assert split, "books units should be read in portions once measured"
    assert all(r.stop - r.start <= 2 for r in split)  # 0.5 s at 0.5 s per record: ~1 row each
    assert plane.coord.view.stats()["sources"][2]["read_portions"] > 1


def test_the_stream_is_unchanged_by_portions_quotas_and_worker_counts(small_sources):
    plan = make_plan(small_sources, batch={"seq_len": 128, "global_tokens": 1024})
    ref = [bs for _, bs in InlineDataPlane(plan).stream(10)]
    off = dataclasses.replace(plan, loader=dataclasses.replace(plan.loader, quotas=False))
    slow = _costly(plan, [0.05, 0.2, 0.4])
    variants = [
        InlineDataPlane(plan, timing=slow, shuffle_reports=1),
        InlineDataPlane(off, timing=slow),
    ]
    variants[0].coord.handle(WorkersChanged(1, 1))
    for plane in variants:
        for t, bs in enumerate(ref):
            if t == 5:
                plane.coord.handle(WorkersChanged(7, 7))
            got = plane.step(t)
            for g in bs:
                for a, b in zip(bs[g].micro_batches, got[g].micro_batches, strict=True):
                    assert_batches_equal(a, b)

"""Which batch each rank gets, at scale: blocks of DP groups, incremental positions, agents'
requests, the step cycle in phases, waiting agents, prefetch hysteresis (no cluster)."""

from __future__ import annotations

import asyncio
import random
import threading

import numpy as np
import pytest

from omniload_dask.cluster.waiters import Waiters
from omniload_dask.core.actions import SubmitConstruct
from omniload_dask.core.blocks import fetch_depth, groups_per_task, steps_per_task, together_end
from omniload_dask.core.events import StepsRequested
from omniload_dask.core.keys import parse as parse_key
from omniload_dask.core.positions import RankPositions, Tournament
from omniload_dask.errors import PlanError
from omniload_dask.plan import LayoutSpec, parse_plan
from omniload_dask.testing import InlineDataPlane, batch_digest
from omniload_dask.trainer.prefetch import Prefetcher

from .conftest import make_plan


def _fields(key: str) -> tuple[str, ...]:
    """A task key's fields after its run id (:func:`omniload_dask.core.keys.parse`)."""
    name = parse_key(key)
    assert name is not None, key
    return name.fields


def test_a_tournament_tree_tracks_the_smallest_and_largest_value_under_updates():
    rng = random.Random(5)
    for n in (1, 2, 7, 64, 100):
        values = [rng.randrange(1000) for _ in range(n)]
        low, high = Tournament(values), Tournament(values, largest=True)
        for _ in range(300):
            i, v = rng.randrange(n), rng.randrange(1000)
            values[i] = v
            low.update(i, v)
            high.update(i, v)
            assert (low.top, high.top) == (min(values), max(values))


def test_rank_positions_keep_group_minima_and_the_job_wide_extremes_without_a_scan():
    layout = LayoutSpec(dp=8, tp=2, cp=2)
    where = RankPositions(layout, start=3)
    rng = np.random.default_rng(1)
    for _ in range(200):
        g = int(rng.integers(8))
        ranks = np.asarray(layout.group_ranks(g))[rng.random(4) < 0.6]
        if not len(ranks):
            continue
        start = int(rng.integers(0, 50))
        assert where.move(ranks, start, start + 2, 1.0) == [g]
        for h in range(8):
            assert where.group_min[h] == where.position[layout.group_ranks(h)].min()
        assert where.slowest == where.position.min()
        assert where.furthest == where.requested.max()


def test_an_agent_request_moves_all_its_ranks_and_releases_what_its_groups_fetched(small_sources):
    plan = make_plan(small_sources, layout={"dp": 2, "tp": 2}, loader={"groups_per_task": 1})
    plane = InlineDataPlane(plan)
    list(plane.stream(3))
    held = dict(plane.coord.components.delivery.held)
    steps = sorted({s for s, _ in held})
    assert steps[0] == 2 and all((s, g) in held for s in steps for g in range(2))
    # one agent for DP group 0's two ranks
    actions = plane.coord.handle(StepsRequested([0, 1], steps[-1] + 1, 4))
    released = {k for a in actions if hasattr(a, "keys") for k in a.keys}
    assert {held[(s, 0)] for s in steps} <= released
    assert not {held[(s, 1)] for s in steps} & released  # group 1 has not moved
    assert plane.coord.components.delivery.where.furthest == steps[-1] + 5


def test_ranks_all_waiting_at_one_step_are_not_said_to_hold_one_another_back(small_sources):
    plan = make_plan(small_sources, layout={"dp": 2})
    plane = InlineDataPlane(plan)
    delivery = plane.coord.components.delivery
    plane.coord.handle(StepsRequested([0, 1], 0, 400))  # both ask far ahead, none fetched yet
    assert delivery.held_back() is None  # (the step is not built yet: no rank is to blame)
    plane.coord.handle(StepsRequested([1], 300, 400))  # rank 1 moved on, rank 0 did not
    held = delivery.held_back()
    assert held is not None and held["ranks"] == [0] and held["step"] == 0


def test_blocks_build_several_dp_groups_in_one_task_and_every_rank_gets_its_own_part(
    small_sources,
):
    layout = {"dp": 4, "tp": 1, "cp": 2}
    one = InlineDataPlane(make_plan(small_sources, layout=layout))
    coarse = make_plan(small_sources, layout=layout, loader={"groups_per_task": 3})
    assert groups_per_task(coarse) == 3
    plane = InlineDataPlane(coarse)
    constructs = []
    orig = plane._run

    def spy(actions):
        constructs.extend(a for a in actions if isinstance(a, SubmitConstruct))
        orig(actions)

    plane._run = spy  # type: ignore[method-assign]
    for step in range(4):
        want = one.fetch(step)
        got = plane.fetch(step)
        for rank in want:
            assert batch_digest(one.batches[want[rank]]) == batch_digest(plane.batches[got[rank]])
    step_of = {a.key: int(_fields(a.key)[0]) for a in constructs}  # block keys: (step, block)
    per_step = {s: [a.groups for a in constructs if step_of[a.key] == s] for s in step_of.values()}
    assert all(groups == [(0, 1, 2), (3,)] for groups in per_step.values())
    for a in constructs:  # each read of a block once, and every recipe's slots point into it
        assert len({r.key for r in a.reads}) == len(a.reads)
        slots = {r for t in a.recipes for r in t.slot_reads.tolist()}
        assert slots == set(range(len(a.reads)))


def test_the_default_block_size_keeps_at_most_eight_tasks_a_step_of_half_a_million_tokens(
    small_sources,
):
    def size(dp: int, seq_len: int, micro: int = 1) -> int:
        batch = {"seq_len": seq_len, "micro_batches": micro}
        return groups_per_task(make_plan(small_sources, layout={"dp": dp}, batch=batch))

    # 8,192-token groups: one block a step up to 64 groups, then about eight blocks a step
    for dp, groups in ((1, 1), (8, 8), (64, 64), (65, 64), (512, 64), (2048, 256)):
        assert size(dp, 8192) == groups
    # long groups: eight blocks a step as soon as each holds half a million tokens
    assert size(16, 65536) == 8
    assert size(16, 65536, micro=4) == 2
    assert size(8, 1 << 20) == 1


def test_a_step_drawn_dealt_and_committed_in_phases_is_the_step_advance_makes(small_plan):
    inline = InlineDataPlane(small_plan)
    phased = InlineDataPlane(small_plan)
    coord = phased.coord
    for step in range(5):
        ref = {g: batch_digest(b) for g, b in inline.step(step).items()}
        for rank in range(small_plan.layout.world_size):
            coord.handle(StepsRequested(rank, step, 1))
        while coord.view.dealt_step <= step:
            phased._settle()
            drawn = coord.draw_step()
            if drawn is None:
                continue
            assert coord.view.busy and coord.view.next_step == drawn.step + 1
            assert coord.view.dealt_step == drawn.step  # not fetchable before its commit
            coord.set_weights({"web": 2.0})  # a change meanwhile counts from the next step
            assert coord.view.log[-1]["step"] == drawn.step + 1
            coord.commit_step(coord.deal_steps([drawn])[0])
            phased._run(coord.take_actions())
        got = {g: batch_digest(b) for g, b in phased.step(step).items()}
        assert got == ref


def test_waiting_agents_wake_only_for_what_they_wait_for():
    async def main():
        waiters = Waiters()
        woke = []

        async def agent(name, blocker):
            await waiters.wait(blocker, 5.0)
            woke.append(name)

        tasks = [
            asyncio.create_task(agent("step3", 3)),
            asyncio.create_task(agent("step5", 5)),
            asyncio.create_task(agent("key", "omniload-batch-x-2-0")),
        ]
        await asyncio.sleep(0.01)
        assert len(waiters) == 3
        waiters.dealt(4)  # steps 0..3 dealt
        await asyncio.sleep(0.01)
        assert woke == ["step3"]
        waiters.key_ready("omniload-batch-x-2-1")  # another block
        await asyncio.sleep(0.01)
        assert woke == ["step3"]
        waiters.key_ready("omniload-batch-x-2-0")
        await asyncio.sleep(0.01)
        assert woke == ["step3", "key"]
        waiters.wake_all()
        await asyncio.gather(*tasks)
        assert woke == ["step3", "key", "step5"] and len(waiters) == 0
        await waiters.wait(2, 0.01)  # dealt already: returns at once
        await waiters.wait(9, 0.01)  # times out and takes itself out
        assert len(waiters) == 0

    asyncio.run(main())


def test_prefetch_refills_with_hysteresis_several_steps_a_call():
    asked = []

    def fetch(start, count):
        asked.append((start, count))
        return [f"s{start + i}" for i in range(count)], None

    pre = Prefetcher(fetch, 0, 8, max_steps=40)
    for step in range(40):
        assert pre.take(step) == f"s{step}"
        pre.done(step)
    pre.close()
    assert asked[0] == (0, 8)
    assert all(count >= 4 for _, count in asked[1:-1])  # refill 4: one call per 4 steps
    assert len(asked) <= 40 // 4 + 1
    assert [s for s, _ in asked] == sorted(s for s, _ in asked)


def test_prefetch_on_an_event_loop_asks_the_same_and_stops_in_one_round_trip():
    from omniload_dask.trainer.link import io_loop

    asked = []
    thread_names = set()

    async def fetch(start, count):
        asked.append((start, count))
        thread_names.add(threading.current_thread().name)
        await asyncio.sleep(0)
        return [f"s{start + i}" for i in range(count)], 30

    pre = Prefetcher(fetch, 0, 8, loop=io_loop())
    got = []
    with pytest.raises(StopIteration):
        for step in range(40):
            got.append(pre.take(step))
            pre.done(step)
    pre.close()
    assert got == [f"s{s}" for s in range(30)]
    assert asked[0] == (0, 8) and all(count >= 4 for _, count in asked[1:-1])
    assert thread_names == {"omniload-io"}  # no thread of its own


def test_prefetch_on_an_event_loop_retries_lost_connections_and_raises_job_errors():
    from omniload_dask.errors import JobError
    from omniload_dask.trainer.link import io_loop

    calls = []

    async def fetch(start, count):
        calls.append(start)
        if len(calls) == 1:
            raise ConnectionResetError("lost")
        if start >= 2:
            raise JobError("the job failed")
        return [start], None

    pre = Prefetcher(fetch, 0, 1, loop=io_loop())
    assert pre.take(0) == 0
    pre.done(0)
    assert pre.take(1) == 1
    pre.done(1)
    with pytest.raises(JobError, match="the job failed"):
        pre.take(2)
    pre.close()
    assert pre.reconnects == 1


def test_the_default_steps_per_task_fills_a_task_with_a_million_tokens_of_small_steps(
    small_sources,
):
    def steps(dp: int, seq_len: int = 8192, micro: int = 1, **loader: int) -> int:
        batch = {"seq_len": seq_len, "micro_batches": micro}
        plan = make_plan(small_sources, layout={"dp": dp}, batch=batch, loader=loader)
        return steps_per_task(plan)

    assert [steps(dp) for dp in (1, 8, 16, 64, 65, 1024)] == [16, 16, 8, 2, 1, 1]
    assert steps(8, micro=4) == 4
    assert steps(8, groups_per_task=4) == 1  # several blocks a step: one step a task
    assert steps(1024, steps_per_task=3) == 3  # the plan's own choice wins
    plan = make_plan(small_sources, layout={"dp": 8}, batch={"seq_len": 8192, "micro_batches": 1})
    assert fetch_depth(plan) == 32  # a rank asks for two blocks' steps at most
    with pytest.raises(PlanError, match="steps_per_task"):
        make_plan(small_sources, loader={"steps_per_task": -1})


def test_a_block_of_several_steps_delivers_every_step_as_one_step_blocks_do(small_sources):
    one = InlineDataPlane(make_plan(small_sources, loader={"steps_per_task": 1}))
    plan = make_plan(small_sources, loader={"steps_per_task": 4})
    plane = InlineDataPlane(plan)
    constructs: list[SubmitConstruct] = []
    orig = plane._run

    def spy(actions):
        constructs.extend(a for a in actions if isinstance(a, SubmitConstruct))
        orig(actions)

    plane._run = spy  # type: ignore[method-assign]
    for (t, want), (s, got) in zip(one.stream(10), plane.stream(10), strict=True):
        assert t == s
        assert {g: batch_digest(b) for g, b in got.items()} == {
            g: batch_digest(b) for g, b in want.items()
        }
    built = [a for a in constructs if _fields(a.key)[1].startswith("k")]  # (first, k{steps})
    # the first step alone (the first batch waits for one step), then blocks of 4
    assert [_fields(a.key) for a in built[:3]] == [("0", "k1"), ("1", "k4"), ("5", "k4")]
    for a in built:  # one table per step, every read of the block once
        first, k = _fields(a.key)
        assert [t.step for t in a.recipes] == list(range(int(first), int(first) + int(k[1:])))
        assert len({r.key for r in a.reads}) == len(a.reads)
        assert {r for t in a.recipes for r in t.slot_reads.tolist()} == set(range(len(a.reads)))
        assert a.stride == plan.layout.dp
    # the reads held for a block are released after it is built, never before: nothing is
    # read twice
    assert plane.reads == one.reads


def test_the_steps_of_a_block_being_drawn_are_not_fetchable_until_its_last_is(small_sources):
    plane = InlineDataPlane(make_plan(small_sources, loader={"steps_per_task": 4}))
    coord = plane.coord
    for rank in range(2):
        coord.handle(StepsRequested(rank, 0, 4))  # the draw target: step 4 + lookahead 2
    seen = []
    for _ in range(200):
        drawn = coord.draw_step()
        if drawn is None:
            plane._run(coord.take_actions())
            plane.read_one()  # a draw waits for a read
            continue
        coord.commit_step(coord.deal_steps([drawn])[0])
        seen.append((drawn.step, coord.view.dealt_step, coord.batch_for(0, drawn.step)))
        plane._run(coord.take_actions())
        if drawn.step == 5:
            break
    dealt = [p for _, p, _ in seen]
    # step 0 alone, then steps 1-4 fetchable once step 4 is in
    assert dealt == [1, 1, 1, 1, 5, 5]
    assert [part is None for *_, part in seen] == [False, True, True, True, False, True]
    assert coord.batch_for(1, 3) == (coord.components.delivery.held[(3, 1)], 2 * 2 + 1)
    assert coord.components.delivery.draw_target() >= 9  # the draw goes on to the block's end


@pytest.mark.parametrize(
    ("first", "most", "steps", "end"),
    [(0, 8, 4, 5), (0, 4, 4, 1), (1, 8, 4, 9), (3, 8, 4, 9), (5, 8, 4, 13), (1, 8, 8, 9), (1, 8, 16, 9),
     (9, 8, 16, 17), (17, 8, 16, 25), (4, 8, 1, 12), (1, 1, 4, 2), (1, 3, 4, 4)],
)  # fmt: skip
def test_steps_dealt_together_end_at_a_block_end(first, most, steps, end):
    # origin 0: step 0 alone, then blocks of ``steps`` from step 1 (longer than a batch of
    # ``most``: in batches of most, the last cut at the block's end)
    assert together_end(first, most, 0, steps) == end


def test_whole_blocks_are_dealt_together_and_a_block_drawn_in_part_waits(small_sources):
    # four reads in flight (2 workers x 2 read slots x 1), so that some draws wait for one
    loader = {"steps_per_task": 4, "reads_per_slot": 1}
    plane = InlineDataPlane(make_plan(small_sources, loader=loader))
    coord = plane.coord
    batches, drawn, waited = [], [], 0
    for _ in range(1000):
        if not drawn:
            for rank in range(2):  # the ranks are 8 steps behind the last dealt one
                coord.handle(StepsRequested(rank, max(0, coord.view.dealt_step - 8), 20))
            one = coord.draw_step()
            drawn = [one] if one is not None else []
        batch, drawn = coord.draw_together(drawn, 8) if drawn else ([], [])
        if not batch:  # the draw waits for a read (steps of a block drawn in part, or none)
            waited += bool(drawn)
            plane._run(coord.take_actions())
            plane.read_one()
            continue
        for dealt in coord.deal_steps(batch):
            coord.commit_step(dealt)
        plane._run(coord.take_actions())
        batches.append([d.step for d in batch])
        if batches[-1][-1] >= 40:
            break
    assert [s for b in batches for s in b] == list(range(batches[-1][-1] + 1))
    # a job's first step is a block of its own, then blocks of 4 from step 1: whole blocks,
    # at most 8 steps a batch
    assert batches[0] in ([0], [0, 1, 2, 3, 4])
    for batch in batches[1:]:
        assert batch[0] % 4 == 1 and len(batch) in (4, 8)
    assert waited  # (steps of a block drawn in part did wait for its reads)
    assert all(coord.batch_for(0, s) is not None for s in range(batches[-1][-1] + 1))


def test_a_stream_that_ends_inside_a_block_builds_the_steps_it_has(small_sources):
    def finite(steps: int) -> InlineDataPlane:
        data = make_plan(small_sources, loader={"steps_per_task": steps}).to_dict()
        for source in data["sources"]:
            source["epochs"] = 1
        return InlineDataPlane(parse_plan(data))

    def drain(plane: InlineDataPlane) -> list[list[tuple[int, ...]]]:
        out, step = [], 0
        while plane.coord.view.end_step is None or step < plane.coord.view.end_step:
            out.append([batch_digest(b) for _, b in sorted(plane.step(step).items())])
            step += 1
        return out

    want, got = drain(finite(1)), drain(finite(8))
    assert got == want and len(want) % 8  # it ends inside a block, every step delivered


def test_ranks_that_start_inside_a_block_get_the_steps_they_ask_for(small_sources):
    # Every rank resumes at step 6 of a fresh job: steps 1-5 of the block 1-8 are drawn but
    # left out of it (no rank wants them); step 6 is still the stream's step 6, not the
    # block's sixth table.
    one = InlineDataPlane(make_plan(small_sources, loader={"steps_per_task": 1}))
    want = {t: {g: batch_digest(b) for g, b in got.items()} for t, got in one.stream(10)}
    plane = InlineDataPlane(make_plan(small_sources, loader={"steps_per_task": 8}))
    for step in range(6, 10):
        got = plane.step(step)
        assert {g: batch_digest(b) for g, b in got.items()} == want[step], step

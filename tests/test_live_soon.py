"""Live changes felt soon: a change lands at the first step not built, and a job that expects
changes bounds how far the draw runs ahead of its ranks (``loader.live_lead``).

Steps drawn and not built (a block of several steps being drawn, or steps in flight between
their draw and their commit) are drawn again under the change; the stream must then equal a
fresh run's with the change in its log at that step, resume must replay it, and no sample may
be delivered twice.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from omniload_dask import JobError, PlanError
from omniload_dask.core.blocks import steps_per_task
from omniload_dask.core.events import StepsRequested
from omniload_dask.testing import InlineDataPlane, batch_digest

from .test_live_mixing import make

CHANGE = {"a": 0.0, "b": 0.2, "c": 0.8}


def plan_of(root: Path, checkpoint: bool = False, **loader):
    extra = (
        {"checkpoint": {"url": str(root / "ckpt"), "compact_every": 5, "keep_bases": 50}}
        if checkpoint
        else {}
    )
    return make(root, loader={"steps_per_task": 4, **loader}, **extra)


def digests(plane: InlineDataPlane, start: int, stop: int) -> dict[int, dict]:
    return {
        t: {g: batch_digest(b) for g, b in bs.items()}
        for t, bs in plane.stream(stop - start, start=start)
    }


def draw_unbuilt(plane: InlineDataPlane, count: int, commit: bool) -> None:
    """Draw ``count`` steps past the built ones and leave them unbuilt: committed into the
    block being drawn (``commit``), or in flight (drawn, not dealt)."""
    coord = plane.coord
    world = plane.plan.layout.world_size
    for rank in range(world):
        plane._run(coord.handle(StepsRequested(rank, coord.view.next_step, 64)))
    drawn = 0
    for _ in range(10_000):
        if drawn == count:
            return
        step = coord.draw_step(most_in_flight=count + 1)
        if step is None:  # its documents are not known yet: run a read
            plane._run(coord.take_actions())
            plane.read_one()
            continue
        drawn += 1
        if commit:
            dealt = coord.deal_steps([step])
            assert dealt is not None
            coord.commit_step(dealt[0])
    raise AssertionError("could not draw the steps")


@pytest.mark.parametrize("commit", [True, False], ids=["in-an-open-block", "in-flight"])
def test_a_change_lands_at_the_first_unbuilt_step_as_in_a_fresh_run(corpus, commit):
    plan = plan_of(corpus)
    plane = InlineDataPlane(plan)
    before = digests(plane, 0, 5)
    view = plane.coord.view
    built = view.dealt_step
    draw_unbuilt(plane, 3 if commit else 2, commit)
    drawn_to = view.next_step
    assert drawn_to > built == view.earliest_change
    # the first step not built, not the first not drawn
    assert plane.coord.set_weights(CHANGE).step == built < drawn_to
    assert view.next_step == built  # the steps drawn past it are drawn again
    after = digests(plane, 5, 30)

    fresh = InlineDataPlane(plan_of(corpus))
    fresh.coord.set_weights(CHANGE, at_step=built)
    expected = digests(fresh, 0, 30)
    assert {**before, **after} == expected
    assert plane.coord.view.log == fresh.coord.view.log
    unchanged = digests(InlineDataPlane(plan_of(corpus)), built, built + 1)
    assert unchanged[built] != expected[built]  # the change is felt at that step
    # the drawn-again steps draw nothing of a (weight 0) and deliver no sample twice
    for fig in plane.coord.view.history:
        if fig.step >= built:
            assert fig.source_documents[0] == 0
    ids = [
        (int(d), int(o))
        for t in range(30)
        for b in plane.step(t).values()
        for mb in b.micro_batches
        for d, o in zip(mb["doc_id"], mb["doc_offset"], strict=True)
    ]
    assert len(ids) == len(set(ids))


def test_an_explicit_step_among_the_drawn_ones_is_accepted_and_an_earlier_one_refused(corpus):
    plan = plan_of(corpus)
    plane = InlineDataPlane(plan)
    digests(plane, 0, 5)
    view = plane.coord.view
    built = view.dealt_step
    draw_unbuilt(plane, 3, commit=True)
    with pytest.raises(JobError, match=f"already built .* effect at is {built}"):
        plane.coord.set_weights(CHANGE, at_step=built - 1)
    assert view.log == []
    at = built + 2  # drawn, not built: steps built..at-1 are drawn again as they were
    assert plane.coord.set_weights(CHANGE, at_step=at).step == at
    got = digests(plane, 0, 20)
    fresh = InlineDataPlane(plan_of(corpus))
    fresh.coord.set_weights(CHANGE, at_step=at)
    assert got == digests(fresh, 0, 20)


def test_resume_across_a_redraw_replays_it(corpus):
    plan = plan_of(corpus, checkpoint=True)
    plane = InlineDataPlane(plan)
    digests(plane, 0, 5)
    built = plane.coord.view.dealt_step
    draw_unbuilt(plane, 3, commit=True)
    plane.checkpoint()  # (holds the steps below the first unbuilt one only)
    assert plane.coord.set_weights(CHANGE).step == built
    plane.checkpoint()
    ref = digests(plane, 0, 24)
    plane.checkpoint()
    for step in (built - 2, built, built + 3, 17):
        again = InlineDataPlane(plan, resume=step)
        assert again.coord.view.next_step == step
        assert digests(again, step, 24) == {t: ref[t] for t in range(step, 24)}, step


def test_mixture_counts_delivered_steps(corpus):
    plane = InlineDataPlane(plan_of(corpus))
    digests(plane, 0, 9)
    draw_unbuilt(plane, 3, commit=True)
    view = plane.coord.view
    delivered = view.delivered_step
    assert view.next_step > delivered
    mix = view.mixture(window=4)
    shown = [f for f in view.history if f.step < delivered][-4:]
    tokens = [sum(f.source_tokens[i] for f in shown) for i in range(3)]
    for i, row in enumerate(mix):
        assert row["delivered_step"] == delivered
        assert row["realised_window"] == pytest.approx(tokens[i] / sum(tokens))
    every = [f for f in view.history if f.step < delivered]
    total = [sum(f.source_tokens[i] for f in every) for i in range(3)]
    assert [r["realised_total"] for r in mix] == pytest.approx([t / sum(total) for t in total])


@pytest.mark.parametrize("lead", [0, 8])
def test_live_lead_bounds_the_draw_past_the_slowest_rank(corpus, lead):
    plan = make(corpus, loader={"live_lead": lead})
    k = steps_per_task(plan)
    plane = InlineDataPlane(plan)
    digests(plane, 0, 3)
    for rank in range(plan.layout.world_size):  # ranks ask for far more than the lead
        plane._run(plane.coord.handle(StepsRequested(rank, 3, 64)))
    plane._settle()
    view = plane.coord.view
    ahead = view.next_step - view.delivered_step
    if lead:
        assert k == lead // 2
        assert ahead <= lead + k
    else:
        assert ahead > 8 + k


def test_live_lead_must_be_a_whole_number_of_steps(corpus):
    with pytest.raises(PlanError, match="loader.live_lead"):
        make(corpus, loader={"live_lead": -1})

"""The padding share: empty positions of the micro-batches over their capacity, as
``job.stats()``, the run report and the dashboard's Omniload page show it."""

from __future__ import annotations

from pathlib import Path

import pytest

from omniload_dask.batching.formats import IGNORE_INDEX
from omniload_dask.batching.wire import expand
from omniload_dask.testing import InlineDataPlane

from .test_loss_tokens import corpus, sft_plan  # noqa: F401  (the corpus fixture)


@pytest.mark.parametrize("pad", [False, True])
def test_padding_share_is_the_empty_positions_of_the_micro_batches_drawn(
    corpus: Path,  # noqa: F811
    pad: bool,
) -> None:
    plan = sft_plan(
        corpus,
        batch={"seq_len": 2048, "micro_batches": 2, "global_tokens": 6000,
               "long_documents": "truncate", "pad_to_seq_len": pad},
        layout={"dp": 2},
    )  # fmt: skip
    plane = InlineDataPlane(plan)
    for step in range(3):
        plane.step(step)
    stats = plane.coord.view.stats()
    drawn = stats["steps_drawn"]
    empty = capacity = 0
    for step in range(drawn):
        for batch in plane.step(step).values():
            for mb in batch.micro_batches:
                capacity += int(mb["seq_len"])
                tokens = int(mb["num_tokens"])
                empty += int(mb["seq_len"]) - tokens
                if pad:  # the padded positions are there, and none of them is a target
                    assert len(mb["input_ids"]) == int(mb["seq_len"])
                    assert (expand(mb)["labels"][tokens:] == IGNORE_INDEX).all()
    assert 0 < empty < capacity
    assert stats["padding_share"] == pytest.approx(empty / capacity, abs=1e-12)


def test_the_run_report_and_the_dashboard_show_the_padding_share(
    corpus: Path,  # noqa: F811
) -> None:
    from omniload_dask.cli.runner import format_report, run_plan
    from omniload_dask.observe.dashboard import padding_text

    plan = sft_plan(
        corpus,
        name="padding",
        batch={"seq_len": 2048, "micro_batches": 2, "global_tokens": 6000,
               "long_documents": "truncate"},
        layout={"dp": 2},
    )  # fmt: skip
    report = run_plan(plan, steps=3, workers=1, progress=False)
    assert 0 < report.padding_share < 1
    assert report.padding_share == pytest.approx(1 - report.fill)
    assert f"padding share       {report.padding_share:.2%}" in format_report(report)
    assert report.to_dict()["padding_share"] == report.padding_share
    assert padding_text({"padding_share": 0.0123}) == "padding 1.23%"
    assert padding_text({"padding_share": None}) == ""

"""A feeder's arguments become one frozen FeederOptions, checked before anything opens."""

from __future__ import annotations

import dataclasses

import pytest

from omniload_dask import Feeder
from omniload_dask.errors import JobError
from omniload_dask.trainer.options import FeederOptions

NOWHERE = "tcp://127.0.0.1:9"  # nothing listens: a feeder that reached for it would fail otherwise


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"fanout": "everyone"}, "fanout must be one of none, broadcast, node, got 'everyone'"),
        ({"output": "jax"}, "output must be 'torch' or 'numpy', got 'jax'"),
        ({"address": None}, "give a client or a scheduler address"),
    ],
)
def test_a_bad_argument_is_refused_before_any_connection(kwargs, message) -> None:
    with pytest.raises(JobError, match=message):
        Feeder("job", **{"address": NOWHERE, **kwargs})


def test_the_options_are_frozen_and_say_what_was_asked() -> None:
    options = FeederOptions.of(
        "job", address=NOWHERE, output="numpy", fanout=None, node_ranks=[0, 1], dp_rank=1
    )
    assert options.node_ranks == (0, 1) and options.stream == "train" and options.fanout is None
    assert options.ranks["dp_rank"] == 1 and options.ranks["rank"] is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.job = "other"  # type: ignore[misc]


def test_a_pass_keeps_the_start_and_end_the_caller_gave() -> None:
    asked = FeederOptions.of("job", address=NOWHERE, output="numpy", fanout=None, max_steps=3)
    passed = asked.for_pass("job-validation-0", 10, 20)
    assert (passed.job, passed.start_step, passed.max_steps) == ("job-validation-0", 10, 3)
    assert asked.job == "job"  # (a new object: the options asked for stay as they were)

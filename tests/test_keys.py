"""Task keys: every kind :class:`Keys` builds is taken apart by :func:`parse` into what built it."""

from __future__ import annotations

import pytest

from omniload_dask.core.keys import (
    BATCH,
    DISCOVER,
    READ,
    TOKENIZER,
    KeyName,
    Keys,
    is_batch,
    is_data_key,
    is_read,
    parse,
    read_source,
    run_of,
)

RUN = "1a2b3c4d"  # a run id as the plugin makes one: hex digits, no dash


@pytest.mark.parametrize(
    ("key", "want"),
    [
        (Keys(RUN).read(3, (2, 17)), KeyName(READ, RUN, ("3", "2", "17"))),
        (
            Keys.read_portion(Keys(RUN).read(3, (2, 17)), 1),
            KeyName(READ, RUN, ("3", "2", "17", "p1")),
        ),
        (Keys(RUN).block(40, 5), KeyName(BATCH, RUN, ("40", "5"))),
        (Keys(RUN).steps_block(8, 4), KeyName(BATCH, RUN, ("8", "k4"))),
        (Keys(RUN).rebuild(7, 2, 1), KeyName(BATCH, RUN, ("7", "g2", "r1"))),
        (Keys(RUN).discover(0), KeyName(DISCOVER, RUN, ("0",))),
        (Keys(RUN).discover("web", 12), KeyName(DISCOVER, RUN, ("web", "12"))),
        (Keys(RUN).tokenizer(), KeyName(TOKENIZER, RUN, ())),
    ],
)
def test_every_key_parses_back_into_its_kind_run_and_fields(key, want):
    assert parse(key) == want
    assert is_data_key(key)
    assert is_read(key) == (want.kind == READ)
    assert is_batch(key) == (want.kind == BATCH)
    # the run of every kind a job's events come from; the tokenizer's check runs before a job
    assert run_of(key) == (None if want.kind == TOKENIZER else RUN)


def test_the_source_of_a_read_key_whole_or_in_parts():
    keys = Keys(RUN)
    for source in (0, 7, 12):
        key = keys.read(source, (1, 99))
        assert read_source(key) == source
        assert read_source(Keys.read_portion(key, 3)) == source
    with pytest.raises(ValueError, match="not a read task's key"):
        read_source(keys.block(1, 0))


@pytest.mark.parametrize(
    "key", [None, 17, ("omniload-read", 0), "read-x-0", "omniload-", "omniload--x-0", "other"]
)
def test_what_is_not_a_data_plane_key_parses_to_none(key):
    assert parse(key) is None
    assert run_of(key) is None
    assert not is_read(key) and not is_batch(key)


def test_keys_of_two_runs_never_meet():
    a, b = Keys("aaaa0001"), Keys("aaaa0002")
    assert a.block(3, 0) != b.block(3, 0)
    assert run_of(a.block(3, 0)) == "aaaa0001" and run_of(b.read(0, (0, 0))) == "aaaa0002"

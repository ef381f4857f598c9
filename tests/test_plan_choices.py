"""Choice fields: the parser takes exactly the words of each field's ``Literal`` (plan.choices),
names the field, the value and the words on anything else, and keeps the YAML word as given."""

from __future__ import annotations

from typing import Any, get_args

import pytest

from omniload_dask import PlanError, parse_plan
from omniload_dask.plan import choices

from .datagen import plan_dict

SRC = {"name": "web", "format": "jsonl", "path": "/data/*.jsonl"}
CHAT_SRC = {**SRC, "chat": {}}


def _at(path: str, value: Any, source: dict[str, Any] | None = None) -> dict[str, Any]:
    """A plan with ``value`` at the dotted ``path`` (``sources.0.x`` edits the first source)."""
    src = dict(source or SRC)
    plan = plan_dict([src])
    head, *rest = path.split(".")
    if head == "sources":
        target = src
        for key in rest[1:-1]:
            target = target.setdefault(key, {})
        target[rest[-1]] = value
        plan["sources"] = [src]
    elif rest:
        plan.setdefault(head, {})
        plan[head] = {**plan[head], rest[0]: value}
    else:
        plan[head] = value
    return plan


# (dotted field path, its Literal, the field as the parsed plan holds it, a source it needs)
FIELDS = [
    ("on_error", choices.OnError, lambda p: p.on_error, None),
    ("batch.long_documents", choices.LongDocuments, lambda p: p.batch.long_documents, None),
    ("mixing.by", choices.MixingBy, lambda p: p.mixing.by, None),
    ("mixing.over", choices.MixingOver, lambda p: p.mixing.over, None),
    ("mixing.interpolate", choices.Interpolation, lambda p: p.mixing.interpolate, None),
    ("loader.fanout", choices.Fanout, lambda p: p.loader.fanout, None),
    ("tokenizer.kind", choices.TokenizerKind, lambda p: p.tokenizer.kind, None),
    ("sources.0.chat.layout", choices.ChatLayout, lambda p: p.sources[0].chat.layout, CHAT_SRC),
]


@pytest.mark.parametrize(("path", "literal", "read", "source"), FIELDS)
def test_a_choice_field_names_its_words_on_any_other(path, literal, read, source) -> None:
    with pytest.raises(PlanError) as info:
        parse_plan(_at(path, "no-such-word", source))
    text = str(info.value)
    assert path.replace(".0.", "[0].") in text and "'no-such-word'" in text
    assert all(repr(word) in text for word in get_args(literal))


@pytest.mark.parametrize(("path", "literal", "read", "source"), FIELDS)
def test_a_choice_field_keeps_the_word_the_plan_gives(path, literal, read, source) -> None:
    words = get_args(literal)
    for word in words:
        if path == "tokenizer.kind" and word != "byte":
            continue  # the others need a tokenizer file
        plan = parse_plan(_at(path, word, source))
        assert read(plan) == word


def test_each_tuple_of_words_is_its_literals() -> None:
    pairs = {
        "ON_ERROR": choices.OnError,
        "LONG_DOCUMENTS": choices.LongDocuments,
        "MIXING_BY": choices.MixingBy,
        "MIXING_OVER": choices.MixingOver,
        "INTERPOLATIONS": choices.Interpolation,
        "FANOUTS": choices.Fanout,
        "SOURCE_FORMATS": choices.SourceFormat,
        "TOKENIZER_KINDS": choices.TokenizerKind,
        "FLAT_DTYPES": choices.FlatDtype,
        "TOKEN_DTYPES": choices.TokenDtype,
        "CHAT_LAYOUTS": choices.ChatLayout,
        "TRAIN_ON": choices.TrainOn,
    }
    for name, literal in pairs.items():
        assert getattr(choices, name) == get_args(literal), name

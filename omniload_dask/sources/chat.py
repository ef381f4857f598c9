"""Conversations out of records: what a chat source's reads keep of each record.

A format (JSON Lines, Parquet) hands each record of a chat source to :func:`conversation`,
which checks the layout the plan declares and returns the record's conversation in one form,
or the reason it is a bad record::

    messages   {"messages": [{"role": "user", "content": "hi"}, ...]}  -> the list as it is
    sharegpt   {"conversations": [{"from": "human", "value": "hi"}]}    -> [{"role": "user",
                                                                            "content": "hi"}]
    prompt_completion  {"prompt": "2+2=", "completion": "4"}           -> {"prompt": ...,
                                                                            "completion": ...}

The result is a plain Python value (lists, dicts, strings), so it pickles and its rendering
(:mod:`omniload_dask.preprocess.chat`) is the same wherever it runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omniload_dask.plan.chat import SHAREGPT_ROLES, ChatSpec

__all__ = ["conversation"]


def conversation(chat: ChatSpec, record: Mapping[str, Any]) -> Any:
    """The record's conversation, or a ``str`` saying why the record is bad."""
    if chat.layout == "prompt_completion":
        return _prompt_completion(chat, record)
    value = record.get(chat.field)
    if value is None:
        return f"no field {chat.field!r}"
    if not isinstance(value, list) or not value:
        return f"field {chat.field!r} must be a non-empty list of turns, got {_kind(value)}"
    if chat.layout == "messages":
        return _messages(chat.field, value)
    return _sharegpt(chat.field, value)


def _messages(name: str, turns: list[Any]) -> Any:
    for i, turn in enumerate(turns):
        if not isinstance(turn, Mapping):
            return f"{name}[{i}] must be an object with role and content, got {_kind(turn)}"
        if not isinstance(turn.get("role"), str):
            return f"{name}[{i}] has no role (a string)"
        if "content" not in turn:
            return f"{name}[{i}] has no content"
    # (Parquet structs give every key of the schema: drop the null ones a template would test)
    return [{k: v for k, v in turn.items() if v is not None} for turn in turns]


def _sharegpt(name: str, turns: list[Any]) -> Any:
    out = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, Mapping):
            return f"{name}[{i}] must be an object with from and value, got {_kind(turn)}"
        speaker = turn.get("from")
        if speaker not in SHAREGPT_ROLES:
            known = ", ".join(sorted(SHAREGPT_ROLES))
            return f"{name}[{i}].from is {speaker!r}, not a ShareGPT speaker ({known})"
        if not isinstance(turn.get("value"), str):
            return f"{name}[{i}].value must be a string, got {_kind(turn.get('value'))}"
        out.append({"role": SHAREGPT_ROLES[speaker], "content": turn["value"]})
    return out


def _prompt_completion(chat: ChatSpec, record: Mapping[str, Any]) -> Any:
    out = {}
    for key, name in (("prompt", chat.field), ("completion", chat.completion)):
        value = record.get(name)
        if value is None:
            return f"no field {name!r}"
        if isinstance(value, list):
            turns = _messages(name, value)
            if isinstance(turns, str):
                return turns
            value = turns
        elif not isinstance(value, str):
            return f"field {name!r} must be a string or a list of messages, got {_kind(value)}"
        out[key] = value
    if isinstance(out["prompt"], str) != isinstance(out["completion"], str):
        return (
            f"fields {chat.field!r} and {chat.completion!r} must both be strings or both be "
            "lists of messages"
        )
    return out


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__

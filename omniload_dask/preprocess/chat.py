"""Chat templates rendered as ``transformers`` renders them, with the text spans to train on.

A template is Jinja text (a tokenizer's ``chat_template`` or the plan's). It runs in a sandboxed
Jinja environment set up like the one ``transformers``' ``apply_chat_template`` uses: blocks
trimmed (``trim_blocks``, ``lstrip_blocks``), loop controls, ``tojson`` that keeps non-ASCII
text, and the globals ``raise_exception`` and ``strftime_now``; the tokenizer's special tokens
(``bos_token``, ``eos_token``, ...) are variables. Rendered with the same conversation, the same
template gives the same text, so the same tokenizer gives the same token ids.

Which characters are targets comes from ``{% generation %}`` blocks where the template has them
(the text each block emits), else from rendering prefixes: turn i is the text that rendering
``messages[:i + 1]`` adds to rendering ``messages[:i]`` (for an assistant turn, after the
generation prompt)::

    ChatML, [user "hi", assistant "yo"]
    render([])                    ""
    render([user])                "<|im_start|>user\\nhi<|im_end|>\\n"
    ... + generation prompt       "<|im_start|>user\\nhi<|im_end|>\\n<|im_start|>assistant\\n"
    render([user, assistant])     "...<|im_start|>assistant\\nyo<|im_end|>\\n"
    assistant span                            "yo<|im_end|>\\n"

A template whose rendering of a conversation does not start with the rendering of its prefix
cannot be cut into turns this way: that is a :class:`ChatError` naming the turn.
"""

from __future__ import annotations

import functools
import json
import re
from datetime import datetime
from typing import Any

__all__ = [
    "MARKS",
    "ChatError",
    "Template",
    "compile_template",
    "has_generation_tags",
    "holds_marks",
]

# (private-use characters mark where a generation block's text starts and ends)
_OPEN, _CLOSE = "\ue000", "\ue001"
MARKS = ("\\ue000", "\\ue001")  # the marks as json.dumps writes them
_GENERATION = re.compile(r"{%-?\s*generation\s*-?%}")


class ChatError(ValueError):
    """One conversation cannot be rendered or cut into turns; the message says why."""


def has_generation_tags(text: str) -> bool:
    """Whether the template marks its generation spans (``{% generation %}``)."""
    return bool(_GENERATION.search(text))


def holds_marks(value: Any) -> bool:
    """Whether a string anywhere in ``value`` (lists, dicts with their keys, strings) holds
    U+E000 or U+E001, which would be taken for the marks of a generation block. A walk with
    ``in`` on each string: cheaper than writing the value out as JSON to search it."""
    if isinstance(value, str):
        return _OPEN in value or _CLOSE in value
    if isinstance(value, dict):
        return any(holds_marks(k) or holds_marks(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(holds_marks(v) for v in value)
    return False


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # (not Jinja's own tojson, which escapes HTML characters: templates expect plain JSON)
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compiled(text: str) -> Any:
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}``: the body, between two marks."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_mark")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _mark(self, caller: Any) -> str:
            return f"{_OPEN}{caller()}{_CLOSE}"

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(text)


def compile_template(text: str, where: str) -> Template:
    """The template of Jinja ``text``; a :class:`ChatError` naming ``where`` if it is not
    valid Jinja."""
    try:
        compiled = _compiled(text)
    except Exception as exc:
        raise ChatError(f"{where}: the chat template is not valid Jinja ({exc})") from None
    return Template(compiled, has_generation_tags(text))


class Template:
    """A compiled chat template; :meth:`render` gives text and generation spans."""

    def __init__(self, compiled: Any, generation: bool) -> None:
        self._compiled = compiled
        self.generation = generation

    def render(
        self, messages: list[Any], variables: dict[str, Any], add_generation_prompt: bool = False
    ) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and the character spans of its generation blocks."""
        try:
            raw = self._compiled.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=None,
                documents=None,
                **variables,
            )
        except Exception as exc:
            raise ChatError(f"the chat template fails: {type(exc).__name__}: {exc}") from None
        if _OPEN not in raw:
            return raw, []
        return _unmark(raw)

    def turn_spans(
        self, messages: list[Any], variables: dict[str, Any], full: str
    ) -> list[tuple[int, int, int]]:
        """``(start, stop, turn)`` of each turn's text in ``full`` (the whole conversation's
        rendering), by rendering prefixes (module docstring)."""
        spans = []
        try:
            before = self.render(messages[:0], variables)[0]
        except ChatError:  # (some templates refuse an empty conversation)
            before = ""
        for i, turn in enumerate(messages):
            after = full if i == len(messages) - 1 else self.render(messages[: i + 1], variables)[0]
            if not full.startswith(after) or not after.startswith(before):
                raise ChatError(
                    f"the template's rendering of turns 0..{i} is not the start of its rendering "
                    "of the whole conversation (it changes earlier turns), so turns cannot be "
                    "found by prefix; use a template with {% generation %} blocks or "
                    "train_on: everything"
                )
            start = len(before)
            if turn.get("role") == "assistant":
                prompt = self.render(messages[:i], variables, add_generation_prompt=True)[0]
                if after.startswith(prompt) and len(prompt) >= start:
                    start = len(prompt)  # (the generation prompt is not the model's to say)
            spans.append((start, len(after), i))
            before = after
        return spans


def _unmark(raw: str) -> tuple[str, list[tuple[int, int]]]:
    """Text without the generation marks, and the spans they enclosed."""
    parts = re.split(f"([{_OPEN}{_CLOSE}])", raw)
    out: list[str] = []
    spans = []
    at, depth, start = 0, 0, 0
    for part in parts:
        if part == _OPEN:
            if depth == 0:
                start = at
            depth += 1
        elif part == _CLOSE:
            depth -= 1
            if depth == 0 and at > start:
                spans.append((start, at))
        else:
            out.append(part)
            at += len(part)
    return "".join(out), spans

"""The ``chat`` section of a source: conversations rendered with a chat template, and what of
them is trained on.

A source without ``chat`` is plain text (every token a target). With it, each record holds one
conversation in one of three layouts, rendered into a document by a chat template::

    layout: messages            {"messages": [{"role": "user", "content": "hi"}, ...]}
    layout: sharegpt            {"conversations": [{"from": "human", "value": "hi"}, ...]}
    layout: prompt_completion   {"prompt": "2+2=", "completion": "4"}

``train_on`` says which tokens are targets: ``assistant`` (the assistant turns; the default of
the two chat layouts), ``all`` (every turn), ``last_assistant``, ``completion`` (the default of
``prompt_completion``) or ``everything``. The template is the tokenizer's own (the
``chat_template`` of a ``tokenizer_config.json`` beside its ``tokenizer.json``), or the plan's:
``template`` (the Jinja text) or ``template_file`` (a path or URL). A conversation longer than
``max_tokens`` (default: the batch's document cap) is a bad record, never cut: an error, or
skipped and counted under ``on_error: skip``::

    sources:
      - name: chat
        format: jsonl
        path: data/chat/*.jsonl
        chat: {layout: messages, train_on: assistant}
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from omniload_dask.plan.choices import CHAT_LAYOUTS, TRAIN_ON, ChatLayout, TrainOn
from omniload_dask.plan.fields import Fields, fail, resolve_path

__all__ = ["LAYOUTS", "TRAIN_ON", "ChatSpec", "read_chat"]

LAYOUTS = CHAT_LAYOUTS
_FIELD = {"messages": "messages", "sharegpt": "conversations", "prompt_completion": "prompt"}
# ShareGPT speakers as the roles chat templates know
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "tool": "tool", "function_call": "assistant",
                  "observation": "tool"}  # fmt: skip


@dataclass(frozen=True)
class ChatSpec:
    """How a source's records become conversations and which of their tokens are targets.

    ``field`` is the record's conversation field (``messages``, ``conversations``) or, for
    ``prompt_completion``, its prompt field; ``completion`` names the completion field. With
    neither ``template`` nor ``template_file`` the tokenizer's own template is used.
    """

    layout: ChatLayout = "messages"
    field: str = "messages"
    completion: str = "completion"
    train_on: TrainOn = "assistant"
    template: str | None = None
    template_file: str | None = None
    # longest conversation kept (tokens); a longer one is a bad record, never cut. Unset in the
    # plan: the batch's document cap (seq_len under truncate, or max_document_tokens)
    max_tokens: int | None = None

    @property
    def columns(self) -> tuple[str, ...]:
        """The record fields a read needs."""
        if self.layout == "prompt_completion":
            return (self.field, self.completion)
        return (self.field,)


def read_chat(f: Fields, base_dir: str | os.PathLike[str] | None) -> ChatSpec:
    """A source's ``chat`` section (see the module docstring)."""
    layout = f.choice("layout", "messages", CHAT_LAYOUTS)
    field = f.text("field", _FIELD[layout])
    completion = f.text("completion", "completion")
    if layout != "prompt_completion" and f.has("completion"):
        fail(f.at("completion"), "only applies to layout: prompt_completion", f.raw("completion"))
    default: TrainOn = "completion" if layout == "prompt_completion" else "assistant"
    train_on = f.choice("train_on", default, TRAIN_ON)
    if layout == "prompt_completion" and train_on in ("assistant", "last_assistant"):
        fail(
            f.at("train_on"),
            "a prompt/completion record has no turns: use completion, all or everything",
            train_on,
        )
    if layout != "prompt_completion" and train_on == "completion":
        fail(f.at("train_on"), "only applies to layout: prompt_completion", train_on)
    template = f.raw("template")
    if template is not None and (not isinstance(template, str) or not template.strip()):
        fail(f.at("template"), "must be the chat template's Jinja text", template)
    template_file = None
    if f.has("template_file"):
        if template is not None:
            fail(f.at("template_file"), "give template or template_file, not both")
        template_file = resolve_path(f.text("template_file"), base_dir, field=f.at("template_file"))
    if completion == field and layout == "prompt_completion":
        fail(f.at("completion"), "must be another field than the prompt's", completion)
    max_tokens = f.optional_int("max_tokens", min=2, max=2**40)
    f.done()
    return ChatSpec(
        layout=layout,
        field=field,
        completion=completion,
        train_on=train_on,
        template=template,
        template_file=template_file,
        max_tokens=max_tokens,
    )

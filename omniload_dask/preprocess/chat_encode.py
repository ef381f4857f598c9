"""Conversations to tokens and a target mask: what a chat source's read task does.

Each conversation is rendered with the source's chat template (:mod:`.chat`), the whole text is
tokenized once (so the ids equal ``apply_chat_template``'s for the same tokenizer), and a token
is a target when its characters meet a target span of the source's ``train_on`` rule::

    train_on: assistant, ChatML, [user "hi", assistant "yo"]
    text    <|im_start|>user\\nhi<|im_end|>\\n<|im_start|>assistant\\nyo<|im_end|>\\n
    target  ---------------------------------------------------------- yo<|im_end|>\\n

``target[i]`` says whether token i is one the loss counts, i.e. whether the label of token i-1
is token i (labels are built from it in :mod:`omniload_dask.batching.formats`). A document's
first token is never predicted. Prompt/completion records of two strings are not templated:
their text is prompt then completion, with the tokenizer's BOS/EOS as the plan adds them, and
the EOS is a target of the completion. A record that cannot be rendered, or has no target
token, is a bad record with the reason (:class:`RecordFailure`). Conversations with images have
each image's run of placeholders where their turns mark it (:mod:`.chat_images`).
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import fsspec
import numpy as np

from omniload_dask.errors import SourceError
from omniload_dask.plan import TokenizerSpec
from omniload_dask.plan.chat import ChatSpec
from omniload_dask.plan.credentials import resolve
from omniload_dask.preprocess.chat import MARKS, ChatError, Template, compile_template
from omniload_dask.preprocess.chat_images import encode_marked, expand_images, mark_images
from omniload_dask.preprocess.tokenize import load_tokenizer

__all__ = ["ChatTokens", "describe_rule", "encode_chats", "target_notes", "template_of"]

_SPECIALS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
             "mask_token")  # fmt: skip


@dataclass
class ChatTokens:
    """Tokens, offsets and target mask of the records that encoded; ``bad`` the others as
    ``(index into the input, reason)``; with images, where each kept record's image runs start
    (token offsets inside its document)."""

    tokens: np.ndarray  # uint32
    offsets: np.ndarray  # int64, kept records + 1
    target: np.ndarray  # bool, per token
    kept: np.ndarray  # int64 indices of the kept records
    bad: list[tuple[int, str]]
    image_starts: list[np.ndarray] = field(default_factory=list)  # per kept record (images)


def template_of(
    chat: ChatSpec, tokenizer: TokenizerSpec, source: str
) -> tuple[Template, dict[str, Any]]:
    """The source's template and the variables it is rendered with (loaded once per process).

    The plan's ``template`` or ``template_file``, else the ``chat_template`` of the
    ``tokenizer_config.json`` beside the tokenizer file; special tokens come from that config
    where there is one, else from the plan's ``bos``/``eos``.
    """
    key = json.dumps(
        [chat.template, chat.template_file, tokenizer.path, tokenizer.bos, tokenizer.eos,
         dict(tokenizer.storage_options), source]
    )  # fmt: skip
    found = _LOADED.get(key)
    if found is None:
        found = _LOADED[key] = _template_of(chat, tokenizer, source)
    return found


_LOADED: dict[str, tuple[Template, dict[str, Any]]] = {}  # per process, by template_of's key


def _template_of(
    chat: ChatSpec, tokenizer: TokenizerSpec, source: str
) -> tuple[Template, dict[str, Any]]:
    where = f"source {source!r}"
    config = _tokenizer_config(tokenizer)
    variables: dict[str, Any] = {"bos_token": tokenizer.bos, "eos_token": tokenizer.eos}
    for name in _SPECIALS:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            variables[name] = value
    text = chat.template
    if chat.template_file is not None:
        text = _read_text(chat.template_file, tokenizer, f"{where}: chat.template_file")
    if text is None:
        text = _config_template(config)
    if text is None:
        needs = chat.layout != "prompt_completion"
        if needs:
            raise SourceError(
                f"{where}: no chat template: the tokenizer has no tokenizer_config.json with a "
                "chat_template beside it; set sources[].chat.template or template_file"
            )
        text = ""
    try:
        template = compile_template(text, f"{where}: chat template")
    except ChatError as exc:
        raise SourceError(str(exc)) from None
    return template, variables


def _config_template(config: dict[str, Any]) -> str | None:
    found = config.get("chat_template")
    if isinstance(found, list):  # several named templates: the default one
        named = {t.get("name"): t.get("template") for t in found if isinstance(t, dict)}
        found = named.get("default")
    return found if isinstance(found, str) else None


def _tokenizer_config(tokenizer: TokenizerSpec) -> dict[str, Any]:
    """The tokenizer_config.json beside the tokenizer file ({} where there is none)."""
    if tokenizer.path is None:
        return {}
    url = posixpath.join(posixpath.dirname(tokenizer.path), "tokenizer_config.json")
    try:
        text = _read_text(url, tokenizer, "tokenizer_config.json")
    except SourceError:
        return {}
    try:
        config = json.loads(text)
    except ValueError as exc:
        raise SourceError(f"tokenizer: {url!r} is not JSON ({exc})") from None
    return config if isinstance(config, dict) else {}


def _read_text(url: str, tokenizer: TokenizerSpec, field: str) -> str:
    try:
        options = resolve(tokenizer.storage_options, "tokenizer.storage_options")
        with fsspec.open(url, "rt", encoding="utf-8", **options) as f:
            return str(f.read())
    except Exception as exc:
        raise SourceError(f"{field}: cannot read {url!r} ({type(exc).__name__}: {exc})") from None


def describe_rule(chat: ChatSpec | None, template: Template | None) -> str:
    """How a source's targets are found, in words (``omniload validate``)."""
    if chat is None:
        return "plain text: every token"
    if chat.train_on == "everything":
        return "everything: every token of the rendered conversation"
    if chat.layout == "prompt_completion":
        return f"{chat.train_on}: the completion's characters after the prompt's rendering"
    how = (
        "the template's {% generation %} blocks"
        if template is not None and template.generation and chat.train_on != "all"
        else "rendering each turn's prefix"
    )
    return f"{chat.train_on}: {how}"


def target_notes(sources: Any, tokenizer: TokenizerSpec, load: bool) -> list[str]:
    """One line per source: which of its tokens are targets and how they are found
    (``omniload validate``); with ``load``, chat templates are loaded to say whether they have
    generation blocks, and one that cannot be loaded is named."""
    notes = []
    for i, spec in enumerate(sources):
        template = None
        if spec.chat is not None and load:
            try:
                template = template_of(spec.chat, tokenizer, spec.name)[0]
            except SourceError as exc:
                notes.append(f"sources[{i}] ({spec.name}): chat template not loaded: {exc}")
                continue
        rule = describe_rule(spec.chat, template)
        if spec.mask is not None:  # a token source's mask column
            rule = f"the tokens its {spec.mask.kind} column {spec.mask.column!r} marks"
        if spec.chat is not None and spec.has_images:
            rule += "; its images go where the turns mark them, their placeholders never targets"
        notes.append(f"sources[{i}] ({spec.name}) trains on {rule}")
    return notes


def encode_chats(
    chat: ChatSpec,
    tokenizer: TokenizerSpec,
    source: str,
    chats: list[Any],
    images: Sequence[Sequence[int]] | None = None,
    placeholder: int | None = None,
    mark: str | None = None,
) -> ChatTokens:
    """Render, tokenize and mask ``chats`` (see the module docstring). With ``images`` (each
    record's images' placeholder counts) the token ``placeholder`` the template writes for an
    image becomes that image's run (:mod:`.chat_images`); with ``mark``, each copy of that text
    in the rendering is the token ``placeholder`` (:func:`.chat_images.encode_marked`)."""
    template, variables = template_of(chat, tokenizer, source)
    encoder = load_tokenizer(tokenizer)
    parts: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    kept: list[int] = []
    bad: list[tuple[int, str]] = []
    image_starts: list[np.ndarray] = []
    runs = np.zeros(0, dtype=np.int64)
    for i, conversation in enumerate(chats):
        try:
            if images is not None:
                conversation = mark_images(conversation, len(images[i]))
            text, spans, specials = _spans(chat, template, variables, conversation)
            if mark is None:
                ids, starts, ends = encoder.encode_offsets(text)
            else:  # (byte, tiktoken: the placeholder's text is plain text to them)
                assert placeholder is not None
                ids, starts, ends = encode_marked(encoder, text, mark, placeholder)
            target = np.zeros(len(ids), dtype=bool)
            for lo, hi in spans:
                target |= (starts < hi) & (ends > lo)
            if images is not None:
                assert placeholder is not None
                ids, target, runs = expand_images(ids, target, images[i], placeholder)
        except ChatError as exc:
            bad.append((i, str(exc)))
            continue
        bos = encoder.info.bos_id if specials[0] and tokenizer.add_bos else None
        eos = encoder.info.eos_id if specials[1] and tokenizer.add_eos else None
        if bos is not None:
            ids, target = np.append([bos], ids), np.append([False], target)
        if eos is not None:
            ids, target = np.append(ids, [eos]), np.append(target, [True])
        if chat.train_on == "everything":
            target[:] = True
        if chat.max_tokens is not None and len(ids) > chat.max_tokens:
            bad.append(
                (i, f"the conversation is {len(ids)} tokens, longer than the plan allows "
                 f"({chat.max_tokens}: the batch's document cap or chat.max_tokens); it is "
                 "never cut")
            )  # fmt: skip
            continue
        if not target[1:].any():
            bad.append((i, f"no target token under train_on: {chat.train_on}"))
            continue
        parts.append(ids.astype(np.uint32))
        masks.append(target)
        kept.append(i)
        if images is not None:
            image_starts.append(runs)
    lengths = np.fromiter(map(len, parts), dtype=np.int64, count=len(parts))
    offsets = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return ChatTokens(
        tokens=np.concatenate(parts) if parts else np.zeros(0, np.uint32),
        offsets=offsets,
        target=np.concatenate(masks) if masks else np.zeros(0, bool),
        kept=np.asarray(kept, dtype=np.int64),
        bad=bad,
        image_starts=image_starts,
    )


def _spans(
    chat: ChatSpec, template: Template, variables: dict[str, Any], conversation: Any
) -> tuple[str, list[tuple[int, int]], tuple[bool, bool]]:
    """Text, target character spans and whether the plan's BOS and EOS are added (plain
    prompt/completion text only: a template writes its own), of one conversation."""
    if template.generation and any(m in json.dumps(conversation) for m in MARKS):
        raise ChatError("the conversation holds U+E000 or U+E001, which mark generation blocks")
    if chat.layout == "prompt_completion":
        prompt, completion = conversation["prompt"], conversation["completion"]
        if isinstance(prompt, str):
            text = prompt + completion
            lo = 0 if chat.train_on in ("all", "everything") else len(prompt)
            return text, [(lo, len(text))], (True, True)
        head, _ = template.render(prompt, variables, add_generation_prompt=True)
        text, _ = template.render(prompt + completion, variables)
        if not text.startswith(head):
            raise ChatError(
                "the template's rendering of the prompt (with the generation prompt) is not the "
                "start of its rendering of prompt and completion"
            )
        lo = 0 if chat.train_on in ("all", "everything") else len(head)
        return text, [(lo, len(text))], (False, False)
    text, generated = template.render(conversation, variables)
    if chat.train_on == "everything":
        return text, [(0, len(text))], (False, False)
    if template.generation and chat.train_on != "all":
        spans = generated
    else:
        turns = template.turn_spans(conversation, variables, text)
        spans = [
            (lo, hi)
            for lo, hi, i in turns
            if chat.train_on == "all" or conversation[i].get("role") == "assistant"
        ]
    if chat.train_on == "last_assistant":
        spans = spans[-1:]
    return text, spans, (False, False)

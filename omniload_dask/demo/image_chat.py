"""Demo conversations with images for the multimodal SFT plan (plans/vlm_chat.yaml).

``make_image_chat_demo_data(folder)`` writes::

    vlchat/vlchat-0000.parquet   columns messages (turns whose content is a list of parts,
                                 {"type": "image"} or {"type": "text", "text": ...}) and
                                 images (a list of PNG / JPEG bytes, one per image part, in
                                 order); row groups of 64
    vlchat-sharegpt/vlchat-0000.tar
                                 the same kind of records as WebDataset files: 000000.json
                                 ({"conversations": [{"from": "human", "value": "<image>\\n
                                 ..."}, ...]}) beside 000000.jpg (and .png for a second image)

Each conversation asks about one or two synthetic pictures (:func:`~omniload_dask.demo.images.
synthetic_image`, nothing downloaded) and answers in the demo's words; now and then a second
question follows. The plan renders them with ChatML over the byte tokenizer, each image as
``<|vision_start|><image><|vision_end|>``, and mixes in the demo's plain web text.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path
from typing import Any

import numpy as np

from omniload_dask.demo.images import caption, encode_image, synthetic_image
from omniload_dask.demo.vocabulary import VOCAB_SEED, demo_text, vocabulary

__all__ = ["make_image_chat_demo_data"]

MARKER = ".omniload-image-chat-demo-complete"
_QUESTIONS = ["What is in the picture?", "Describe the image.", "Which colours do you see?",
              "What shapes are there?", "Compare the two pictures."]  # fmt: skip


def _conversation(
    rng: np.random.Generator, vocab: list[str], key: int
) -> tuple[list[dict[str, Any]], list[bytes]]:
    """One conversation in content-list form and its images' bytes (JPEG first, then PNG)."""
    count = 1 + int(rng.random() < 0.3)
    blobs = []
    for j in range(count):
        h, w = (int(x) for x in rng.integers(64, 321, 2))
        blobs.append(encode_image(synthetic_image(key * 10 + j, h, w), ("jpeg", "png")[j]))
    question = _QUESTIONS[4 if count == 2 else int(rng.integers(0, 4))]
    parts: list[dict[str, Any]] = [{"type": "image"} for _ in range(count)]
    parts.append({"type": "text", "text": "\n" + question})
    answer = caption(key, int(rng.integers(6, 20))) + ". " + _words(rng, vocab, 3.0)
    turns = [{"role": "user", "content": parts},
             {"role": "assistant", "content": [{"type": "text", "text": answer}]}]  # fmt: skip
    if rng.random() < 0.4:
        turns.append(
            {"role": "user", "content": [{"type": "text", "text": _words(rng, vocab, 2.2)}]}
        )
        turns.append(
            {"role": "assistant", "content": [{"type": "text", "text": _words(rng, vocab, 3.2)}]}
        )
    return turns, blobs


def _words(rng: np.random.Generator, vocab: list[str], mean: float) -> str:
    return demo_text(rng, vocab, int(np.clip(rng.lognormal(mean, 0.6), 2, 200)))


def _sharegpt(turns: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The conversation in ShareGPT form, ``<image>`` where each image part was."""
    speakers = {"user": "human", "assistant": "gpt"}
    return [
        {
            "from": speakers[t["role"]],
            "value": "".join(
                "<image>" if p["type"] == "image" else p["text"] for p in t["content"]
            ),
        }
        for t in turns
    ]


def make_image_chat_demo_data(folder: str | Path, scale: float = 1.0) -> Path:
    """Write the multimodal chat demo sources into ``folder`` (skipped if complete)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = Path(folder)
    if (folder / MARKER).exists():
        return folder
    rng = np.random.default_rng(VOCAB_SEED + 2)
    vocab = vocabulary(np.random.default_rng(VOCAB_SEED))
    n = max(16, int(300 * scale))
    records = [_conversation(rng, vocab, 4_000_000 + i) for i in range(2 * n)]
    part = pa.struct([("type", pa.string()), ("text", pa.string())])
    turns = pa.list_(pa.struct([("role", pa.string()), ("content", pa.list_(part))]))
    table = pa.table({
        "messages": pa.array([t for t, _ in records[:n]], turns),
        "images": pa.array([b for _, b in records[:n]], pa.list_(pa.binary())),
    })  # fmt: skip
    (folder / "vlchat").mkdir(parents=True, exist_ok=True)
    pq.write_table(table, folder / "vlchat" / "vlchat-0000.parquet", row_group_size=64,
                   write_page_checksum=True)  # fmt: skip
    (folder / "vlchat-sharegpt").mkdir(parents=True, exist_ok=True)
    with tarfile.open(folder / "vlchat-sharegpt" / "vlchat-0000.tar", "w",
                      format=tarfile.USTAR_FORMAT) as tar:  # fmt: skip
        for i, (conversation, blobs) in enumerate(records[n:]):
            body = json.dumps({"conversations": _sharegpt(conversation)}).encode()
            files = [(f"{i:06d}.json", body)]
            files += [(f"{i:06d}.{e}", b) for e, b in zip(("jpg", "png"), blobs, strict=False)]
            for name, data in files:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                info.mtime = 0
                tar.addfile(info, io.BytesIO(data))
    (folder / MARKER).write_text("ok\n")
    return folder

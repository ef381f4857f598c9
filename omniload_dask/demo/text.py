"""Deterministic demo data: three sources in three formats and a word-level tokenizer.

``make_demo_data(folder)`` writes, from a fixed seed (so every machine gets the same bytes)::

    web/web-0000.jsonl ...      short documents, plain JSON Lines (split into byte ranges)
    code/code-0000.jsonl.zst    code-like files, zstd-compressed JSON Lines
    books/books-0000.parquet    long, heavy-tailed documents in column "body", row groups of 32
    tokenizer.json              a Hugging Face word-level tokenizer over the demo vocabulary

and the image-text, chat and image-chat demo sources of :mod:`omniload_dask.demo.images`,
:mod:`~omniload_dask.demo.chat` and :mod:`~omniload_dask.demo.image_chat`. The quickstart plan
(plans/quickstart.yaml) reads the text sources, plans/vlm.yaml the image-text ones too,
plans/sft.yaml the conversations and plans/vlm_chat.yaml the conversations with images.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

from omniload_dask.demo.chat import make_chat_demo_data
from omniload_dask.demo.image_chat import make_image_chat_demo_data
from omniload_dask.demo.images import make_image_demo_data
from omniload_dask.demo.vocabulary import VOCAB_SEED, demo_text, vocabulary, write_tokenizer

__all__ = ["demo_sources", "demo_tokenizer", "make_demo_data"]

MARKER = ".omniload-demo-complete"


def demo_sources(folder: str | Path, web_unit_bytes: str = "2MiB") -> list[dict[str, object]]:
    """Plan ``sources`` entries for the demo text sources in ``folder`` (weights 0.5/0.3/0.2)."""
    folder = Path(folder)
    return [
        {
            "name": "web",
            "format": "jsonl",
            "path": str(folder / "web" / "*.jsonl"),
            "weight": 0.5,
            "unit_bytes": web_unit_bytes,
        },
        {
            "name": "code",
            "format": "jsonl",
            "path": str(folder / "code" / "*.jsonl.zst"),
            "text": "content",
            "weight": 0.3,
        },
        {
            "name": "books",
            "format": "parquet",
            "path": str(folder / "books" / "*.parquet"),
            "text": "body",
            "weight": 0.2,
        },
    ]


def demo_tokenizer(folder: str | Path) -> dict[str, object]:
    """The plan ``tokenizer`` entry for the demo data's word-level tokenizer."""
    return {
        "kind": "huggingface",
        "path": str(Path(folder) / "tokenizer.json"),
        "bos": "<s>",
        "eos": "</s>",
    }


def make_demo_data(folder: str | Path, scale: float = 1.0) -> Path:
    """Write the demo sources into ``folder`` (skipped if already complete); return it."""
    folder = Path(folder)
    make_image_demo_data(folder, scale=scale)
    make_chat_demo_data(folder, scale=scale)
    make_image_chat_demo_data(folder, scale=scale)
    if (folder / MARKER).exists():
        return folder
    rng = np.random.default_rng(VOCAB_SEED)
    vocab = vocabulary(rng)
    for sub in ("web", "code", "books"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    n_web = int(4000 * scale)
    for f in range(4):
        lines = []
        for i in range(n_web // 4):
            words = int(np.clip(rng.lognormal(4.6, 0.8), 5, 4000))
            lines.append(json.dumps({"id": f"web-{f}-{i}", "text": demo_text(rng, vocab, words)}))
        (folder / "web" / f"web-{f:04d}.jsonl").write_text("\n".join(lines) + "\n")
    n_code = int(1200 * scale)
    cctx = zstandard.ZstdCompressor(level=3)
    for f in range(2):
        lines = []
        for i in range(n_code // 2):
            words = int(np.clip(rng.lognormal(5.5, 0.9), 20, 12000))
            lines.append(
                json.dumps(
                    {"path": f"src/m{f}_{i}.py", "content": demo_text(rng, vocab, words, code=True)}
                )
            )
        data = ("\n".join(lines) + "\n").encode()
        (folder / "code" / f"code-{f:04d}.jsonl.zst").write_bytes(cctx.compress(data))
    n_books = int(240 * scale)
    for f in range(2):
        bodies = []
        for _ in range(n_books // 2):
            words = int(np.clip(rng.pareto(1.5) * 800 + 300, 300, 40000))
            bodies.append(demo_text(rng, vocab, words))
        table = pa.table({"title": [f"book {f}-{i}" for i in range(len(bodies))], "body": bodies})
        pq.write_table(table, folder / "books" / f"books-{f:04d}.parquet", row_group_size=32)
    write_tokenizer(folder / "tokenizer.json", vocab)
    (folder / MARKER).write_text("ok\n")
    return folder

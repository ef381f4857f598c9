"""Deterministic data for the head-to-head benchmark: N sources, F files each, one tokenizer.

``make_sources(folder, sources=16, files=32, words_per_file=48_000)`` writes, from a fixed seed,
the same bytes on every machine::

    tokenizer.json                  a Hugging Face word-level tokenizer over the vocabulary
    tokenizer-bpe.json              a byte-level BPE of Llama 3's size (128,256 ids), written
                                    by bpe_tokenizer(folder) when first asked for
    s00-web/part-0000.jsonl ...     kind 0 (web): short documents, plain JSON Lines ("text")
    s01-code/part-0000.jsonl.zst    kind 1 (code): code-like files, zstd JSON Lines ("content")
    s02-books/part-0000.parquet     kind 2 (books): long, heavy-tailed documents, Parquet ("body")
    s03-web/...                     source i has kind i % 3 and its own seed

Each source has ``files`` files, so up to ``files / W`` ranks with W DataLoader workers per
source can each give every worker at least one file of its own. A configuration with K sources
uses the first K: 3 sources are one of each kind, 16 sources repeat the kinds with different
texts and length scales. :func:`source_specs` gives the plan's ``sources:`` entries, weights
included: each kind keeps the demo mix (web 0.5, code 0.3, books 0.2) split evenly among the
sources of that kind.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

__all__ = [
    "BPE_VOCAB",
    "KINDS",
    "bpe_from_texts",
    "bpe_tokenizer",
    "make_sources",
    "source_specs",
    "write_bpe_tokenizer",
]

KINDS = ("web", "code", "books")
KIND_WEIGHT = {"web": 0.5, "code": 0.3, "books": 0.2}
FORMAT = {"web": ("jsonl", "jsonl", "text"), "code": ("jsonl", "jsonl.zst", "content"),
          "books": ("parquet", "parquet", "body")}  # fmt: skip
SYLLABLES = ("ba", "ko", "mi", "nu", "re", "sa", "ti", "vo", "da", "pe", "gu", "shi", "an",
             "el", "or", "um", "tra", "ben", "gol", "lir")  # fmt: skip
PUNCT = (".", ",", ";", ":", "(", ")", "=", "+", "{", "}", "[", "]", "_", "-")
SPECIALS = ("<unk>", "<s>", "</s>", "<pad>")
SEED = 20261130
ROWS_PER_GROUP = 8  # Parquet row group size (books); a group is one read unit of omniload-dask
BPE_VOCAB = 128_256  # Llama 3's vocabulary, the size the cost model's 8B model has


def _vocabulary(rng: np.random.Generator, size: int = 4000) -> list[str]:
    words: set[str] = set()
    while len(words) < size:
        n = int(rng.integers(1, 4))
        words.add("".join(SYLLABLES[int(i)] for i in rng.integers(0, len(SYLLABLES), n)))
    return sorted(words)


def _doc_words(rng: np.random.Generator, kind: str, scale: float, n: int) -> np.ndarray:
    if kind == "web":  # median ~100 words, heavy tail
        x = np.clip(rng.lognormal(np.log(100 * scale), 0.8, n), 5, 4000)
    elif kind == "code":  # median ~250 words (plus punctuation tokens)
        x = np.clip(rng.lognormal(np.log(250 * scale), 0.9, n), 20, 12000)
    else:  # books: Pareto tail from 300 words, up to 40k
        x = np.clip(rng.pareto(1.5, n) * 800 * scale + 300, 300, 40000)
    return x.astype(np.int64)


def _texts(
    rng: np.random.Generator, vocab: np.ndarray, kind: str, scale: float, words: int
) -> list[str]:
    """Documents of about ``words`` words in total (Zipf-like word frequencies)."""
    lengths = []
    total = 0
    while total < words:
        batch = _doc_words(rng, kind, scale, 64)
        for n in batch.tolist():
            lengths.append(n)
            total += n
            if total >= words:
                break
    idx = np.minimum(rng.zipf(1.3, total) - 1, len(vocab) - 1)
    tokens = vocab[idx]
    if kind == "code":  # glue punctuation to a third of the words
        marks = rng.integers(0, 3 * len(PUNCT), total)
        glue = marks < len(PUNCT)
        tokens = tokens.astype(object)
        tokens[glue] = tokens[glue] + np.asarray(PUNCT, dtype=object)[marks[glue]]
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    flat = tokens.tolist()
    return [" ".join(flat[a:b]) for a, b in itertools.pairwise(bounds.tolist())]


def _source_name(i: int) -> str:
    return f"s{i:02d}-{KINDS[i % 3]}"


def make_sources(
    folder: str | Path, sources: int = 16, files: int = 32, words_per_file: int = 48_000
) -> Path:
    """Write the data into ``folder`` (skipped if it already holds at least these sources of
    these sizes); return it."""
    folder = Path(folder)
    marker = folder / ".complete.json"
    want = {"sources": sources, "files": files, "words_per_file": words_per_file, "seed": SEED}
    if marker.exists():  # source i is the same whatever the count: more sources will do
        have = json.loads(marker.read_text())
        if have["sources"] >= sources and {**have, "sources": sources} == want:
            return folder
    rng = np.random.default_rng(SEED)
    vocab = _vocabulary(rng)
    _write_tokenizer(folder / "tokenizer.json", vocab)
    vocab_arr = np.asarray(vocab)
    cctx = zstandard.ZstdCompressor(level=3)
    for i in range(sources):
        kind = KINDS[i % 3]
        src = np.random.default_rng([SEED, i])
        scale = float(src.uniform(0.7, 1.4))  # sources of one kind differ in length
        _, ext, field = FORMAT[kind]
        sub = folder / _source_name(i)
        sub.mkdir(parents=True, exist_ok=True)
        for f in range(files):
            docs = _texts(src, vocab_arr, kind, scale, words_per_file)
            path = sub / f"part-{f:04d}.{ext}"
            if kind == "books":
                table = pa.table({"title": [f"{i}-{f}-{k}" for k in range(len(docs))],
                                  field: docs})  # fmt: skip
                pq.write_table(table, path, row_group_size=ROWS_PER_GROUP)
                continue
            lines = [
                json.dumps({"id": f"{i}-{f}-{k}", field: d}, separators=(",", ":"))
                for k, d in enumerate(docs)
            ]
            data = ("\n".join(lines) + "\n").encode()
            path.write_bytes(cctx.compress(data) if kind == "code" else data)
    marker.write_text(json.dumps(want))
    return folder


def source_specs(folder: str | Path, count: int) -> list[dict[str, Any]]:
    """Plan ``sources:`` entries for the first ``count`` sources of ``folder``."""
    folder = Path(folder)
    kinds = [KINDS[i % 3] for i in range(count)]
    out = []
    for i, kind in enumerate(kinds):
        fmt, ext, field = FORMAT[kind]
        out.append(
            {
                "name": _source_name(i),
                "format": fmt,
                "path": str(folder / _source_name(i) / f"*.{ext}"),
                "text": field,
                "weight": round(KIND_WEIGHT[kind] / kinds.count(kind), 6),
            }
        )
    return out


def _write_tokenizer(path: Path, vocab: list[str]) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    path.parent.mkdir(parents=True, exist_ok=True)
    table = {tok: i for i, tok in enumerate([*SPECIALS, *PUNCT, *vocab])}
    tok = Tokenizer(models.WordLevel(vocab=table, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()]
    )
    path.write_text(tok.to_str())


def bpe_tokenizer(folder: str | Path) -> Path:
    """``folder``'s BPE tokenizer (:func:`write_bpe_tokenizer`), written the first time it is
    asked for: training it takes a few seconds that runs with the word-level one need not pay."""
    path = Path(folder) / "tokenizer-bpe.json"
    if not path.exists():
        # the vocabulary is the seed's first draw, as in make_sources
        write_bpe_tokenizer(path, _vocabulary(np.random.default_rng(SEED)))
    return path


def write_bpe_tokenizer(path: Path, vocab: list[str], size: int = BPE_VOCAB) -> None:
    """A byte-level BPE tokenizer with ``size`` ids, deterministic, for memory figures that
    match a real model's tokenizer (nothing can be downloaded here).

    Trained (``tokenizers``' BPE trainer) on text drawn like the sources' own (every kind), so
    the benchmark's text gets the tokens a tokenizer trained on it would give, then padded up
    to ``size`` ids with merges of pairs of earlier tokens (at most 16 characters, from a fixed
    seed), which rank after the trained ones. Its JSON is ~6 MB (Llama 3's is ~9 MB); loaded in
    a process it takes ~90 MiB (PSS), where the word-level tokenizer takes ~3 MiB.
    """
    rng = np.random.default_rng([SEED, 128])
    words = np.asarray(vocab)
    sample = [t for kind in KINDS for t in _texts(rng, words, kind, 1.0, 200_000)]
    bpe_from_texts(path, sample, size, rng)


def bpe_from_texts(
    path: Path, sample: list[str], size: int = BPE_VOCAB, rng: np.random.Generator | None = None
) -> None:
    """Train a byte-level BPE on ``sample`` and pad it to ``size`` ids with merges drawn from
    ``rng`` (see :func:`write_bpe_tokenizer`); write it to ``path``."""
    from tokenizers import Tokenizer, decoders, models, trainers
    from tokenizers.pre_tokenizers import ByteLevel

    rng = rng if rng is not None else np.random.default_rng([SEED, 129])
    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=32_000,
        special_tokens=list(SPECIALS),
        initial_alphabet=ByteLevel.alphabet(),
        show_progress=False,
    )
    trained.train_from_iterator(sample, trainer)
    model = json.loads(trained.to_str())["model"]
    table: dict[str, int] = dict(model["vocab"])
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tokens = sorted(table, key=table.__getitem__)
    while len(table) < size:
        a = tokens[int(rng.integers(0, len(tokens)))]
        b = tokens[int(rng.integers(0, min(len(tokens), 4096)))]
        if len(a) + len(b) > 16 or a + b in table or a in SPECIALS or b in SPECIALS:
            continue
        merges.append((a, b))
        table[a + b] = len(table)
        tokens.append(a + b)
    tok = Tokenizer(models.BPE(vocab=table, merges=merges))
    tok.pre_tokenizer = ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tok.to_str())

"""The demo vocabulary, the text drawn from it, and the word-level tokenizer over it.

Shared by the text and the image-text demo data (and by benchmarks that make their own data
from it). The vocabulary is drawn from :data:`VOCAB_SEED`, so both demo tokenizers give every
word the same id; the image-text one only appends an ``<image>`` token::

    rng = np.random.default_rng(VOCAB_SEED)
    vocab = vocabulary(rng)                     # 3000 words: "an", "anan", ..., "kashian", ...
    demo_text(rng, vocab, 5)                    # "viviun annene anan anan andega"
    write_tokenizer(path, [*vocab, "<image>"])  # ids: <unk> <s> </s> <pad>, punctuation, words
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["PUNCT", "SYLLABLES", "VOCAB_SEED", "demo_text", "vocabulary", "write_tokenizer"]

SYLLABLES = [
    "ka",
    "lo",
    "mi",
    "ne",
    "ru",
    "sa",
    "to",
    "vi",
    "de",
    "po",
    "ga",
    "shi",
    "an",
    "el",
    "or",
    "un",
    "ta",
    "ber",
    "gon",
    "lin",
]
PUNCT = [".", ",", ";", ":", "(", ")", "=", "+", "{", "}", "[", "]", "_", "-", "\n"]
VOCAB_SEED = 20260501


def vocabulary(rng: np.random.Generator, size: int = 3000) -> list[str]:
    """``size`` distinct words of one to three syllables, sorted, drawn from ``rng``."""
    words: set[str] = set()
    while len(words) < size:
        n = int(rng.integers(1, 4))
        words.add("".join(SYLLABLES[int(i)] for i in rng.integers(0, len(SYLLABLES), n)))
    return sorted(words)


def demo_text(rng: np.random.Generator, vocab: list[str], words: int, code: bool = False) -> str:
    """A text of ``words`` words of ``vocab``; with ``code``, many words carry punctuation."""
    # Zipf-like word frequencies, as in natural text.
    idx = np.minimum(rng.zipf(1.3, words) - 1, len(vocab) - 1)
    tokens = [vocab[int(i)] for i in idx]
    if code:
        marks = rng.integers(0, len(PUNCT), words)
        tokens = [t + PUNCT[int(m)] if m < 8 else t for t, m in zip(tokens, marks, strict=True)]
    return " ".join(tokens)


def write_tokenizer(path: Path, vocab: list[str]) -> None:
    """Write a Hugging Face word-level tokenizer.json over the specials, punctuation and ``vocab``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    table = {tok: i for i, tok in enumerate(specials + PUNCT[:-1] + vocab)}
    tok = Tokenizer(models.WordLevel(vocab=table, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()]
    )
    path.write_text(tok.to_str())

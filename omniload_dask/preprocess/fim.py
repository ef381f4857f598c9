"""A shipped example transform: fill-in-the-middle (FIM) for code sources.

Code models learn to fill a gap by seeing documents split into prefix, middle and suffix and
reordered so the middle comes last (Bavarian et al., 2022, "Efficient Training of Language
Models to Fill in the Middle"). With probability :data:`FIM_RATE` a document is cut at two
points drawn uniformly from its characters and written in prefix-suffix-middle order::

    "def add(a, b):\\n    return a + b\\n"
    -> "<fim_prefix>def add(a, b):\\n<fim_suffix>a + b\\n<fim_middle>    return "

The sentinel strings are StarCoder's; a tokenizer that has them as special tokens gives each
one id. Use it on a text source of code::

    sources:
      - {name: code, format: jsonl, path: code/*.jsonl, transform: omniload_dask.preprocess.fim:fill_in_the_middle}

Its randomness comes only from the generator it is given (seeded from plan seed, source,
sample id and epoch): the same document gets the same cut in the same epoch on any worker,
after any fault or resume, and another cut in the next epoch.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["FIM_MIDDLE", "FIM_PREFIX", "FIM_RATE", "FIM_SUFFIX", "fill_in_the_middle"]

FIM_PREFIX, FIM_MIDDLE, FIM_SUFFIX = "<fim_prefix>", "<fim_middle>", "<fim_suffix>"
FIM_RATE = 0.5  # share of documents rearranged (the paper's 50 % keeps left-to-right skill)


def fill_in_the_middle(record: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    """The record with its text in prefix-suffix-middle order, or as it is (``1 - FIM_RATE``
    of the time, and for texts of fewer than two characters)."""
    text = record["text"]
    if len(text) < 2 or rng.random() >= FIM_RATE:
        return record
    a, b = sorted(rng.integers(0, len(text) + 1, size=2).tolist())
    prefix, middle, suffix = text[:a], text[a:b], text[b:]
    return {**record, "text": f"{FIM_PREFIX}{prefix}{FIM_SUFFIX}{suffix}{FIM_MIDDLE}{middle}"}

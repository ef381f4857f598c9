"""The plan's vocabulary without building its tokenizer, for plans whose sources are all token
sources.

Such a plan runs no tokenizer: its ids were written offline, and the plan's tokenizer only says
which vocabulary they must belong to (size, BOS and EOS ids; :mod:`.tokens` compares them with
each source's). Building the tokenizer to learn that is the slowest part of a job's start-up
for a large BPE file (a 131k-rank tiktoken file decodes every token and builds the merge
table), and the job's first batch waits for it. :func:`describe_vocabulary` gives the same
description as :func:`~omniload_dask.preprocess.tokenize.describe` from what is exact without
building it:

    byte         its constants (258 ids, BOS 256, EOS 257)
    tiktoken     the file's ranks read as numbers (``<base64> <rank>`` lines, tokens not
                 decoded) and the plan's special tokens: ``tiktoken`` counts
                 ``max(rank, special id) + 1`` ids, and BOS/EOS are special tokens by name
    huggingface  the tokenizer built as :func:`describe` builds it (its size counts added
                 tokens by rules of the library: nothing cheaper is exact)

The file's lines are checked as the tokenizer's loader checks them (a line that is not a token
and a rank, a special id that is also a rank, an empty file: the same errors); the tokens'
bytes and the pre-tokenizer pattern are not, as no text is tokenized with them.
"""

from __future__ import annotations

from typing import Any

from omniload_dask.errors import TokenizerError
from omniload_dask.plan import TokenizerSpec
from omniload_dask.preprocess.tokenize import (
    BYTE_BOS,
    BYTE_EOS,
    BYTE_VOCAB,
    describe,
    read_ranks,
)

__all__ = ["describe_vocabulary"]


def describe_vocabulary(spec: TokenizerSpec) -> dict[str, Any]:
    """``vocab_size``, ``bos_id`` and ``eos_id`` of the plan's tokenizer, as
    :func:`~omniload_dask.preprocess.tokenize.describe` reports them (see the module doc)."""
    if spec.kind == "byte":
        return {"vocab_size": BYTE_VOCAB, "bos_id": BYTE_BOS, "eos_id": BYTE_EOS}
    if spec.kind != "tiktoken":
        return describe(spec)
    ranks = set(read_ranks(spec, decode=False).values())
    specials = dict(spec.special_tokens)
    for token, token_id in specials.items():
        if token_id in ranks:
            raise TokenizerError(
                f"tokenizer.special_tokens[{token!r}]: id {token_id} is also the rank of a "
                f"token in {spec.path!r} (special tokens take ids the file does not use)"
            )
    top = max(max(ranks), max(specials.values(), default=0))
    return {
        "vocab_size": top + 1,
        "bos_id": specials[spec.bos] if spec.bos is not None else None,
        "eos_id": specials[spec.eos] if spec.eos is not None else None,
    }

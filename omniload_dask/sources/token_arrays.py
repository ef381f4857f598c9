"""What every token format shares: checking token ids, and columns of token lists.

A token source's records reach the data plane as token ids (uint32), never through a
tokenizer. Whatever dtype a file holds them in, :func:`checked_tokens` makes sure each record's
ids are whole numbers in ``[0, vocabulary size)``; a record that is not is a bad record (named
by its offset, with the first bad id and where it sits), so the plan's ``on_error`` decides::

    lengths [3, 2], tokens [5, 9, 70000, 1, 2], vocabulary 50257
      -> record 0 is bad ("token id 70000 at position 2 ..."), record 1 is kept: [1, 2]

:func:`list_column` turns an Arrow column of integer lists (``input_ids``) into flat ids and
lengths without a Python object per token.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from omniload_dask.errors import SourceError
from omniload_dask.plan import SourceSpec
from omniload_dask.sources.base import RawRecords

__all__ = ["checked_tokens", "is_token_list", "list_column"]


def checked_tokens(spec: SourceSpec, records: RawRecords) -> RawRecords:
    """``records`` with its token ids as uint32; records with an id outside the source's
    vocabulary (or not a whole number) moved to ``bad`` (with their part of ``mask``)."""
    assert records.tokens is not None and records.lengths is not None
    tokens, lengths = records.tokens, records.lengths
    vocab = int(spec.vocab_size or 2**32)
    if _all_in_vocabulary(tokens, vocab):
        ok = None
    elif tokens.dtype.kind == "f":
        ok = (tokens == np.floor(tokens)) & (tokens >= 0) & (tokens < vocab)
    elif tokens.dtype.kind == "u" and (tokens.dtype.itemsize < 4 or vocab >= 2**32):
        ok = tokens < vocab if vocab < 2 ** (8 * tokens.dtype.itemsize) else None
    else:
        ok = (tokens >= 0) & (tokens < vocab)
    if ok is None or bool(ok.all()):
        return RawRecords.of_tokens(
            tokens.astype(np.uint32, copy=False), lengths, records.offsets, records.bad,
            records.mask,
        )  # fmt: skip
    starts = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=starts[1:])
    wrong = np.flatnonzero(~ok)
    record_of = np.searchsorted(starts, wrong, side="right") - 1
    bad_rows = np.unique(record_of)
    first = wrong[np.searchsorted(record_of, bad_rows)]  # each bad record's first bad id
    bad = list(records.bad)
    for r, at in zip(bad_rows.tolist(), first.tolist(), strict=True):
        value = tokens[at].item()
        bad.append(
            (
                int(records.offsets[r]),
                f"token id {value} at position {at - int(starts[r])} is outside the vocabulary "
                f"of {vocab} ids (sources[].vocabulary.size)",
            )
        )
    keep = np.ones(len(lengths), bool)
    keep[bad_rows] = False
    token_keep = np.repeat(keep, lengths)
    mask = records.mask[token_keep] if records.mask is not None else None
    return RawRecords.of_tokens(
        tokens[token_keep].astype(np.uint32), lengths[keep], records.offsets[keep], bad, mask
    )


def _all_in_vocabulary(tokens: np.ndarray, vocab: int) -> bool:
    """Whether every id of an integer array is in ``[0, vocab)``, in one pass over it (a
    maximum; signed ids as their unsigned bits, where a negative id is at least 2**(bits-1)).
    False also where it cannot tell that way (floats): the caller then checks id by id."""
    kind, bits = tokens.dtype.kind, 8 * tokens.dtype.itemsize
    if kind not in "iu" or not len(tokens):
        return kind in "iu"
    if kind == "u":
        return vocab >= 2**bits or int(tokens.max()) < vocab
    unsigned = tokens.view(np.dtype(f"u{tokens.dtype.itemsize}"))
    return int(unsigned.max()) < min(vocab, 2 ** (bits - 1))


def is_token_list(kind: Any) -> bool:
    """Whether an Arrow type is a list of integers (what a token-id column holds)."""
    import pyarrow as pa

    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)):
        return False
    return bool(pa.types.is_integer(kind.value_type))


def check_token_field(spec: SourceSpec, url: str, schema: Any) -> None:
    """The token column ``spec.tokens`` is in ``schema`` and holds lists of integers."""
    name = spec.tokens
    if name not in schema.names:
        raise SourceError(
            f"source {spec.name!r}: file {url!r} has no column {name!r} "
            f"(columns: {', '.join(schema.names)}); set sources[].tokens"
        )
    kind = schema.field(name).type
    if not is_token_list(kind):
        raise SourceError(
            f"source {spec.name!r}: file {url!r}: column {name!r} has type {kind}, expected "
            "token ids: a list of integers (sources[].tokens names the token-id column)"
        )


def list_column(column: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """An Arrow column of integer lists as (flat ids, lengths, rows that are null or hold a
    null id): one copy of the values the rows use, no Python object per token. A null row
    gets length 0."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    n = len(column)
    offsets = np.asarray(column.offsets, dtype=np.int64)  # (the slice's own, from its start)
    spans = np.diff(offsets)
    values = column.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0])) if n else None
    if values is None:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, bool)
    null_rows = np.zeros(n, bool)
    if column.null_count:
        null_rows |= column.is_null().to_numpy(zero_copy_only=False)
    if values.null_count:
        null_ids = values.is_null().to_numpy(zero_copy_only=False)
        starts = np.minimum(offsets[:-1] - offsets[0], max(len(null_ids) - 1, 0))
        per_row = np.add.reduceat(null_ids, starts) if len(null_ids) else np.zeros(n)
        null_rows |= (spans > 0) & (per_row > 0)
        values = pc.fill_null(values, 0)
    flat = values.to_numpy(zero_copy_only=False)
    if null_rows.any():
        flat = flat[np.repeat(~null_rows, spans)]
        spans = np.where(null_rows, 0, spans)
    return flat, spans, null_rows

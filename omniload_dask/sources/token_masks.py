"""A token source's mask column: which of a record's tokens the loss counts.

Pre-tokenized SFT sets store, beside each row's ids, either a ``loss_mask`` (1/true where the
token is trained on) or Hugging Face ``labels``: the ids themselves, unshifted, with -100 where
the loss skips the token (a causal LM shifts them inside its loss: the label at position ``i``
scores the prediction of token ``i`` from the tokens before it). Both say, per token, whether it
is a *target*, which is what a chat source's mask says (:mod:`omniload_dask.preprocess.
chat_encode`), so both become the record's ``target`` and travel the same way::

    input_ids  [ 5    6    7  8  9 ]
    labels     [-100 -100  7  8  9 ]    kind: labels      -> target [F F T T T]
    loss_mask  [ 0    0    1  1  1 ]    kind: loss_mask   -> target [F F T T T]

A row whose mask cannot be one is a bad record (skipped and counted, or raised, by the plan's
``on_error``), named by its offset, with the first wrong position: a null mask, one of another
length than the ids, a ``loss_mask`` value that is not 0/1, a label that is neither
``ignore_index`` nor the id at its position (shifted labels fail here, at their first target),
and a row with no target after its first token (nothing to train on: never a silent all -100
document, as for chats).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from omniload_dask.batching.labels import Holes
from omniload_dask.errors import SourceError
from omniload_dask.plan import SourceSpec
from omniload_dask.sources.base import RawRecords

__all__ = ["check_mask_field", "mask_holes", "mask_list_column", "masked_records"]


def check_mask_field(spec: SourceSpec, url: str, schema: Any) -> None:
    """The mask column ``spec.mask.column`` is in ``schema`` (Arrow) and holds lists of integers
    (or booleans, for a ``loss_mask``)."""
    import pyarrow as pa

    assert spec.mask is not None
    name = spec.mask.column
    where = f"source {spec.name!r}: file {url!r}"
    if name not in schema.names:
        raise SourceError(
            f"{where} has no mask column {name!r} (columns: {', '.join(schema.names)}); "
            "set sources[].mask.column"
        )
    kind = schema.field(name).type
    ok = pa.types.is_list(kind) or pa.types.is_large_list(kind)
    value = kind.value_type if ok else None
    ok = ok and (pa.types.is_integer(value) or (pa.types.is_boolean(value)
                                                 and spec.mask.kind == "loss_mask"))  # fmt: skip
    if not ok:
        want = "integers" if spec.mask.kind == "labels" else "integers or booleans"
        raise SourceError(
            f"{where}: mask column {name!r} has type {kind}, expected a list of {want} per row "
            f"(sources[].mask, kind: {spec.mask.kind})"
        )


def mask_list_column(column: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """An Arrow column of integer or boolean lists as (flat values, lengths, null rows), as
    :func:`~omniload_dask.sources.token_arrays.list_column` gives ids (booleans as 0/1)."""
    import pyarrow as pa

    from omniload_dask.sources.token_arrays import list_column

    if pa.types.is_boolean(column.type.value_type):
        column = column.cast(pa.list_(pa.int8()))
    return list_column(column)


def mask_holes(
    spec: SourceSpec, lengths: np.ndarray, null_ids: np.ndarray, mask: Any
) -> Holes | None:
    """The tokens that are not targets of each row, as
    :class:`~omniload_dask.batching.labels.Holes` (with no spans where every token is one),
    from the rows' id ``lengths`` and ``null_ids`` (what
    :func:`~omniload_dask.sources.token_arrays.list_column` gives of the ids) and their Arrow
    ``mask`` column, as :func:`masked_records` takes the values. None where a row's ids or mask
    is null or the two differ in length: only its read can tell what that row is.

    Discovery reads the mask column beside the ids, so that a masked source's lengths and the
    loss tokens of each step are known before any read reports. A row that its read finds bad
    otherwise (a wrong label, no target) fails the job (``on_error: raise``), the only policy
    under which the data plane plans with lengths up front.
    """
    assert spec.mask is not None
    values, value_lengths, null_masks = mask_list_column(mask)
    if null_ids.any() or null_masks.any() or not np.array_equal(lengths, value_lengths):
        return None
    labels = spec.mask.kind == "labels"
    target = values != (spec.mask.ignore_index if labels else 0)
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    none = Holes(np.zeros(len(lengths) + 1, np.int64), np.zeros((0, 2), np.int64))
    return Holes.of(offsets, target) or none


def masked_records(
    spec: SourceSpec,
    ids: np.ndarray,
    id_lengths: np.ndarray,
    values: np.ndarray,
    value_lengths: np.ndarray,
    offsets: np.ndarray,
    reasons: dict[int, str],
) -> RawRecords:
    """Token records of rows ``offsets`` with their target masks; the rows in ``reasons``
    (index -> why: a null row) and the rows whose mask is wrong are bad records.

    ``ids``/``id_lengths`` and ``values``/``value_lengths`` are every row's ids and mask values,
    flat, in row order (a row in ``reasons`` may have any lengths).
    """
    assert spec.mask is not None
    column, kind = spec.mask.column, spec.mask.kind
    id_lengths = np.asarray(id_lengths, np.int64)
    value_lengths = np.asarray(value_lengths, np.int64)
    reasons = dict(reasons)
    skip = np.zeros(len(id_lengths), bool)
    skip[list(reasons)] = True
    for r in np.flatnonzero(~skip & (id_lengths != value_lengths)).tolist():
        reasons[r] = (
            f"mask column {column!r} has {int(value_lengths[r])} values, the ids "
            f"{int(id_lengths[r])}"
        )
    checked = np.ones(len(id_lengths), bool)
    checked[list(reasons)] = False
    lengths = id_lengths[checked]
    row_ids = ids[np.repeat(checked, id_lengths)]
    row_values = values[np.repeat(checked, value_lengths)].astype(np.int64, copy=False)
    if kind == "labels":
        target = row_values != spec.mask.ignore_index
        wrong = target & (row_values != row_ids)
    else:
        target = row_values != 0
        wrong = target & (row_values != 1)
    starts = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=starts[1:])
    rows = np.flatnonzero(checked)
    wrong_at = np.flatnonzero(wrong)
    record_of = np.searchsorted(starts, wrong_at, side="right") - 1
    for k, at in zip(*np.unique(record_of, return_index=True), strict=True):
        p = int(wrong_at[at])
        value, pos = row_values[p].item(), p - int(starts[k])
        reasons[int(rows[k])] = (
            f"label {value} at position {pos} is neither {spec.mask.ignore_index} nor the "
            f"token id {row_ids[p].item()} there (labels are the ids, unshifted, as Hugging "
            "Face causal LMs take them)"
            if kind == "labels"
            else f"mask value {value} at position {pos} of column {column!r} is not 0 or 1 "
            "(a labels column? set sources[].mask.kind: labels)"
        )
    # no target past a record's first token: nothing to train on (as for chat sources)
    later = target.copy()
    later[starts[:-1][lengths > 0]] = False
    running = np.concatenate([[0], np.cumsum(later)])
    counts = running[starts[1:]] - running[starts[:-1]]
    for k in np.flatnonzero((lengths <= 1) | (counts == 0)).tolist():
        reasons.setdefault(
            int(rows[k]), f"no target token: mask column {column!r} leaves none after the first"
        )
    keep = np.ones(len(id_lengths), bool)
    keep[list(reasons)] = False
    good = keep[checked]
    bad = [(int(offsets[r]), reasons[r]) for r in sorted(reasons)]
    return RawRecords.of_tokens(
        row_ids[np.repeat(good, lengths)],
        lengths[good],
        np.asarray(offsets, np.int64)[keep],
        bad,
        mask=target[np.repeat(good, lengths)],
    )

"""The wire format of a part: what a worker holds and sends of a DP group's batch, and back.

Pure (numpy and msgpack, no Dask): the construction task writes this form
(:mod:`omniload_dask.cluster.tasks`), the worker's part handler sends it
(:mod:`omniload_dask.cluster.serving`, ``PART_HANDLER``), the fetcher reads it back
(:mod:`omniload_dask.trainer.link`) and the feeder restores the full layout
(:mod:`omniload_dask.trainer.feeder`); each side calls the functions here and nothing else
knows the format.

The micro-batches. Constructor tasks build micro-batches in *wire form*
(:func:`~omniload_dask.batching.formats.build` with ``wire=True``): ``input_ids`` as ``uint32``
(the tokenizer's own id type) and no ``labels`` or ``position_ids``, which follow from
``input_ids``, ``cu_seqlens``, ``image_token_map`` and, where a document has a target mask,
``target_bits`` (the per-token mask, ``np.packbits``: 1 bit a token). That is 4 bytes per token
held in worker memory and sent to a feeder instead of 24; the feeder restores the full layout
with :func:`expand` (three vector passes per micro-batch, on the trainer's side).
Context-parallel slices are built from the full form and stay full.

The part. A part travels packed (:func:`pack_part`): its arrays copied into one buffer,
described by a few plain fields in the reply's msgpack frame, and the buffer out of band in a
frame of its own, so that neither side pickles the part or splits it into a frame per array
(packing is one copy per array; pickling a :class:`GroupBatch` walks every array and field,
several times the cost on both sides)::

    {"step": 40, "group": 1,
     "micro": msgpack of [[["input_ids", "<u4", [8192], 0], ["num_tokens", None, 8190, 0],
              ...], ...],   field: [name, dtype (None: a plain value), shape or value, offset]
     "buffer": uint8 array}                                       (its own frame on the wire)

The construction task packs every part of its block as it builds it (:func:`packed`), so
serving a part only sends it. The buffer is a numpy array, not a byte string, because of the
block's standby copy (pickled by Dask for the worker that keeps it): pickle protocol 5 sends
an array out of band, without copying it, while a byte string is copied into the pickle and
then searched end to end by Dask for a reference to ``__main__`` (on the sending worker's
event loop, in time that grows with the block). The buffer is read-only where it is held; the
fetcher unpacks a part (:func:`unpack_part`) into arrays that view one writable copy of it. A
part holding anything else (object arrays, numpy scalars) or larger than ``PACK_LIMIT``
travels as Dask serializes task results (numpy buffers out of band).

The reply. A fetcher asks a worker for all its parts there at once (a rank: the parts of the
steps it prefetches, 16 at a time at dp 8). The packed ones travel with their buffers joined
into one (:func:`join_parts`; each part names its ``span`` of it): Dask's comms spend tens
of microseconds on every object they serialize out of band, whatever its size, which cost
more than copying the part, and the fetcher's parts then view one writable buffer, with no
copy of their own (:func:`split_parts`)::

    {"parts": [{"step": 40, "group": 1, "micro": ..., "span": [0, 33112]}, None, ...],
     "buffer": uint8 array}                                       (its own frame on the wire)
"""

from __future__ import annotations

import functools
import math
from typing import Any

import msgpack
import numpy as np

from omniload_dask.batching.formats import GroupBatch
from omniload_dask.batching.labels import derived

__all__ = [
    "PACK_LIMIT",
    "PART_HANDLER",
    "batch_bytes",
    "expand",
    "is_packed",
    "join_parts",
    "pack_part",
    "pack_together",
    "packed",
    "split_parts",
    "unpack_part",
]

PART_HANDLER = "omniload_parts"  # the workers' RPC a fetcher calls: parts=[[block key, part]]
PACK_LIMIT = 16 * 2**20  # bytes: larger parts (many image patches) go out of band as they are
_ALIGN = 8  # each array starts at a multiple of this in the packed buffer
_PLAIN = (int, float, str, bool, type(None))  # values msgpack gives back as they were


def batch_bytes(batch: GroupBatch) -> int:
    """Bytes of every array of every micro-batch, plus a small overhead per micro-batch (what
    a worker's memory holds of it: Dask's ``sizeof`` of a batch is this)."""
    return sum(
        int(v.nbytes)
        for mb in batch.micro_batches
        for v in mb.values()
        if isinstance(v, np.ndarray)
    ) + 256 * len(batch.micro_batches)


def expand(mb: dict[str, Any]) -> dict[str, Any]:
    """The full packed layout of a micro-batch in wire form (a full one is returned as is)::

    wire   input_ids [5 6 7 8 9] (uint32)   cu_seqlens [0 3 5]   num_tokens 5
    full   input_ids [5 6 7 8 9] (int64)    labels [6 7 -100 9 -100]   position_ids [0 1 2 0 1]
    """
    if "labels" in mb:
        return mb
    out = dict(mb)
    input_ids = mb["input_ids"].astype(np.int64)
    out["input_ids"] = input_ids
    bits = out.pop("target_bits", None)
    target = None if bits is None else np.unpackbits(bits, count=len(input_ids)).astype(bool)
    out["position_ids"], out["labels"] = derived(
        input_ids, mb["cu_seqlens"], int(mb["num_tokens"]), mb.get("image_token_map"), target
    )
    return out


def packed(batch: Any) -> Any:
    """``batch`` as a worker serves it: packed (:func:`pack_part`) where it packs within
    ``PACK_LIMIT``, else ``batch`` itself (it then travels as Dask serializes task results)."""
    if not _packs(batch):
        return batch
    out = pack_part(batch)
    return out if out is not None else batch


def _packs(value: Any) -> bool:
    """Whether ``value`` is a batch that packs within ``PACK_LIMIT`` (unless a field of it
    would not come back the same: :func:`pack_part`)."""
    return isinstance(value, GroupBatch) and batch_bytes(value) <= PACK_LIMIT


def is_packed(value: Any) -> bool:
    """Whether ``value`` is a packed part (what :func:`pack_part` returns)."""
    return isinstance(value, dict) and "buffer" in value and "micro" in value


def pack_part(batch: Any) -> dict[str, Any] | None:
    """``batch`` (a :class:`GroupBatch`) as plain fields and one buffer (module docstring);
    None where it holds a value that would not come back the same."""
    laid = _layout(batch) if isinstance(batch, GroupBatch) else None
    if laid is None:
        return None
    fields, arrays, size = laid
    buffer = np.zeros(size, np.uint8)
    _write(buffer, 0, arrays)
    # Read-only: a fetcher in the worker's own process (Dask's inproc comms pass objects as
    # they are) must not get a view it could write into; the fetcher copies it once.
    buffer.flags.writeable = False
    return {**fields, "buffer": buffer}


def pack_together(values: list[Any]) -> tuple[list[Any], np.ndarray | None]:
    """``values`` as :func:`packed` gives each, but the packed ones' buffers views of one new
    read-only array, each part written into it once (a part packed already is copied in);
    anything else as it is. The array is None where no value packs."""
    laid: list[tuple[dict[str, Any], list[tuple[int, Any]], int] | None] = []
    for value in values:
        if is_packed(value):
            raw = value["buffer"]
            flat = raw if isinstance(raw, np.ndarray) else np.frombuffer(raw, np.uint8)
            fields = {k: v for k, v in value.items() if k != "buffer"}
            laid.append((fields, [(0, flat)], int(flat.nbytes)))
        elif _packs(value):
            laid.append(_layout(value))
        else:
            laid.append(None)
    starts: list[int] = []
    offset = 0
    for entry in laid:
        offset += -offset % _ALIGN  # (each part's arrays stay aligned)
        starts.append(offset)
        offset += entry[2] if entry is not None else 0
    if all(entry is None for entry in laid):
        return list(values), None
    shared = np.zeros(offset, np.uint8)
    out: list[Any] = []
    for value, entry, start in zip(values, laid, starts, strict=True):
        if entry is None:
            out.append(value)
            continue
        fields, arrays, size = entry
        _write(shared, start, arrays)
        out.append({**fields, "buffer": shared[start : start + size]})
    shared.flags.writeable = False  # (as :func:`pack_part`'s buffer; its views follow)
    return out, shared


def _layout(
    batch: GroupBatch,
) -> tuple[dict[str, Any], list[tuple[int, np.ndarray]], int] | None:
    """A part's plain fields, its arrays each with its offset in the part's buffer, and the
    buffer's size; None where it holds a value that would not come back the same."""
    arrays: list[tuple[int, np.ndarray]] = []
    offset = 0
    micro = []
    for mb in batch.micro_batches:
        fields: list[list[Any]] = []
        for name, value in mb.items():
            if isinstance(value, np.ndarray):
                if value.dtype.hasobject:
                    return None
                offset += -offset % _ALIGN
                fields.append([name, value.dtype.str, list(value.shape), offset])
                arrays.append((offset, value))
                offset += value.nbytes
            elif type(value) in _PLAIN:
                fields.append([name, None, value, 0])
            else:
                return None
        micro.append(fields)
    # The fields go as one msgpack string: Dask sizes every reply before it writes it (its
    # sizeof walks nested lists item by item: five times the cost of packing the part).
    fields_packed = msgpack.packb(micro, use_bin_type=True)
    return {"step": batch.step, "group": batch.group, "micro": fields_packed}, arrays, offset


def _write(buffer: np.ndarray, base: int, arrays: list[tuple[int, Any]]) -> None:
    """Copy each array into ``buffer`` at ``base`` plus its offset."""
    for start, value in arrays:
        if value.size:  # (a memoryview cannot cast an empty many-dimensional array)
            flat = np.ascontiguousarray(value).reshape(-1).view(np.uint8)
            buffer[base + start : base + start + flat.size] = flat


def unpack_part(packed: Any) -> Any:
    """The :class:`GroupBatch` of a packed part (anything else is returned as is). Its arrays
    view one writable copy of the buffer (none where it came writable)."""
    if not isinstance(packed, dict):
        return packed
    buffer = packed["buffer"]
    if not (isinstance(buffer, np.ndarray) and buffer.flags.writeable):
        buffer = bytearray(buffer)  # read-only (bytes, a read-only frame): one copy, writable
    described = packed["micro"]
    if isinstance(described, bytes):
        described = msgpack.unpackb(described, raw=False)
    micro = []
    for fields in described:
        mb: dict[str, Any] = {}
        for name, dtype, shape, offset in fields:
            if dtype is None:
                mb[name] = shape
                continue
            # (math.prod of a plain list: numpy's prod costs microseconds per call, and a
            # rank unpacks every array of every part it takes)
            array = np.frombuffer(buffer, _dtype(dtype), math.prod(shape), offset)
            mb[name] = array if len(shape) == 1 else array.reshape(shape)
        micro.append(mb)
    return GroupBatch(step=int(packed["step"]), group=int(packed["group"]), micro_batches=micro)


@functools.lru_cache(maxsize=64)
def _dtype(name: str) -> np.dtype[Any]:
    """The numpy dtype a packed field names (a handful of names, looked up once each)."""
    return np.dtype(name)


def join_parts(values: list[Any]) -> tuple[list[Any], np.ndarray | None]:
    """The packed parts among ``values`` with their buffers copied into one new, writable
    buffer (each then names its ``span`` of it instead); other values as they are. The buffer
    is None where no value is packed."""
    spans: list[tuple[int, int]] = []
    offset = 0
    for value in values:
        if is_packed(value):
            offset += -offset % _ALIGN  # (each part's arrays stay aligned)
            spans.append((offset, offset + value["buffer"].nbytes))
            offset = spans[-1][1]
    if not spans:
        return list(values), None
    buffer = np.empty(offset, np.uint8)
    out: list[Any] = []
    at = iter(spans)
    for value in values:
        if not is_packed(value):
            out.append(value)
            continue
        lo, hi = next(at)
        buffer[lo:hi] = value["buffer"]
        out.append({**{k: v for k, v in value.items() if k != "buffer"}, "span": [lo, hi]})
    return out, buffer


def split_parts(items: list[Any], buffer: Any) -> list[Any]:
    """What :func:`join_parts` gave, as :func:`pack_part` gave it: each part's buffer a view
    of ``buffer`` (writable where ``buffer`` is: :func:`unpack_part` then copies nothing)."""
    out: list[Any] = []
    for item in items:
        if isinstance(item, dict) and "span" in item and "micro" in item:
            lo, hi = item["span"]
            item = {**{k: v for k, v in item.items() if k != "span"}, "buffer": buffer[lo:hi]}
        out.append(item)
    return out

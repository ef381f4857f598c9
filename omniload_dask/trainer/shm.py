"""A value in one shared-memory segment, for the ranks of a node to read (``multiprocessing``).

The node agent writes each fetched batch once; every local rank that needs it copies it out.
The value is pickled with protocol 5, its buffers (the numpy arrays) out of band, so writing
is one copy of each array and reading one copy back::

    [8 bytes: pickle length][8 bytes: buffers][8 bytes per buffer: its size]
    [pickle][buffer 0 (64-byte aligned)][buffer 1]...

Readers only attach: the agent, which made the segment, unlinks it when no rank needs it.
Where segments are files under ``/dev/shm`` (Linux), a reader maps the file read-only itself:
before Python 3.13, attaching through ``SharedMemory`` starts a resource-tracker process in
every rank (about 10 MiB each), only to be told to forget the segment again.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import pickle
import struct
from collections.abc import Iterator
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import Any

__all__ = ["Segment", "read_segment", "write_segment"]

ALIGN = 64
SHM_DIR = "/dev/shm"  # where POSIX shared memory lives as files (Linux)


class Segment:
    """A segment this process made (and will unlink)."""

    def __init__(self, shm: SharedMemory, size: int) -> None:
        self.shm = shm
        self.size = size

    @property
    def name(self) -> str:
        """The segment's name, for readers."""
        return self.shm.name

    def unlink(self) -> None:
        """Close and remove the segment (readers that attached keep their mapping)."""
        self.shm.close()
        with contextlib.suppress(FileNotFoundError):
            self.shm.unlink()


def write_segment(value: Any) -> Segment:
    """``value`` in a new shared-memory segment."""
    buffers: list[pickle.PickleBuffer] = []
    head = pickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    raws = [b.raw() for b in buffers]
    table = struct.pack(f"<QQ{len(raws)}Q", len(head), len(raws), *(r.nbytes for r in raws))
    offset = _aligned(len(table) + len(head))
    starts = []
    for raw in raws:
        starts.append(offset)
        offset = _aligned(offset + raw.nbytes)
    shm = SharedMemory(create=True, size=max(1, offset))
    view = shm.buf
    assert view is not None
    view[: len(table)] = table
    view[len(table) : len(table) + len(head)] = head
    for start, raw in zip(starts, raws, strict=True):
        view[start : start + raw.nbytes] = raw
    del view
    return Segment(shm, offset)


def read_segment(name: str) -> Any:
    """The value in segment ``name``, copied out (the segment may go once this returns)."""
    with _mapped(name) as view:
        head_len, count = struct.unpack_from("<QQ", view, 0)
        sizes = struct.unpack_from(f"<{count}Q", view, 16)
        table = 16 + 8 * count
        head = bytes(view[table : table + head_len])
        offset = _aligned(table + head_len)
        copies = []
        for size in sizes:
            copies.append(bytearray(view[offset : offset + size]))
            offset = _aligned(offset + size)
        return pickle.loads(head, buffers=copies)


@contextlib.contextmanager
def _mapped(name: str) -> Iterator[memoryview]:
    """A read-only view of segment ``name`` (FileNotFoundError: it is gone)."""
    try:
        fd = os.open(os.path.join(SHM_DIR, name.lstrip("/")), os.O_RDONLY)
    except FileNotFoundError:  # gone, or segments are not files there: ask multiprocessing
        shm = _attach(name)
        try:
            view = shm.buf
            assert view is not None
            yield view
            del view
        finally:
            shm.close()
        return
    try:
        mapping = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    try:
        with memoryview(mapping) as view:
            yield view
    finally:
        mapping.close()


def _attach(name: str) -> SharedMemory:
    """Attach to ``name`` without making this process's resource tracker its owner (before
    Python 3.13 attaching registers it, and the tracker would unlink it at exit)."""
    try:
        return SharedMemory(name=name, track=False)  # type: ignore[call-arg]
    except TypeError:
        shm = SharedMemory(name=name)
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
        return shm


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN

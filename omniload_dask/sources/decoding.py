"""Telling bad data from failed I/O, and decompressed streams that break off cleanly at bad data.

With ``on_error: skip`` a file whose bytes are bad (a truncated gzip, a corrupt Parquet page)
loses what cannot be read and the job goes on; a read that fails because storage failed (a
network error, a lost connection) is not the data's fault and must fail (and be retried). The
two look alike from above: a decompressor or pyarrow raises either way. :class:`WatchedFile`
sits between the decoder and the file and remembers whether a read of the file itself failed.

:class:`Decompressed` reads a compressed stream in fixed blocks from its start, so where it
breaks off is the same for every read of the file, whatever range it wants and however much of
the stream it reads::

    stream    [block 0][block 1][block 2][blo     (corrupt or cut in block 3)
    read()    blocks 0-2, then ends; error = the decoder's exception, broken_at = 3 * BLOCK

Every reader of the file sees the same ``broken_at``, which is what keeps skipping such a file
deterministic when a unit is read in parts (see :mod:`.jsonl`).
"""

from __future__ import annotations

from typing import Any

from fsspec.compression import compr

from omniload_dask.sources.zstd import ZstdFrames

__all__ = ["Decompressed", "WatchedFile"]


class WatchedFile:
    """A binary file that remembers the first exception a read or seek of it raised.

    ``failure`` set means the storage failed (I/O); an exception of a decoder on top of it with
    ``failure`` still None is about the bytes themselves (bad data).
    """

    def __init__(self, f: Any) -> None:
        """Watch ``f`` (closed with this one)."""
        self._f = f
        self.failure: BaseException | None = None

    def read(self, *args: Any) -> Any:
        """``f.read``, remembering a failure."""
        try:
            return self._f.read(*args)
        except Exception as exc:
            self.failure = self.failure or exc
            raise

    def readinto(self, buffer: Any) -> Any:
        """``f.readinto``, remembering a failure."""
        try:
            return self._f.readinto(buffer)
        except Exception as exc:
            self.failure = self.failure or exc
            raise

    def seek(self, *args: Any) -> Any:
        """``f.seek``, remembering a failure."""
        try:
            return self._f.seek(*args)
        except Exception as exc:
            self.failure = self.failure or exc
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)

    def close(self) -> None:
        """Close the file."""
        self._f.close()

    def __enter__(self) -> WatchedFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Decompressed:
    """The decompressed bytes of a file (``gzip``, ``zstd``, ``bz2``, ``xz``...), read in
    blocks of :attr:`BLOCK` from its start.

    Bad data ends the stream: :meth:`read` returns what came before the block that failed,
    ``error`` holds the decoder's exception and ``broken_at`` where the stream broke off. A
    failure of the storage underneath is raised as it is.
    """

    BLOCK = 1 << 16

    def __init__(self, fs: Any, path: str, compression: str) -> None:
        """Open ``path`` of ``fs`` and decompress it with ``compression`` (fsspec's names)."""
        self.raw = WatchedFile(fs.open(path, "rb"))
        try:
            if compression == "zstd":
                self._f: Any = ZstdFrames(self.raw)
            else:
                self._f = compr[compression](self.raw, mode="rb")
        except Exception:
            self.raw.close()
            raise
        self._buf = bytearray()
        self._ended = False
        self.produced = 0  # bytes of the stream decompressed so far
        self.error: Exception | None = None

    @property
    def broken_at(self) -> int | None:
        """Where in the stream bad data ended it (None: it has not, or not yet)."""
        return self.produced if self.error is not None else None

    def _more(self) -> bool:
        """Decompress one more block; False at the end of the stream or at bad data."""
        if self._ended:
            return False
        try:
            chunk = self._f.read(self.BLOCK)
        except Exception as exc:
            if self.raw.failure is not None:
                raise  # the storage failed, not the data
            self.error = exc
            self._ended = True
            return False
        if not chunk:
            self._ended = True
            return False
        self._buf += chunk
        self.produced += len(chunk)
        return True

    def read(self, size: int = -1) -> bytes:
        """Up to ``size`` bytes of the stream (all that is left with ``size < 0``)."""
        while (size < 0 or len(self._buf) < size) and self._more():
            pass
        cut = len(self._buf) if size < 0 else min(size, len(self._buf))
        out = bytes(self._buf[:cut])
        del self._buf[:cut]
        return out

    def close(self) -> None:
        """Close the decompressor and the file."""
        try:
            self._f.close()
        finally:
            self.raw.close()

    def __enter__(self) -> Decompressed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

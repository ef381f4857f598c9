"""Telling bad data from failed I/O, and decompressed streams that break off cleanly at bad data.

With ``on_error: skip`` a file whose bytes are bad (a truncated gzip, a corrupt Parquet page)
loses what cannot be read and the job goes on; a read that fails because storage failed (a
network error, a lost connection) is not the data's fault and must fail (and be retried). The
two look alike from above: a decompressor or pyarrow raises either way. :class:`WatchedFile`
sits between the decoder and the file and remembers whether a read of the file itself failed.

:class:`Decompressed` reads a compressed stream from its start and ends it at bad data, having
given every byte the codec could decode before it (:mod:`.members`)::

    stream    [..........................X.....]     (a corrupt byte at X, or the file cut at X)
    read()    everything the decoder gives up to X, then ends; error says what and where

Where the stream breaks off is a function of the file's bytes alone, so every reader of the file
sees the same ``broken_at``, whatever range it wants and however much it reads: that keeps
skipping such a file deterministic when a unit is read in portions (see :mod:`.jsonl`).
"""

from __future__ import annotations

from typing import Any

from fsspec.compression import compr

from omniload_dask.sources.members import CODECS, MemberDecoder

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
    """The decompressed bytes of a file (``gzip``, ``zstd``, ``bz2``, ``xz``...), from its
    start.

    Bad data ends the stream: :meth:`read` returns every byte decoded before it, ``error``
    holds what was wrong and ``broken_at`` where the stream broke off. A failure of the
    storage underneath is raised as it is. Codecs outside :data:`~.members.CODECS` are read
    through fsspec in blocks of :attr:`BLOCK` (a block that fails is lost).
    """

    BLOCK = 1 << 16

    def __init__(self, fs: Any, path: str, compression: str) -> None:
        """Open ``path`` of ``fs`` and decompress it with ``compression`` (fsspec's names)."""
        self.raw = WatchedFile(fs.open(path, "rb"))
        try:
            if compression in CODECS:
                self._members: MemberDecoder | None = MemberDecoder(self.raw, compression)
                self._f: Any = None
            else:
                self._members = None
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
        if self._members is not None:
            chunk = self._members.more()
            if not chunk:
                self.error = self._members.error
                self._ended = True
                return False
            self._buf += chunk
            self.produced += len(chunk)
            return True
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
            if self._f is not None:
                self._f.close()
        finally:
            self.raw.close()

    def __enter__(self) -> Decompressed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

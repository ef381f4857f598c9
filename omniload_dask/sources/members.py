"""Decoding a compressed file member by member, keeping every byte decoded before bad data.

A compressed file is a run of members: gzip members, zstd frames, bz2 or xz streams. Each is
decoded by the codec's own incremental decoder (``zlib``, ``zstandard``, ``bz2``, ``lzma``),
fed a chunk of compressed bytes at a time. When a chunk holds bad data the decoder raises and
what that call had decoded is lost, so the chunk is fed again one byte at a time from the state
before it; what comes out until the decoder raises is exactly what a decoder fed the file byte
by byte gives before it stops::

    compressed  [member 0 .........][member 1 ....X......]      X: a flipped byte
    fed         [chunk][chunk][chunk][chunk][chu|nk]            the chunk with X fails
    again       ............................[c|h|u|n|...X       byte by byte up to X
    out         member 0, then member 1 up to the last byte the decoder could give before X

The decoders of zstd, bz2 and xz cannot be copied, so "the state before the chunk" is rebuilt
by decoding the member again from its start (only once, when bad data is met). A file that
ends inside a member is bad data too (its decoded bytes are kept), as is anything after the
last member that is not a member (gzip's zero padding excepted, as ``gzip`` allows it).
"""

from __future__ import annotations

import bz2
import lzma
import zlib
from typing import Any

__all__ = ["CODECS", "MemberDecoder"]

CODECS = ("gzip", "zstd", "bz2", "xz", "lzma")


def _decoder(compression: str) -> Any:
    """A fresh incremental decoder of one member (``decompress``, ``eof``, ``unused_data``)."""
    if compression == "gzip":
        return zlib.decompressobj(wbits=31)
    if compression == "zstd":
        import zstandard

        return zstandard.ZstdDecompressor().decompressobj()
    if compression == "bz2":
        return bz2.BZ2Decompressor()
    return lzma.LZMADecompressor()


class MemberDecoder:
    """The decompressed bytes of a file of one or more members, read a chunk at a time.

    :meth:`more` returns the next decoded bytes (``b""`` at the end); at bad data it returns
    what could still be decoded, then ``b""``, and ``error`` says what was wrong and where.
    A failure of ``raw`` itself (storage, not data) is raised as it is.
    """

    CHUNK = 1 << 15  # compressed bytes fed at a time (bounds what one call decodes)

    def __init__(self, raw: Any, compression: str) -> None:
        """Decode ``raw`` (a seekable binary file of compressed bytes) as ``compression``."""
        self._raw = raw
        self._kind = compression
        self._dec: Any = None  # the member being decoded (None: between members)
        self._member_at = 0  # compressed offset where the member started
        self._fed = 0  # compressed bytes fed (or skipped) so far
        self._pending = b""  # compressed bytes read and not fed yet
        self._done = False
        self.error: ValueError | None = None

    def more(self) -> bytes:
        """The next decoded bytes; ``b""`` once the file or the good data ends."""
        while not self._done:
            if not self._pending:
                self._pending = self._raw.read(self.CHUNK)
                if not self._pending:
                    self._done = True
                    if self._dec is not None:
                        self._fail("truncated", self._fed)
                    return b""
            if self._dec is None:
                if self._kind == "gzip":  # zero padding after a member is allowed
                    stripped = self._pending.lstrip(b"\0")
                    self._fed += len(self._pending) - len(stripped)
                    self._pending = stripped
                    if not stripped:
                        continue
                self._dec = _decoder(self._kind)
                self._member_at = self._fed
            chunk, self._pending = self._pending, b""
            try:
                out = self._dec.decompress(chunk)
            except Exception as exc:
                return self._salvage(chunk, exc)
            self._after(chunk)
            if out:
                return out
        return b""

    def _after(self, chunk: bytes) -> None:
        """``chunk`` was fed: keep what lies past the member's end for the next member."""
        if self._dec.eof:
            rest = self._dec.unused_data
            self._fed += len(chunk) - len(rest)
            self._pending = rest
            self._dec = None
        else:
            self._fed += len(chunk)

    def _salvage(self, chunk: bytes, exc: Exception) -> bytes:
        """What ``chunk`` decodes to before its bad byte, fed again byte by byte from the
        member's state before it; sets ``error`` and ends the stream."""
        dec = _decoder(self._kind)
        here = self._raw.tell()
        self._raw.seek(self._member_at)
        left = self._fed - self._member_at
        while left > 0:  # the member up to the chunk again (it decoded before)
            data = self._raw.read(min(left, self.CHUNK))
            if not data:
                break
            dec.decompress(data)
            left -= len(data)
        self._raw.seek(here)
        out = bytearray()
        for k in range(len(chunk)):
            try:
                out += dec.decompress(chunk[k : k + 1])
            except Exception as inner:
                self._fail("corrupt", self._fed + k + 1, inner)
                return bytes(out)
            if dec.eof:  # (a decoder that raised past its member's end) the next member
                self._fed += k + 1
                self._pending, self._dec = chunk[k + 1 :], None
                return bytes(out)
        self._fail("corrupt", self._fed + len(chunk), exc)
        return bytes(out)

    def _fail(self, what: str, at: int, exc: Exception | None = None) -> None:
        """End the stream at bad data: ``error`` says what and where."""
        if exc is None:
            text = f"truncated {self._kind} file: it ends inside a member, after {at} bytes"
        else:
            text = f"{what} {self._kind} data within the first {at} compressed bytes ({exc})"
        self.error = ValueError(text)
        self._dec = None
        self._done = True

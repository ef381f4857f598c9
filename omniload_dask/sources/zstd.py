"""A zstd reader that reads every frame of a file and fails on a file cut inside a frame.

``zstandard``'s stream reader (what fsspec uses) stops at the end of the first frame, so the
rest of a multi-frame file (``pzstd``, concatenated files) would be lost without a word, and it
returns nothing, without an error, for a truncated file. :class:`ZstdFrames` decompresses frame
after frame::

    file     [frame 0][frame 1][fra          (cut inside frame 2)
    read()   frame 0 + frame 1 + what frame 2 held, then ValueError("truncated zstd file ...")

Corrupt data raises ValueError too, saying where (``zstandard``'s own ``ZstdError`` says only
"Data corruption detected"); the reader of a unit adds the source, file and range.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ZstdFrames"]


class ZstdFrames:
    """The decompressed bytes of every frame of a zstd file, read in order; a file that ends
    inside a frame raises instead of ending early."""

    CHUNK = 1 << 17

    def __init__(self, raw: Any) -> None:
        """Read from ``raw``, an open binary file of compressed bytes (closed with this one)."""
        import zstandard

        self._raw = raw
        self._dctx = zstandard.ZstdDecompressor()
        self._frame = self._dctx.decompressobj()
        self._in_frame = False  # bytes of a frame fed, and its end not reached yet
        self._out = bytearray()
        self._done = False
        self._fed = 0  # compressed bytes read
        self._error: ValueError | None = None  # raised once what came before is read

    def read(self, size: int = -1) -> bytes:
        """Up to ``size`` decompressed bytes (all that is left with ``size < 0``).

        At bad data (corrupt, or the file ends inside a frame) it returns what the frames
        before gave, then raises ValueError: where it breaks off never depends on ``size``.
        """
        import zstandard

        while not self._done and (size < 0 or len(self._out) < size):
            data = self._raw.read(self.CHUNK)
            self._fed += len(data)
            if not data:
                self._done = True
                if self._in_frame:
                    self._error = ValueError("truncated zstd file: it ends inside a frame")
            while data:  # one chunk may end a frame and start the next
                self._in_frame = True
                try:
                    self._out += self._frame.decompress(data)
                except zstandard.ZstdError as exc:
                    self._done = True
                    self._error = ValueError(
                        f"corrupt zstd data within the first {self._fed} compressed bytes ({exc})"
                    )
                    break
                if not self._frame.eof:
                    break
                data = self._frame.unused_data
                self._frame = self._dctx.decompressobj()
                self._in_frame = False
        if self._error is not None and not self._out:
            raise self._error
        cut = len(self._out) if size < 0 else min(size, len(self._out))
        out = bytes(self._out[:cut])
        del self._out[:cut]
        return out

    def close(self) -> None:
        """Close the underlying file."""
        self._raw.close()

    def __enter__(self) -> ZstdFrames:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

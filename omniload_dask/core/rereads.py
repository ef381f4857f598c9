"""A read made again must give what its first run gave: the check, and the reason to stop.

Dask runs a read task again when the shard it made is lost with its worker (and the plan keeps
no standby copy), or when the data plane submits it again after the job lost its connection.
The stream was dealt from the first run's report: its records' token counts, which every
recipe built from the shard slices by. A second run that gives other records would make the
constructions read past a document's end or take the wrong tokens, so the data plane compares
each later report of a read with the first (:class:`FirstReports`) and stops the job when
they differ, naming the source, the read and what changed.

What is compared: the token count of every record (always), and where the source runs user
code (``transform`` / ``filter``) a CRC-32 of the shard's tokens (:func:`tokens_digest`, taken
by the read task), since a transform that does not draw from the generator it is given (the
``random`` module, the clock) can give other tokens of the same counts. A file that changes
under a running job is caught the same way (by its token counts; its tokens, where the source
runs user code).
"""

from __future__ import annotations

import zlib

import numpy as np

from omniload_dask.core.streams import SourceStream, UnitRef

__all__ = ["FirstReports", "reread_change", "tokens_digest"]


class FirstReports:
    """The first report of every read the data plane tracks (its records' token counts, and
    its tokens' digest where its source gives one), and the check of every later report
    against it."""

    def __init__(self) -> None:
        self._first: dict[str, tuple[np.ndarray, int | None]] = {}

    def check(
        self,
        key: str,
        stream: SourceStream,
        ref: UnitRef,
        portion: int,
        lengths: np.ndarray,
        digest: int | None,
    ) -> str | None:
        """Why the job must stop if this report of read ``key`` (portion ``portion`` of
        ``stream``'s unit ``ref``) differs from its first; None if it is the first or agrees."""
        first = self._first.get(key)
        if first is None:
            self._first[key] = (lengths, digest)
            return None
        change = reread_change(first[0], lengths, digest, first[1])
        if change is None:
            return None
        unit = stream.units.get(ref)
        spec = unit.specs[portion] if unit is not None and portion < len(unit.specs) else None
        where = f"{spec.file_url} [{spec.start}:{spec.stop}]" if spec else "its unit"
        return (
            f"source {stream.spec.name!r}: read {key} ({where}) was made again (its shard was "
            f"lost) and gave {change}; the steps were dealt from its first run. A source's "
            "transform and filter must give the same output for the same record and generator "
            "(draw only from the generator they are given), and its files must not change "
            "while a job reads them"
        )

    def forget(self, key: str) -> None:
        """Read ``key``'s unit is released: its reports are not tracked any more."""
        self._first.pop(key, None)


def tokens_digest(tokens: np.ndarray) -> int:
    """CRC-32 of a shard's token ids, as the read task gives them (the dtype's bytes)."""
    return zlib.crc32(np.ascontiguousarray(tokens).view(np.uint8).data)


def reread_change(
    before: np.ndarray, lengths: np.ndarray, digest: int | None, first_digest: int | None
) -> str | None:
    """What a read's later report changed against its first (None: nothing)."""
    if not np.array_equal(before, lengths):
        return (
            f"{len(lengths)} records of {int(np.sum(lengths)):,} tokens, against "
            f"{len(before)} records of {int(np.sum(before)):,} tokens the first time"
        )
    if digest is not None and first_digest is not None and digest != first_digest:
        return "records of the same token counts, but other tokens"
    return None

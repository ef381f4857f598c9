"""The contract between the data plane's sources and a file format, as plain data.

A format lists a source's files into read units (:class:`Units`) and reads one unit into
records (:class:`RawRecords`); :class:`SourceFormat` is the protocol each format module
implements. Nothing here opens a file: opening is :mod:`.files`, the formats are
:mod:`.jsonl`, :mod:`.parquet` and :mod:`.webdataset`, and :mod:`.registry` looks them up by the
plan's ``format`` field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from omniload_dask.batching.labels import Holes
from omniload_dask.plan import SourceSpec

__all__ = ["RawRecords", "SourceFormat", "Units"]


@dataclass(frozen=True)
class Units:
    """What a format's ``units()`` returns: the read units and how a unit may be split.

    ``table`` rows are ``(file index, start, stop)``; ``rows`` the records per unit where known
    up front, else -1. A negative ``stop`` means "to the end of the file", and ``-stop - 1`` is
    where that end is estimated to be (the last unit of a compressed JSON Lines file).
    ``split`` says how :meth:`~omniload_dask.sources.catalog.Catalog.portions` cuts a unit into
    smaller reads with the same records: ``rows`` (start/stop are row numbers), ``bytes`` (byte
    ranges whose records are those starting inside, as JSON Lines), ``marks`` (records start at
    the byte offsets ``marks[mark_index[u]:mark_index[u + 1]]``), or ``none``.

    A token format that knows every record's length from an index (Megatron's ``.idx``,
    Arrow's list offsets) gives them up front: row ``u``'s records have the token counts
    ``lengths[length_index[u]:length_index[u + 1]]`` in file order, and the data plane plans
    with them before any read reports (see :meth:`.catalog.Catalog.known_lengths`). A source
    with a mask column gives them only with ``holes`` (every record's tokens that are not
    targets, in the same order), read from the mask beside the ids: the data plane counts each
    step's loss tokens from them.
    """

    table: np.ndarray
    rows: np.ndarray
    split: str = "none"
    marks: np.ndarray | None = None
    mark_index: np.ndarray | None = None
    lengths: np.ndarray | None = None
    length_index: np.ndarray | None = None
    holes: Holes | None = None


@dataclass
class RawRecords:
    """Records of one read unit in file order: texts, offsets, and the records that failed.

    ``images`` (image-text sources) holds each record's encoded images, in order; ``chats``
    (chat sources) each record's conversation (:func:`~omniload_dask.sources.chat.conversation`),
    its text then empty. A token source's records are token ids already: ``tokens`` holds them
    all, flat, and ``lengths`` each record's count (``texts`` is then empty). A token source
    with a mask column (``sources[].mask``) has ``mask`` too: one flat bool array as long as
    ``tokens``, true where the token is a target (:mod:`.token_masks`); it becomes the shard's
    ``target`` mask.
    """

    texts: list[str]
    offsets: np.ndarray
    bad: list[tuple[int, str]] = field(default_factory=list)
    images: list[list[bytes]] | None = None
    chats: list[Any] | None = None
    tokens: np.ndarray | None = None
    lengths: np.ndarray | None = None
    mask: np.ndarray | None = None

    @classmethod
    def of_tokens(
        cls, tokens: np.ndarray, lengths: np.ndarray, offsets: np.ndarray,
        bad: list[tuple[int, str]] | None = None, mask: np.ndarray | None = None,
    ) -> RawRecords:  # fmt: skip
        """Token records: ``tokens`` flat, ``lengths`` per record, at ``offsets`` (``mask``:
        their targets, flat, where the source has a mask column)."""
        return cls([], np.asarray(offsets, np.int64), bad or [], tokens=tokens,
                   lengths=np.asarray(lengths, np.int64), mask=mask)  # fmt: skip

    @property
    def count(self) -> int:
        """How many good records there are."""
        return len(self.offsets)


class SourceFormat(Protocol):
    """A file format. Implementations are stateless; one module per format."""

    name: str
    extensions: tuple[str, ...]

    def units(
        self,
        spec: SourceSpec,
        fs: Any,
        files: list[str],
        sizes: list[int],
        skip_unreadable: bool = False,
    ) -> Units:
        """Split files into read units; check each file (schema, footer) on the way.

        A file whose bytes cannot be parsed raises a SourceError naming it, or with
        ``skip_unreadable`` (``on_error: skip``) gets a unit whose read reports it as bad.
        """

    def read(self, spec: SourceSpec, fs: Any, path: str, start: int, stop: int) -> RawRecords:
        """Read one unit; a bad record goes to ``bad`` with its offset and reason.

        Bytes that cannot be decoded (a truncated or corrupt file) are bad records too, the
        same ones however the unit is split into portions; a failure of the storage raises.
        """

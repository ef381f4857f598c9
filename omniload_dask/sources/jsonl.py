"""JSON Lines: one JSON object per line, plain or compressed (.gz, .zst, .bz2, .xz).

Plain files are split into byte ranges of ``unit_bytes``. A unit ``[start, stop)`` owns every
line whose first byte ``s`` satisfies ``start < s <= stop`` (and the line at 0 for the first
unit), so neighbouring units never share or drop a line::

    bytes   0         10        20        30
    lines   |aaaaaa\\n|bbbbbbbbbbbbbb\\n|cc\\n|ddd\\n
    units   [0 ...... 16)  [16 ....... 32)
    unit 0 reads a, b (b starts at 7 <= 16); unit 1 reads c (starts at 22) and d.

The same rule lets a unit be read in portions (byte sub-ranges) that together hold exactly its
lines. A record's offset (and so its sample id) is the byte offset of its line, in the
decompressed stream where compressed.

Compressed files are cut the same way, in ranges of the decompressed stream: a read
decompresses from the start of the file and throws away the bytes before its range (cheap next
to parsing and tokenizing them). How long the decompressed stream is can only be estimated
without reading it all (the zstd frame header or the gzip trailer of the source's first
compressed file gives the ratio, else ``DEFAULT_RATIO``), so the last unit of a compressed file
runs to the end of the stream whatever its length: its stop is stored as ``-(estimated end) - 1``
(see :class:`~omniload_dask.sources.base.Units`). A wrong estimate only makes units longer or
shorter, or leaves some empty; it never drops or repeats a line. At most
``MAX_COMPRESSED_UNITS`` units per file, which bounds the decompression thrown away at about
that many halves of the file per pass.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from fsspec.utils import infer_compression

from omniload_dask.errors import RecordError, SourceError
from omniload_dask.plan import SourceSpec
from omniload_dask.sources.base import RawRecords, Units
from omniload_dask.sources.chat import conversation
from omniload_dask.sources.files import open_file
from omniload_dask.sources.ids import MAX_OFFSET

_TAIL_CHUNK = 1 << 16
_SKIP_CHUNK = 1 << 20
MAX_COMPRESSED_UNITS = 16
DEFAULT_RATIO = 4.0  # decompressed / compressed bytes, when no header tells
_RATIO_RANGE = (1.0, 50.0)
_CHECK_FILES = 8  # files tried for the start-up check when unreadable ones are skipped
_PEEK_BYTES = 1 << 16  # of a file's start, where the start-up check looks for a record


class JsonLines:
    """The JSON Lines format: byte-range units, the text in a field of each object."""

    name: str = "jsonl"
    extensions: tuple[str, ...] = (
        ".jsonl",
        ".json",
        ".ndjson",
        ".jsonl.gz",
        ".jsonl.zst",
        ".jsonl.bz2",
        ".jsonl.xz",
        ".json.gz",
        ".json.zst",
        ".ndjson.gz",
        ".ndjson.zst",
    )

    def units(
        self,
        spec: SourceSpec,
        fs: Any,
        files: list[str],
        sizes: list[int],
        skip_unreadable: bool = False,
    ) -> Units:
        """Byte ranges of ``unit_bytes`` per file (of the decompressed stream where compressed);
        the first parseable record of the first file is checked for the text field (with
        ``skip_unreadable``, of the first file where one can be read)."""
        rows: list[tuple[int, int, int]] = []
        ratio: float | None = None
        for i, (url, size) in enumerate(zip(files, sizes, strict=True)):
            compression = infer_compression(url)
            if compression:
                if ratio is None:
                    ratio = _ratio(fs, url, compression, size)
                rows.extend(_compressed_units(i, int(size * ratio), spec.unit_bytes))
                continue
            if size >= MAX_OFFSET:
                raise SourceError(
                    f"source {spec.name!r}: file {url!r} is {size} bytes; at most "
                    f"{MAX_OFFSET - 1} per JSON Lines file (split the file)"
                )
            rows.extend(
                (i, lo, min(lo + spec.unit_bytes, size)) for lo in range(0, size, spec.unit_bytes)
            )
        self._check_first_record(spec, fs, files, skip_unreadable)
        units = np.asarray(rows, dtype=np.int64).reshape(-1, 3)
        return Units(units, np.full(len(units), -1, dtype=np.int64), split="bytes")

    def _check_first_record(
        self, spec: SourceSpec, fs: Any, files: list[str], skip_unreadable: bool
    ) -> None:
        """Fail at start-up if the first parseable record of the first file lacks the text
        field (a wrong ``sources[].text``).

        Lines before it that are not JSON objects follow ``on_error``, as anywhere else: with
        ``raise`` the first one fails here, naming its offset; with ``skip``
        (``skip_unreadable``) they are passed over (the reads skip and count them). A first
        file that cannot be decompressed fails too, unless ``skip_unreadable``: then the next
        files are tried (their reads will report what cannot be read).
        """
        for url in files[: _CHECK_FILES if skip_unreadable else 1]:
            with open_file(fs, fs._strip_protocol(url), infer_compression(url)) as f:
                head = f.read(_PEEK_BYTES)
                if b"\n" not in head:
                    head += _read_to_newline(f, head)  # the first line, whole
                error = getattr(f, "error", None)
            if error is not None and b"\n" not in head:
                if skip_unreadable:
                    continue
                raise SourceError(
                    f"source {spec.name!r}: file {url!r}: cannot read its first line "
                    f"({type(error).__name__}: {error}); is the file corrupt or truncated?"
                )
            if self._check_lines(spec, url, head, skip_unreadable):
                return

    def _check_lines(self, spec: SourceSpec, url: str, head: bytes, skip: bool) -> bool:
        """Check the first JSON object among the complete lines of ``head`` (the start of
        ``url``); False if there is none."""
        offset = 0
        for line in head.splitlines(keepends=True):
            at, offset = offset, offset + len(line)
            if not line.endswith(b"\n") and len(head) >= _PEEK_BYTES:
                return False  # cut by the peek: the reads will see it whole
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                reason = None if isinstance(record, dict) else "not a JSON object"
            except ValueError as exc:
                reason = f"malformed JSON ({exc})"
            if reason is not None:
                if skip:
                    continue
                raise RecordError(
                    f"source {spec.name!r}: file {url!r}: record at offset {at}: {reason} "
                    "(set on_error: skip to skip and count such records)"
                )
            if spec.text not in record:
                raise SourceError(
                    f"source {spec.name!r}: file {url!r}: first record has no field "
                    f"{spec.text!r} (has: {', '.join(sorted(record))}) at offset {at}; set "
                    "sources[].text"
                )
            return True
        return False

    def read(self, spec: SourceSpec, fs: Any, path: str, start: int, stop: int) -> RawRecords:
        """The lines whose first byte lies in ``(start, stop]`` (and the one at 0), parsed.

        A compressed stream that breaks off (corrupt or truncated) gives the lines before the
        break, and one bad record for the line it breaks off in, reported by the read that owns
        that line; the rest of the file cannot be read.
        """
        url = fs.unstrip_protocol(path)
        compression = infer_compression(path)
        with open_file(fs, path, compression) as f:
            if compression:
                _skip(f, start)
            else:
                f.seek(start)
            data = f.read() if stop < 0 else f.read(stop - start)
            if start > 0 and b"\n" not in data:
                return _parse(spec, url, b"", start, np.zeros(0, dtype=np.int64))  # inside a line
            if stop >= 0:
                data += _read_to_newline(f, data)
            error = f.error if compression else None
        end = stop if stop >= 0 else start + len(data)
        if error is None:
            return _parse(spec, url, data, start, _line_starts(data, start, end))
        # Keep the whole lines; the line the stream broke off in starts after the last newline.
        whole = data[: data.rfind(b"\n") + 1]
        records = _parse(spec, url, whole, start, _line_starts(whole, start, end))
        broken = start + len(whole)
        if (start < broken <= end) or broken == start == 0:
            records.bad.append(
                (
                    broken,
                    f"the decompressed stream breaks off at byte {start + len(data)} "
                    f"({type(error).__name__}: {error}): this line and the rest of the file "
                    "cannot be read (corrupt or truncated file)",
                )
            )
        return records


def _compressed_units(index: int, estimate: int, unit_bytes: int) -> list[tuple[int, int, int]]:
    """Units of one compressed file of about ``estimate`` decompressed bytes; the last one's stop
    is ``-(end) - 1``: it reads to the end of the stream."""
    estimate = max(1, estimate)
    count = max(1, min(MAX_COMPRESSED_UNITS, -(-estimate // max(1, unit_bytes))))
    step = -(-estimate // count)
    rows = [(index, k * step, (k + 1) * step) for k in range(count - 1)]
    last = (count - 1) * step
    rows.append((index, last, -max(estimate, last + 1) - 1))
    return rows


def _ratio(fs: Any, url: str, compression: str, size: int) -> float:
    """Decompressed over compressed bytes of one file, from its header or trailer if it says."""
    path = fs._strip_protocol(url)
    full: int | None = None
    try:
        if compression == "zstd" and size >= 18:
            import zstandard

            with fs.open(path, "rb", cache_type="none") as f:
                n = zstandard.frame_content_size(f.read(18))
            full = n if n > 0 else None
        elif compression == "gzip" and size >= 18:
            with fs.open(path, "rb", cache_type="none") as f:
                f.seek(size - 4)
                full = int.from_bytes(f.read(4), "little")  # ISIZE: modulo 2**32
    except Exception:  # a bad header is the reader's to report, with its file and range
        full = None
    if not full or size <= 0:
        return DEFAULT_RATIO
    return min(max(full / size, _RATIO_RANGE[0]), _RATIO_RANGE[1])


def _skip(f: Any, count: int) -> None:
    """Read and drop ``count`` bytes of a decompressing stream (fewer if it ends first)."""
    while count > 0:
        chunk = f.read(min(count, _SKIP_CHUNK))
        if not chunk:
            return
        count -= len(chunk)


def _read_to_newline(f: Any, data: bytes) -> bytes:
    """Bytes after ``data`` up to and including the newline that ends its last line."""
    # Also when ``data`` ends in a newline: the line starting exactly at ``stop`` is ours.
    tail = bytearray()
    while True:
        chunk = f.read(_TAIL_CHUNK)
        if not chunk:
            return bytes(tail)
        cut = chunk.find(b"\n")
        if cut >= 0:
            tail += chunk[: cut + 1]
            return bytes(tail)
        tail += chunk


def _line_starts(data: bytes, start: int, stop: int) -> np.ndarray:
    """Offsets (into ``data``) of the lines this unit owns: file offset in (start, stop], or 0."""
    buf = np.frombuffer(data, dtype=np.uint8)
    starts = np.flatnonzero(buf == 10) + 1
    starts = starts[(starts + start <= stop) & (starts < len(data))]
    if start == 0 and len(data):
        starts = np.concatenate([[0], starts])
    return starts.astype(np.int64)


def _parse(spec: SourceSpec, url: str, data: bytes, base: int, starts: np.ndarray) -> RawRecords:
    texts: list[str] = []
    offsets: list[int] = []
    bad: list[tuple[int, str]] = []
    chats: list[Any] = []
    ends = np.empty_like(starts)
    if len(starts):
        ends[:-1] = starts[1:]
        nl = data.find(b"\n", int(starts[-1]))
        ends[-1] = len(data) if nl < 0 else nl + 1
    for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
        line = data[s:e]
        if not line.strip():
            continue  # blank lines are not records
        offset = base + s
        if offset >= MAX_OFFSET:
            raise SourceError(
                f"source {spec.name!r}: file {url!r}: offset {offset} is past "
                f"{MAX_OFFSET - 1}; split the file"
            )
        try:
            record = json.loads(line)
        except ValueError as exc:
            bad.append((offset, f"malformed JSON ({exc})"))
            continue
        if not isinstance(record, dict):
            bad.append((offset, f"expected a JSON object, got {type(record).__name__}"))
            continue
        if spec.chat is not None:  # a chat source keeps the record's conversation
            chat = conversation(spec.chat, record)
            if isinstance(chat, str):
                bad.append((offset, chat))
                continue
            chats.append(chat)
            texts.append("")
            offsets.append(offset)
            continue
        text = record.get(spec.text)
        if text is None:
            bad.append((offset, f"no field {spec.text!r}"))
            continue
        if not isinstance(text, str):
            bad.append((offset, f"field {spec.text!r} is {type(text).__name__}, not a string"))
            continue
        texts.append(text)
        offsets.append(offset)
    return RawRecords(
        texts=texts,
        offsets=np.asarray(offsets, dtype=np.int64),
        bad=bad,
        chats=chats if spec.chat is not None else None,
    )


FORMAT = JsonLines()

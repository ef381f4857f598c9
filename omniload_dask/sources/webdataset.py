"""WebDataset-style tar shards: one record per key, its image and text in files of that key.

A member's key is its path up to the first dot of its file name, its extension the rest
(``a/0007.jpg`` -> key ``a/0007``, extension ``jpg``); a record is a run of consecutive
members with the same key. The record's images are its files with an extension listed in
``sources[].image`` (in that order), its text the UTF-8 file with extension ``sources[].text``::

    shard-000.tar   0000.jpg 0000.txt 0001.png 0001.txt 0002.webp 0002.txt ...
    records         0000 (jpg, txt)   0001 (png, txt)   0002 (webp, txt)

Discovery reads every member header once (not the data) to find where each record starts; a
unit is ``sources[].unit_records`` consecutive records (default 64), ``(file, first byte,
stop byte)``, and can be read in portions at record boundaries. A record's offset (and so its
sample id) is the byte offset of its first header. A chat source's record holds its conversation
in a ``.json`` file, an object with the field ``sources[].chat`` names (``0000.jpg 0000.json``:
``{"messages": [{"role": "user", "content": [{"type": "image"}, ...]}, ...]}``). A record without an image or text file is a
bad record (``on_error``); a tar that cannot be parsed fails at start-up, naming the file
(with ``on_error: skip`` it becomes one bad record). A unit whose tar data breaks off (a
truncated shard) keeps the records before the break and reports the one it breaks off in.
"""

from __future__ import annotations

import io
import json
import posixpath
import tarfile
from typing import Any

import numpy as np

from omniload_dask.errors import SourceError
from omniload_dask.plan import SourceSpec
from omniload_dask.sources.base import RawRecords, Units
from omniload_dask.sources.chat import conversation
from omniload_dask.sources.decoding import WatchedFile
from omniload_dask.sources.files import open_file
from omniload_dask.sources.ids import MAX_OFFSET

BLOCK = 512


def split_name(name: str) -> tuple[str, str]:
    """``(key, extension)`` of a member path, as WebDataset cuts it."""
    folder, base = posixpath.split(name)
    stem, dot, ext = base.partition(".")
    return posixpath.join(folder, stem), ext.lower() if dot else ""


def _members(f: Any) -> list[tuple[str, int, int]]:
    """``(key, header offset, end offset)`` of each regular file member, in tar order."""
    out = []
    with tarfile.open(fileobj=f, mode="r:") as tar:
        for info in tar:
            if not info.isfile():
                continue
            base = posixpath.basename(info.name)
            if not base or base.startswith("."):
                continue
            end = info.offset_data + -(-info.size // BLOCK) * BLOCK
            out.append((split_name(info.name)[0], info.offset, end))
    return out


class WebDataset:
    """WebDataset tar shards: a record per member key, units of ``unit_records`` records."""

    name: str = "webdataset"
    extensions: tuple[str, ...] = (".tar",)

    def units(
        self,
        spec: SourceSpec,
        fs: Any,
        files: list[str],
        sizes: list[int],
        skip_unreadable: bool = False,
    ) -> Units:
        """Runs of records found from every member header; records start at the ``marks``.

        A file that is not a tar fails, or with ``skip_unreadable`` becomes one unit of one
        record, whose read reports it as a bad record.
        """
        per_unit = spec.unit_records or 64
        table: list[tuple[int, int, int]] = []
        rows: list[int] = []
        marks: list[int] = []
        index = [0]
        for i, url in enumerate(files):
            with open_file(fs, fs._strip_protocol(url)) as raw:
                f = WatchedFile(raw)
                try:
                    members = _members(f)
                except Exception as exc:
                    if f.failure is None and skip_unreadable:
                        members = [("", 0, max(1, sizes[i]))]  # one record: the whole file
                    else:
                        what = (
                            "cannot be read"
                            if f.failure is not None
                            else "is not a readable tar file"
                        )
                        raise SourceError(
                            f"source {spec.name!r}: file {url!r} {what} "
                            f"({type(exc).__name__}: {exc})"
                        ) from None
            starts: list[int] = []
            ends: list[int] = []
            previous = None
            for key, start, end in members:
                if key != previous:
                    starts.append(start)
                    ends.append(end)
                    previous = key
                else:
                    ends[-1] = end
            if starts and starts[-1] >= MAX_OFFSET:
                raise SourceError(
                    f"source {spec.name!r}: file {url!r}: a record starts past byte "
                    f"{MAX_OFFSET - 1}; split the tar"
                )
            for lo in range(0, len(starts), per_unit):
                hi = min(lo + per_unit, len(starts))
                table.append((i, starts[lo], ends[hi - 1]))
                rows.append(hi - lo)
                marks.extend(starts[lo:hi])
                index.append(len(marks))
        return Units(
            np.asarray(table, dtype=np.int64).reshape(-1, 3),
            np.asarray(rows, dtype=np.int64),
            split="marks",
            marks=np.asarray(marks, dtype=np.int64),
            mark_index=np.asarray(index, dtype=np.int64),
        )

    def read(self, spec: SourceSpec, fs: Any, path: str, start: int, stop: int) -> RawRecords:
        """The records whose first header lies in bytes ``[start, stop)`` (record boundaries)."""
        with open_file(fs, path) as f:
            f.seek(start)
            data = f.read(stop - start)
        records: list[tuple[int, dict[str, bytes]]] = []
        bad: list[tuple[int, str]] = []
        try:
            _parse_tar(data, start, records)
        except Exception as exc:  # bad bytes: the data is in memory, no I/O can fail here
            # The record being read when the tar broke off (it may lack files) and the rest of
            # this read are lost; the records before it are whole.
            at = records.pop()[0] if records else start
            bad.append(
                (
                    at,
                    f"the tar data breaks off in this record ({type(exc).__name__}: {exc}): "
                    f"it and the rest of bytes [{start}, {stop}) cannot be read "
                    "(corrupt or truncated file)",
                )
            )
        texts: list[str] = []
        offsets: list[int] = []
        images: list[list[bytes]] = []
        chats: list[Any] = []
        for offset, files in records:
            blobs = [files[ext] for ext in spec.image if ext in files]
            text = files.get(spec.text if spec.chat is None else "json")
            if spec.chat is not None:  # (a conversation may have no image: a text-only turn)
                chat = _conversation(spec, text, files)
                if isinstance(chat, str):
                    bad.append((offset, chat))
                    continue
                chats.append(chat)
                texts.append("")
                offsets.append(offset)
                images.append(blobs)
            elif not blobs:
                bad.append((offset, f"no image file ({'/'.join(spec.image)}); has {sorted(files)}"))
            elif text is None:
                bad.append((offset, f"no .{spec.text} file; has {sorted(files)}"))
            else:
                try:
                    texts.append(text.decode("utf-8"))
                except UnicodeDecodeError as exc:
                    bad.append((offset, f".{spec.text} file is not UTF-8 ({exc})"))
                    continue
                offsets.append(offset)
                images.append(blobs)
        bad.sort(key=lambda b: b[0])
        return RawRecords(
            texts=texts, offsets=np.asarray(offsets, dtype=np.int64), bad=bad, images=images,
            chats=chats if spec.chat is not None else None,
        )  # fmt: skip


def _conversation(spec: SourceSpec, blob: bytes | None, files: dict[str, bytes]) -> Any:
    """A chat record's conversation from its ``.json`` file, or why it has none (a ``str``)."""
    assert spec.chat is not None
    if blob is None:
        return f"no .json file (the conversation); has {sorted(files)}"
    try:
        record = json.loads(blob)
    except ValueError as exc:  # (UnicodeDecodeError is one)
        return f".json file is not JSON ({exc})"
    if not isinstance(record, dict):
        return f".json file must hold an object, got {type(record).__name__}"
    return conversation(spec.chat, record)


def _parse_tar(data: bytes, start: int, records: list[tuple[int, dict[str, bytes]]]) -> None:
    """Append ``(offset, {extension: bytes})`` per record of the tar bytes ``data`` (which
    start at byte ``start`` of the file), in order, as far as they can be parsed."""
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        previous = None
        for info in tar:
            if not info.isfile() or posixpath.basename(info.name).startswith("."):
                continue
            key, ext = split_name(info.name)
            if key != previous:
                records.append((start + info.offset, {}))
                previous = key
            member = tar.extractfile(info)
            assert member is not None
            blob = member.read()
            if len(blob) < info.size:
                raise tarfile.ReadError(f"member {info.name!r} is cut short")
            records[-1][1].setdefault(ext, blob)


FORMAT = WebDataset()

"""Whether a Parquet file carries page checksums, read from its first page header.

A Parquet page header may hold a CRC32 of the page's bytes (``PageHeader.crc``, field 4; pyarrow
writes it with ``write_page_checksum=True``, as do Spark and parquet-mr when asked). Readers can
verify it, and :mod:`.parquet` asks pyarrow to; a page without one that still decodes cannot
be told from a good one. pyarrow does not say whether a file has checksums, so this reads the
first fields of the first page header of the first column chunk, in Thrift's compact protocol::

    byte    0x15        field delta 1, type 5 (i32): field 1, the page type
    varint  ...         its value (zigzag)
    0x15 .. 0x15 ..     fields 2 and 3: the page sizes
    0x15 + varint       field 4, the crc -- present, or the next field (>= 5) comes instead

Writers that checksum pages checksum all of them, so the first page answers for the file.
"""

from __future__ import annotations

from typing import Any

__all__ = ["has_page_checksums"]

_HEADER_BYTES = 64  # the first fields of a page header fit many times over
_I32, _I16, _I64, _BYTE, _TRUE, _FALSE = 5, 4, 6, 3, 1, 2
_CRC_FIELD = 4


def has_page_checksums(metadata: Any, raw: Any) -> bool | None:
    """True if the file's first page header holds a crc, False if not; None when the file has
    no pages or the header cannot be read (``metadata``: pyarrow's ``FileMetaData``; ``raw``:
    the open binary file)."""
    if metadata.num_row_groups == 0 or metadata.num_columns == 0:
        return None
    column = metadata.row_group(0).column(0)
    offsets = [column.data_page_offset]
    if column.has_dictionary_page and column.dictionary_page_offset:
        offsets.append(column.dictionary_page_offset)
    start = min(o for o in offsets if o is not None and o >= 0)
    raw.seek(start)
    return _crc_field_present(raw.read(_HEADER_BYTES))


def _crc_field_present(header: bytes) -> bool | None:
    """Walk the compact-protocol fields of a PageHeader up to the crc (None: unexpected)."""
    pos, field = 0, 0
    while pos < len(header):
        byte = header[pos]
        pos += 1
        if byte == 0:  # the struct's end
            return False
        delta, kind = byte >> 4, byte & 0x0F
        if delta:
            field += delta
        else:
            value, pos = _varint(header, pos)
            field = (value >> 1) ^ -(value & 1)
        if field == _CRC_FIELD:
            return True
        if field > _CRC_FIELD:
            return False
        if kind in (_I32, _I16, _I64):
            _, pos = _varint(header, pos)
        elif kind == _BYTE:
            pos += 1
        elif kind not in (_TRUE, _FALSE):
            return None  # not a page header as the format defines it
    return None


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    """An unsigned LEB128 varint at ``pos``, and the position after it."""
    value = shift = 0
    while pos < len(data):
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos
    return value, pos

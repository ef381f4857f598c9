"""Stable global sample ids.

A sample id packs where a record lives into one non-negative int64, so it is stable across
epochs, runs, worker counts and DP sizes::

    bit 62 ........ 53 52 ............. 35 34 ..................... 0
        source (10 bits)  file (18 bits)      offset (35 bits)

``source`` is the source's index in the plan, ``file`` the index of the file in the source's
sorted file list, ``offset`` the row number (Parquet) or the byte offset of the line (JSON Lines;
in the decompressed stream for compressed files). Example: source 2, file 5, byte 1000 gives
``2 << 53 | 5 << 35 | 1000``.
"""

from __future__ import annotations

import numpy as np

__all__ = ["MAX_FILES", "MAX_OFFSET", "MAX_SOURCES", "decode_sample_id", "encode_sample_ids"]

SOURCE_BITS, FILE_BITS, OFFSET_BITS = 10, 18, 35
MAX_SOURCES = 1 << SOURCE_BITS
MAX_FILES = 1 << FILE_BITS
MAX_OFFSET = 1 << OFFSET_BITS


def encode_sample_ids(source: int, file: int | np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Sample ids of records at ``offsets`` of one file, or each of its own ``file`` (an array
    as long as ``offsets``; caller checks the bounds)."""
    files = np.asarray(file, dtype=np.int64) << np.int64(OFFSET_BITS)
    top = np.int64(int(source) << (FILE_BITS + OFFSET_BITS))
    return np.asarray(offsets, dtype=np.int64) | files | top


def decode_sample_id(sample_id: int) -> tuple[int, int, int]:
    """``(source index, file index, offset)`` of a global sample id."""
    sample_id = int(sample_id)
    return (
        sample_id >> (FILE_BITS + OFFSET_BITS),
        (sample_id >> OFFSET_BITS) & (MAX_FILES - 1),
        sample_id & (MAX_OFFSET - 1),
    )

"""A truncated or corrupt compressed JSON Lines file gives every complete line before the break,
exactly those, then one bad record: checked at many cut points and flipped bytes, for gzip and
zstd, against what ``zlib`` and ``zstandard`` decode from the same bytes fed one at a time."""

from __future__ import annotations

import gzip
import json
import random
import zlib
from pathlib import Path

import numpy as np
import pytest
import zstandard

from omniload_dask.plan import SourceSpec
from omniload_dask.sources.registry import discover_source, read_unit_records

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]


def corpus(lines: int = 2500) -> bytes:
    rng = random.Random(7)
    docs = [" ".join(rng.choice(WORDS) + str(rng.randrange(999)) for _ in range(rng.randrange(3, 30))) for _ in range(lines)]  # fmt: skip
    return "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()


def compress(raw: bytes, how: str) -> bytes:
    if how == "gzip":
        half = len(raw) // 2  # two members, as concatenated gzip files have
        return gzip.compress(raw[:half], mtime=0) + gzip.compress(raw[half:], mtime=0)
    if how == "zstd":  # without a frame checksum (the zstandard package's default)
        return zstandard.ZstdCompressor().compress(raw)
    return zstandard.ZstdCompressor(write_checksum=True).compress(raw)  # zstd's own default


def reference(blob: bytes, how: str) -> tuple[bytes, bool]:
    """What the codec decodes from ``blob`` fed one byte at a time before it stops, and
    whether it stopped at bad data (or the file ended inside a member)."""
    out = bytearray()
    dec = None
    for k in range(len(blob)):
        if dec is None:
            if how == "gzip" and blob[k] == 0:
                continue
            dec = zlib.decompressobj(31) if how == "gzip" else zstandard.ZstdDecompressor().decompressobj()  # fmt: skip
        try:
            out += dec.decompress(blob[k : k + 1])
        except Exception:
            return bytes(out), True
        if dec.eof:
            dec = None
    return bytes(out), dec is not None


def expected(out: bytes, broken: bool) -> tuple[list[tuple[int, str]], list[int]]:
    """The good records ``(offset, text)`` and bad record offsets of the decoded ``out``."""
    whole = out[: out.rfind(b"\n") + 1] if broken else out
    good, bad = [], []
    at = 0
    for line in whole.splitlines(keepends=True):
        try:
            record = json.loads(line)
            if isinstance(record, dict) and isinstance(record.get("text"), str):
                good.append((at, record["text"]))
            else:
                bad.append(at)
        except ValueError:
            if line.strip():
                bad.append(at)
        at += len(line)
    if broken:
        bad.append(len(whole))  # the line the stream breaks off in (or the end)
    return good, bad


def read_through_units(path: Path) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    sp = SourceSpec(name="s", format="jsonl", paths=(str(path),), weight=1.0, unit_bytes=8192)
    cat = discover_source(sp, on_error="skip")
    good: list[tuple[int, str]] = []
    bad: list[tuple[int, str]] = []
    for u in range(cat.num_units):
        f, lo, hi = cat.units[u].tolist()
        portions = cat.portions(u, 3) if u % 2 else [(lo, hi)]  # some units read in portions
        for a, b in portions:
            rec = read_unit_records(sp, cat.files[f], a, b)
            good += list(zip(rec.offsets.tolist(), rec.texts, strict=True))
            bad += rec.bad
    return good, bad


def damaged(blob: bytes, kind: str, at: int) -> bytes:
    if kind == "cut":
        return blob[:at]
    out = bytearray(blob)
    out[at] ^= 0x5A
    return bytes(out)


@pytest.mark.parametrize("how", ["gzip", "zstd", "zstd-checksum"])
@pytest.mark.parametrize("kind", ["cut", "flip"])
def test_every_complete_line_before_the_break_and_one_bad_record(tmp_path, how, kind):
    raw = corpus()
    blob = compress(raw, how)
    assert len(blob) > 2 * 32768  # more than a few of the chunks fed to the decoder
    points = np.linspace(20, len(blob) - 2, 14).astype(int).tolist()
    kept_before_break = []
    for at in points:
        bad_blob = damaged(blob, kind, at)
        path = tmp_path / f"f{at}.jsonl{'.gz' if how == 'gzip' else '.zst'}"
        path.write_bytes(bad_blob)
        out, broken = reference(bad_blob, "gzip" if how == "gzip" else "zstd")
        want_good, want_bad = expected(out, broken)
        good, bad = read_through_units(path)
        assert good == want_good, (how, kind, at)
        assert [o for o, _ in bad] == want_bad, (how, kind, at, bad[-3:])
        if broken:
            assert "breaks off" in bad[-1][1] and f"{how.split('-')[0]} " in bad[-1][1]
            kept_before_break.append(len(good))
        if kind == "cut":  # a cut stream is a prefix of the file: every line it holds is good
            assert broken and raw.startswith(out) and len(bad) == 1
    # the lines before a break are kept (a block of the stream around it used to be lost)
    assert max(kept_before_break) > 1000

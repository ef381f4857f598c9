from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omniload_dask import SourceError
from omniload_dask.plan import SourceSpec
from omniload_dask.sources import decode_sample_id
from omniload_dask.sources.ids import encode_sample_ids
from omniload_dask.sources.registry import discover_source, read_unit_records

from .datagen import texts, write_jsonl, write_parquet


def spec(path: str, fmt: str = "jsonl", **kw: object) -> SourceSpec:
    return SourceSpec(name="s", format=fmt, paths=(path,), weight=1.0, **kw)  # type: ignore[arg-type]


def read_all(sp: SourceSpec) -> tuple[list[str], list[int], list]:
    cat = discover_source(sp)
    out_texts, out_offsets, bad = [], [], []
    for f, lo, hi in cat.units.tolist():
        rec = read_unit_records(sp, cat.files[f], lo, hi)
        out_texts += rec.texts
        out_offsets += rec.offsets.tolist()
        bad += rec.bad
    return out_texts, out_offsets, bad


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 60), min_size=0, max_size=40),
    unit=st.integers(1, 200),
    blank_every=st.integers(0, 5),
)
def test_jsonl_byte_ranges_cover_every_line_exactly_once(
    tmp_path_factory, lengths, unit, blank_every
):
    tmp = tmp_path_factory.mktemp("j")
    docs = ["x" * n + str(i) for i, n in enumerate(lengths)]
    lines = []
    for i, d in enumerate(docs):
        if blank_every and i % blank_every == 0:
            lines.append("")  # blank lines are not records
        lines.append(json.dumps({"text": d}))
    (tmp / "f.jsonl").write_text("\n".join(lines) + ("\n" if lines else ""))
    got, offsets, bad = read_all(spec(str(tmp / "f.jsonl"), unit_bytes=unit))
    assert got == docs
    assert bad == []
    assert len(set(offsets)) == len(offsets)
    raw = (tmp / "f.jsonl").read_bytes()
    for text, off in zip(got, offsets, strict=True):
        assert json.loads(raw[off:].split(b"\n", 1)[0])["text"] == text


@pytest.mark.parametrize("compression", [None, "gzip", "zstd"])
def test_jsonl_reads_plain_and_compressed(tmp_path, compression):
    docs = texts(30)
    ext = {None: "", "gzip": ".gz", "zstd": ".zst"}[compression]
    write_jsonl(tmp_path / f"a.jsonl{ext}", docs, compression=compression)
    got, offsets, _ = read_all(spec(str(tmp_path / "*.jsonl*"), unit_bytes=64))
    assert got == docs
    assert offsets == sorted(offsets)


def _compress(raw: bytes, how: str) -> bytes:
    import gzip

    import zstandard

    if how == "gzip":
        return gzip.compress(raw, mtime=0)
    if how == "zstd":
        return zstandard.ZstdCompressor().compress(raw)
    if how == "zstd-no-size":  # streamed: the frame header does not say the content size
        cobj = zstandard.ZstdCompressor().compressobj()
        return cobj.compress(raw) + cobj.flush()
    # two frames: the first header gives only the first frame's size (a 100x underestimate)
    cut = len(raw) // 100
    c = zstandard.ZstdCompressor()
    return c.compress(raw[:cut]) + c.compress(raw[cut:])


@pytest.mark.parametrize("how", ["gzip", "zstd", "zstd-no-size", "zstd-two-frames"])
def test_compressed_jsonl_is_cut_in_decompressed_ranges_that_hold_every_line_once(tmp_path, how):
    docs = texts(2000, seed=3)
    write_jsonl(tmp_path / "plain" / "a.jsonl", docs)
    raw = (tmp_path / "plain" / "a.jsonl").read_bytes()
    ext = ".gz" if how == "gzip" else ".zst"
    (tmp_path / f"a.jsonl{ext}").write_bytes(_compress(raw, how))
    sp = spec(str(tmp_path / f"a.jsonl{ext}"), unit_bytes=16 * 1024)
    cat = discover_source(sp)
    # the last unit runs to the end of the stream, however wrong the estimate of its length
    assert int(cat.units[-1, 2]) < 0
    assert cat.num_units > (1 if how == "zstd-two-frames" else 4)
    assert cat.num_units <= 16
    got, offsets, bad = read_all(sp)
    # same records and sample offsets as the plain file read whole
    plain = read_unit_records(spec(str(tmp_path / "plain" / "a.jsonl")), str(tmp_path / "plain" / "a.jsonl"), 0, len(raw))  # fmt: skip
    assert got == docs == plain.texts and bad == []
    assert offsets == plain.offsets.tolist()
    # and every unit can be read in parts holding exactly its records
    for u in range(cat.num_units):
        f, lo, hi = cat.units[u].tolist()
        whole = read_unit_records(sp, cat.files[f], lo, hi)
        parts = cat.parts(u, 3)
        joined: list[str] = []
        for a, b in parts:
            joined += read_unit_records(sp, cat.files[f], a, b).texts
        assert joined == whole.texts


@pytest.mark.parametrize("how", ["gzip", "zstd"])
def test_a_truncated_compressed_file_is_an_error_naming_it_never_fewer_records(tmp_path, how):
    raw = ("\n".join(json.dumps({"text": "x" * 50 + str(i)}) for i in range(3000)) + "\n").encode()
    ext = ".gz" if how == "gzip" else ".zst"
    whole = _compress(raw, how)
    (tmp_path / f"a.jsonl{ext}").write_bytes(whole)
    (tmp_path / f"b.jsonl{ext}").write_bytes(whole[: len(whole) // 2])
    sp = spec(str(tmp_path / f"*.jsonl{ext}"), unit_bytes=16 * 1024)
    cat = discover_source(sp)
    last = [r for r in cat.units.tolist() if r[0] == 1][-1]  # b's last unit reads to its end
    with pytest.raises(SourceError, match=rf"file '.*b\.jsonl\{ext}', unit \[\d+, -\d+\)"):
        read_unit_records(sp, cat.files[1], last[1], last[2])
    if how == "gzip":
        return  # gzip decodes the start of a truncated file: only the read of its end fails
    # a zstd block (up to 128 KiB) this file cuts gives nothing: the start-up check fails
    with pytest.raises(SourceError, match=rf"source 's': file '.*b\.jsonl\{ext}': cannot read"):
        discover_source(spec(str(tmp_path / f"b.jsonl{ext}")))


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 60), min_size=0, max_size=40),
    unit=st.integers(1, 200),
    how=st.sampled_from(["gzip", "zstd", "zstd-no-size"]),
)
def test_compressed_ranges_cover_every_line_exactly_once(tmp_path_factory, lengths, unit, how):
    tmp = tmp_path_factory.mktemp("z")
    docs = ["x" * n + str(i) for i, n in enumerate(lengths)]
    raw = ("\n".join(json.dumps({"text": d}) for d in docs) + ("\n" if docs else "")).encode()
    ext = ".gz" if how == "gzip" else ".zst"
    (tmp / f"f.jsonl{ext}").write_bytes(_compress(raw, how))
    got, offsets, bad = read_all(spec(str(tmp / f"f.jsonl{ext}"), unit_bytes=unit))
    assert got == docs and bad == []
    for text, off in zip(got, offsets, strict=True):
        assert json.loads(raw[off:].split(b"\n", 1)[0])["text"] == text


def test_parquet_units_are_row_groups_as_row_ranges_and_offsets_are_row_numbers(tmp_path):
    docs = texts(50)
    write_parquet(tmp_path / "a.parquet", docs, row_group_size=16)
    sp = spec(str(tmp_path / "a.parquet"), fmt="parquet")
    cat = discover_source(sp)
    assert cat.units.tolist() == [[0, 0, 16], [0, 16, 32], [0, 32, 48], [0, 48, 50]]
    assert cat.rows.tolist() == [16, 16, 16, 2]
    got, offsets, _ = read_all(sp)
    assert got == docs and offsets == list(range(50))


def test_parquet_unit_records_cut_row_groups_never_across_them(tmp_path):
    docs = texts(50)
    write_parquet(tmp_path / "a.parquet", docs, row_group_size=16)
    sp = dataclasses.replace(spec(str(tmp_path / "a.parquet"), fmt="parquet"), unit_records=6)
    cat = discover_source(sp)
    assert cat.units[:4].tolist() == [[0, 0, 6], [0, 6, 12], [0, 12, 16], [0, 16, 22]]
    assert int(cat.rows.sum()) == 50
    got, offsets, _ = read_all(sp)
    assert got == docs and offsets == list(range(50))


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_parts_of_a_unit_hold_exactly_its_records_in_file_order(tmp_path, fmt):
    docs = texts(300 if fmt == "parquet" else 3000, seed=5)
    if fmt == "parquet":
        write_parquet(tmp_path / "a.parquet", docs, row_group_size=100)
        sp = spec(str(tmp_path / "a.parquet"), fmt="parquet")
    else:
        write_jsonl(tmp_path / "a.jsonl", docs)
        sp = spec(str(tmp_path / "a.jsonl"), unit_bytes=3 * 65536)
    cat = discover_source(sp)
    for u in range(cat.num_units):
        f, lo, hi = cat.units[u].tolist()
        whole = read_unit_records(sp, cat.files[f], lo, hi)
        for count in (2, 3, 7):
            parts = cat.parts(u, count)
            assert len(parts) == min(count, cat.max_parts(u))
            texts_, offsets = [], []
            for a, b in parts:
                got = read_unit_records(sp, cat.files[f], a, b)
                texts_ += got.texts
                offsets += got.offsets.tolist()
            assert texts_ == whole.texts and offsets == whole.offsets.tolist()
    assert max(cat.max_parts(u) for u in range(cat.num_units)) >= 3


def test_sample_ids_round_trip():
    ids = encode_sample_ids(1023, 262143, np.array([0, 2**35 - 1]))
    assert decode_sample_id(int(ids[0])) == (1023, 262143, 0)
    assert decode_sample_id(int(ids[1])) == (1023, 262143, 2**35 - 1)
    assert (ids >= 0).all()


def test_files_are_sorted_across_paths_and_globs(tmp_path):
    for name in ("b.jsonl", "a.jsonl", "c.jsonl"):
        write_jsonl(tmp_path / name, ["x"])
    sp = SourceSpec(
        name="s",
        format="jsonl",
        weight=1,
        paths=(str(tmp_path / "c.jsonl"), str(tmp_path / "[ab].jsonl")),
    )
    cat = discover_source(sp)
    assert [Path(f).name for f in cat.files] == ["a.jsonl", "b.jsonl", "c.jsonl"]


# ------------------------------------------------------------------ bad input
def test_missing_path_names_source_and_path(tmp_path):
    with pytest.raises(SourceError, match=r"source 's': path '.*nope.jsonl' does not exist"):
        discover_source(spec(str(tmp_path / "nope.jsonl")))


def test_empty_glob_names_the_glob(tmp_path):
    with pytest.raises(SourceError, match=r"glob '.*\*.jsonl' matched no files"):
        discover_source(spec(str(tmp_path / "*.jsonl")))


def test_folder_without_matching_files(tmp_path):
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(SourceError, match="holds no .jsonl"):
        discover_source(spec(str(tmp_path)))


def test_missing_parquet_column_is_found_at_discovery(tmp_path):
    write_parquet(tmp_path / "a.parquet", ["x"], column="body")
    with pytest.raises(SourceError, match=r"has no column 'text' \(columns: body, n\)"):
        discover_source(spec(str(tmp_path / "a.parquet"), fmt="parquet"))


def test_non_string_parquet_column_is_found_at_discovery(tmp_path):
    write_parquet(tmp_path / "a.parquet", [1, 2], column="text")
    with pytest.raises(SourceError, match="has type int64, expected a string column"):
        discover_source(spec(str(tmp_path / "a.parquet"), fmt="parquet"))


def test_corrupt_parquet_names_the_file(tmp_path):
    write_parquet(tmp_path / "good.parquet", ["x"])
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 this is not parquet at all")
    with pytest.raises(SourceError, match=r"file '.*bad.parquet' is not a readable Parquet"):
        discover_source(spec(str(tmp_path / "*.parquet"), fmt="parquet"))


def test_missing_jsonl_field_in_first_record_fails_at_discovery(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", ["x"], field="body")
    with pytest.raises(SourceError, match=r"first record has no field 'text' \(has: body, n\)"):
        discover_source(spec(str(tmp_path / "a.jsonl")))


def test_malformed_and_wrong_records_are_reported_with_offsets(tmp_path):
    path = write_jsonl(
        tmp_path / "a.jsonl",
        ["a", "b", "c", "d", "e"],
        raw_lines={1: "{not json", 2: '{"text": 5}', 3: '["list"]'},
    )
    got, _, bad = read_all(spec(str(path)))
    assert got == ["a", "e"]
    reasons = [r for _, r in bad]
    assert reasons[0].startswith("malformed JSON")
    assert reasons[1] == "field 'text' is int, not a string"
    assert reasons[2] == "expected a JSON object, got list"
    raw = path.read_bytes()
    assert raw[bad[0][0] :].startswith(b"{not json")


def test_null_parquet_values_are_bad_records(tmp_path):
    write_parquet(tmp_path / "a.parquet", ["a", None, "c"])
    got, _, bad = read_all(spec(str(tmp_path / "a.parquet"), fmt="parquet"))
    assert got == ["a", "c"] and bad == [(1, "column 'text' is null")]


def test_unknown_protocol_is_a_source_error():
    with pytest.raises(SourceError, match="cannot open"):
        discover_source(spec("nosuchproto://bucket/x.jsonl"))


def test_memory_filesystem_works(tmp_path):
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.pipe("/omni/a.jsonl", b'{"text": "hello"}\n{"text": "world"}\n')
    got, _, _ = read_all(spec("memory://omni/*.jsonl"))
    assert got == ["hello", "world"]

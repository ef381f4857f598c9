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


def read_all(sp: SourceSpec, cat=None) -> tuple[list[str], list[int], list]:
    cat = discover_source(sp) if cat is None else cat
    out_texts, out_offsets, bad = [], [], []
    for f, lo, hi in cat.units.tolist():
        rec = read_unit_records(sp, cat.files[f], lo, hi)
        out_texts += rec.texts
        out_offsets += rec.offsets.tolist()
        bad += rec.bad
    return out_texts, out_offsets, bad


def read_portions(sp: SourceSpec, url: str, portions: list[tuple[int, int]]) -> tuple[list, list]:
    """Texts and bad records of the reads ``portions`` of one file, in order."""
    texts: list[str] = []
    bad: list = []
    for a, b in portions:
        rec = read_unit_records(sp, url, a, b)
        texts += rec.texts
        bad += rec.bad
    return texts, bad


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
    # and every unit can be read in portions holding exactly its records
    for u in range(cat.num_units):
        f, lo, hi = cat.units[u].tolist()
        whole = read_unit_records(sp, cat.files[f], lo, hi)
        portions = cat.portions(u, 3)
        joined: list[str] = []
        for a, b in portions:
            joined += read_unit_records(sp, cat.files[f], a, b).texts
        assert joined == whole.texts


def _damage(data: bytes, how: str) -> bytes:
    """Cut ``data`` in half, or flip 50 bytes in its middle."""
    if how == "cut":
        return data[: len(data) // 2]
    out = bytearray(data)
    for k in range(len(out) // 2, len(out) // 2 + 50):
        out[k] ^= 0x55
    return bytes(out)


@pytest.mark.parametrize("compression", ["gzip", "zstd"])
@pytest.mark.parametrize("damage", ["cut", "flip"])
def test_a_broken_compressed_file_gives_its_whole_lines_and_one_bad_record_however_it_is_split(
    tmp_path, compression, damage
):
    raw = ("\n".join(json.dumps({"text": "x" * 50 + str(i)}) for i in range(6000)) + "\n").encode()
    ext = ".gz" if compression == "gzip" else ".zst"
    chunks = [raw[i : i + 40_000] for i in range(0, len(raw), 40_000)]  # zstd: many frames
    whole = b"".join(_compress(c, "gzip" if compression == "gzip" else "zstd") for c in chunks)
    (tmp_path / f"b.jsonl{ext}").write_bytes(_damage(whole, damage))
    sp = spec(str(tmp_path / f"b.jsonl{ext}"), unit_bytes=16 * 1024)
    cat = discover_source(sp, on_error="skip")
    got, offsets, bad = read_all(sp, cat)
    lines = raw.splitlines(keepends=True)
    starts = np.concatenate([[0], np.cumsum([len(x) for x in lines])])[:-1].tolist()
    breaks = [b for b in bad if "breaks off" in b[1]]
    assert len(breaks) == 1, bad  # the one line the stream breaks off in, once
    (at, reason), k = breaks[0], starts.index(breaks[0][0])
    assert 0 < k < 6000 and "cannot be read (corrupt or truncated file)" in reason
    # every record before the break is there (or a bad record of its own), none after it
    good = [o for o in offsets if o < at]
    assert good == offsets and len(good) + len(bad) - 1 == k
    if damage == "cut":
        assert got == [json.loads(x)["text"] for x in lines[:k]] and len(bad) == 1
    # the same records and the same one bad record when every unit is read in portions
    for u in range(cat.num_units):
        f, lo, hi = cat.units[u].tolist()
        once = read_unit_records(sp, cat.files[f], lo, hi)
        for n in (2, 3, 5):
            assert read_portions(sp, cat.files[f], cat.portions(u, n)) == (once.texts, once.bad), (
                u,
                n,
            )


@pytest.mark.parametrize("how", ["gzip", "zstd"])
def test_a_truncated_compressed_file_is_an_error_naming_it_with_on_error_raise(tmp_path, how):
    from omniload_dask import RecordError
    from omniload_dask.cluster.tasks import read_unit
    from omniload_dask.plan import TokenizerSpec

    raw = ("\n".join(json.dumps({"text": "x" * 50 + str(i)}) for i in range(3000)) + "\n").encode()
    ext = ".gz" if how == "gzip" else ".zst"
    whole = _compress(raw, how)
    (tmp_path / f"a.jsonl{ext}").write_bytes(whole)
    (tmp_path / f"b.jsonl{ext}").write_bytes(whole[: len(whole) // 2])
    if how == "zstd":  # a zstd block (up to 128 KiB) this file cuts gives nothing: start-up fails
        with pytest.raises(
            SourceError, match=rf"source 's': file '.*b\.jsonl\{ext}': cannot read its first line"
        ):
            discover_source(spec(str(tmp_path / f"b.jsonl{ext}")))
    sp = spec(str(tmp_path / f"*.jsonl{ext}"), unit_bytes=16 * 1024)
    cat = discover_source(sp)  # the first file is whole
    last = [r for r in cat.units.tolist() if r[0] == 1][-1]  # b's last unit reads to its end
    with pytest.raises(
        RecordError,
        match=rf"source 's': file '.*b\.jsonl\{ext}': record at offset \d+: the "
        "decompressed stream breaks off",
    ):
        for f, lo, hi in [r for r in cat.units.tolist() if r[0] == 1]:
            read_unit(sp, 0, TokenizerSpec(), "raise", f, cat.files[f], lo, hi)
    assert last[2] < 0


def test_a_corrupt_zstd_file_names_source_file_and_what_is_wrong(tmp_path):
    raw = ("\n".join(json.dumps({"text": "y" * 40 + str(i)}) for i in range(500)) + "\n").encode()
    (tmp_path / "a.jsonl.zst").write_bytes(_damage(_compress(raw, "zstd"), "flip"))
    with pytest.raises(
        SourceError,
        match=r"source 's': file '.*a\.jsonl\.zst': cannot read its first line \(ValueError: "
        r"corrupt zstd data within the first \d+ compressed bytes \(.*Data corruption",
    ):
        discover_source(spec(str(tmp_path / "a.jsonl.zst")))
    (tmp_path / "b.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd" + b"garbage" * 20)
    with pytest.raises(SourceError, match=r"file '.*b\.jsonl\.zst': cannot read its first line"):
        discover_source(spec(str(tmp_path / "b.jsonl.zst")))


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
def test_portions_of_a_unit_hold_exactly_its_records_in_file_order(tmp_path, fmt):
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
            portions = cat.portions(u, count)
            assert len(portions) == min(count, cat.max_portions(u))
            texts_, offsets = [], []
            for a, b in portions:
                got = read_unit_records(sp, cat.files[f], a, b)
                texts_ += got.texts
                offsets += got.offsets.tolist()
            assert texts_ == whole.texts and offsets == whole.offsets.tolist()
    assert max(cat.max_portions(u) for u in range(cat.num_units)) >= 3


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


def _corrupt_first_row_group(path: Path) -> None:
    """Flip bytes inside the first row group's first data page (its footer stays whole)."""
    import pyarrow.parquet as pq

    page = pq.ParquetFile(path).metadata.row_group(0).column(0).data_page_offset
    data = bytearray(path.read_bytes())
    for k in range(page + 8, page + 60):
        data[k] ^= 0x55
    path.write_bytes(bytes(data))


def test_unreadable_parquet_fails_at_start_up_or_with_on_error_skip_is_bad_records(tmp_path):
    docs = [f"row {i} " + "words " * (i % 7) for i in range(48)]
    write_parquet(tmp_path / "a.parquet", docs, row_group_size=16)
    write_parquet(tmp_path / "b.parquet", docs, row_group_size=16)
    whole = (tmp_path / "b.parquet").read_bytes()
    (tmp_path / "b.parquet").write_bytes(whole[: len(whole) // 2])  # its footer is gone
    write_parquet(tmp_path / "c.parquet", docs, row_group_size=16)
    _corrupt_first_row_group(tmp_path / "c.parquet")
    sp = spec(str(tmp_path / "*.parquet"), fmt="parquet", unit_records=5)
    with pytest.raises(
        SourceError, match=r"source 's': file '.*b\.parquet' is not a readable Parq"
    ):
        discover_source(sp)
    cat = discover_source(sp, on_error="skip")
    got, _, _ = read_all(sp, cat)
    assert got == docs + docs[16:]  # a whole; b none; c without its first row group
    by_file: dict[int, list] = {}
    for f, lo, hi in cat.units.tolist():
        by_file.setdefault(f, []).extend(read_unit_records(sp, cat.files[f], lo, hi).bad)
    assert by_file[0] == []
    assert len(by_file[1]) == 1 and "not readable Parquet" in by_file[1][0][1]
    assert [row for row, _ in by_file[2]] == list(range(16))  # every row of it, once
    assert all("row group 0 cannot be decoded" in reason for _, reason in by_file[2])
    # the same rows are bad however the units are split
    for u in range(cat.num_units):
        f, lo, hi = cat.units[u].tolist()
        once = read_unit_records(sp, cat.files[f], lo, hi)
        assert read_portions(sp, cat.files[f], cat.portions(u, 3)) == (once.texts, once.bad)


def test_unreadable_tar_shards_fail_at_start_up_or_with_on_error_skip_are_bad_records(tmp_path):
    from omniload_dask.demo import write_image_tar

    write_image_tar(tmp_path / "a.tar", 10, seed=1)
    (tmp_path / "b.tar").write_bytes(b"this is not a tar" * 100)
    write_image_tar(tmp_path / "c.tar", 10, seed=2)
    whole = (tmp_path / "c.tar").read_bytes()
    (tmp_path / "c.tar").write_bytes(whole[: len(whole) * 2 // 3])
    sp = spec(str(tmp_path / "*.tar"), fmt="webdataset", text="txt", image=("jpg", "png", "webp"))
    sp = dataclasses.replace(sp, unit_records=4)
    with pytest.raises(SourceError, match=r"source 's': file '.*b\.tar' is not a readable tar"):
        discover_source(sp)
    cat = discover_source(sp, on_error="skip")
    texts: dict[int, list[str]] = {0: [], 1: [], 2: []}
    bad: dict[int, list] = {0: [], 1: [], 2: []}
    for u in range(cat.num_units):
        f, lo, hi = cat.units[u].tolist()
        once = read_unit_records(sp, cat.files[f], lo, hi)
        texts[f] += once.texts
        bad[f] += once.bad
        # however the unit is split
        assert read_portions(sp, cat.files[f], cat.portions(u, 4)) == (once.texts, once.bad)
    assert len(texts[0]) == 10 and bad[0] == []
    assert texts[1] == [] and [o for o, _ in bad[1]] == [0] and "breaks off" in bad[1][0][1]
    assert 0 < len(texts[2]) < 10 and len(bad[2]) == 1  # the record the cut falls in
    assert "breaks off in this record" in bad[2][0][1]


def test_a_json_lines_line_longer_than_hundreds_of_units_is_read_once_and_never_hangs(tmp_path):
    from omniload_dask.plan import parse_plan
    from omniload_dask.testing import InlineDataPlane

    from .datagen import plan_dict

    # One 300 KB line in 1 KiB units: ~290 units, all but one inside the line (they own none),
    # more than the data plane reads ahead of a cursor (256 units).
    (tmp_path / "long").mkdir()
    (tmp_path / "long" / "a.jsonl").write_text(json.dumps({"text": "z" * 300_000}) + "\n")
    write_jsonl(tmp_path / "short" / "b.jsonl", texts(200, seed=1))
    sources = [
        {"name": "long", "format": "jsonl", "path": str(tmp_path / "long"), "unit_bytes": 1024},
        {"name": "short", "format": "jsonl", "path": str(tmp_path / "short")},
    ]
    plan = parse_plan(plan_dict(sources, seed=1, layout={"dp": 1}))
    units = discover_source(plan.sources[0]).units.tolist()
    assert len(units) > 256
    inside = [read_unit_records(plan.sources[0], str(tmp_path / "long" / "a.jsonl"), lo, hi)
              for _, lo, hi in units[1:4]]  # fmt: skip
    assert all(not r.texts and not r.bad for r in inside)
    plane = InlineDataPlane(plan)
    plane.draw(6)  # before: a draw waited for a unit that was never submitted
    stream = plane.coord.view.streams[0]
    # The line is one document of ~300k tokens: with `split` and no cap it continues across
    # steps, so what matters is that the draws went on and the source took its share.
    assert plane.coord.view.next_step >= 6 and stream.tokens > 0  # (on to the end of a block)

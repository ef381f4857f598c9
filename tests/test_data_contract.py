"""Bad bytes and bad lines, round three: Parquet page checksums catch a corrupt page that still
decodes; a file none of whose records can be read counts in ``skipped`` everywhere it is shown
(stats, the Prometheus metric, the dashboard table); a malformed first line follows
``on_error``; ``omniload validate`` reads the first records and says what it found."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from prometheus_client.parser import text_string_to_metric_families

from omniload_dask import Job, RecordError, SourceError
from omniload_dask.cli import main
from omniload_dask.plan import SourceSpec, parse_plan
from omniload_dask.sources.registry import discover_source, read_unit_records
from omniload_dask.testing import InlineDataPlane

from .datagen import plan_dict, texts, write_jsonl

ROWS, GROUP = 64, 16


def parquet_with_a_corrupt_page(path: Path, checksums: bool) -> list[str]:
    """A Parquet file (row groups of 16, uncompressed, so changed bytes still decode) whose
    row group 1's text pages have bytes changed; returns the texts as written."""
    docs = [f"doc{i} " + "alpha beta gamma " * 8 for i in range(ROWS)]
    table = pa.table({"text": docs, "n": list(range(ROWS))})
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(
        table,
        path,
        row_group_size=GROUP,
        compression="none",
        use_dictionary=False,
        write_page_checksum=checksums,
    )
    column = pq.ParquetFile(path).metadata.row_group(1).column(0)
    data = bytearray(path.read_bytes())
    body = column.data_page_offset + column.total_compressed_size - 200
    for k in range(body, body + 40):
        if data[k] == ord("a"):
            data[k] = ord("b")  # letters for letters: the page still decodes
    path.write_bytes(bytes(data))
    return docs


def read_everything(sp: SourceSpec) -> tuple[list[str], list[tuple[int, str]]]:
    cat = discover_source(sp, on_error="skip")
    got: list[str] = []
    bad: list[tuple[int, str]] = []
    for f, lo, hi in cat.units.tolist():
        rec = read_unit_records(sp, cat.files[f], lo, hi)
        got += rec.texts
        bad += rec.bad
    return got, bad


def test_a_corrupt_page_that_still_decodes_is_a_bad_record_per_row_where_checksummed(tmp_path):
    docs = parquet_with_a_corrupt_page(tmp_path / "sum" / "a.parquet", checksums=True)
    sp = SourceSpec(name="s", format="parquet", paths=(str(tmp_path / "sum"),), weight=1.0)
    got, bad = read_everything(sp)
    assert got == docs[:GROUP] + docs[2 * GROUP :]  # every other row, as written
    assert [row for row, _ in bad] == list(range(GROUP, 2 * GROUP))
    assert all("row group 1 fails its page checksum" in reason for _, reason in bad)
    # without checksums the same change is delivered as data: what the README says it cannot see
    docs = parquet_with_a_corrupt_page(tmp_path / "plain" / "a.parquet", checksums=False)
    sp = SourceSpec(name="s", format="parquet", paths=(str(tmp_path / "plain"),), weight=1.0)
    got, bad = read_everything(sp)
    assert bad == [] and len(got) == ROWS and got != docs


def unreadable_files(root: Path) -> dict[str, Path]:
    """One file per case, none of whose records can be read."""
    raw = "".join(json.dumps({"text": t}) + "\n" for t in texts(300, seed=4)).encode()
    zst = bytearray(zstandard.ZstdCompressor().compress(raw))
    for k in range(4, 12):
        zst[k] ^= 0xFF  # the frame header: nothing decodes
    cases = {
        "zstd": root / "zstd" / "a.jsonl.zst",
        "gzip": root / "gzip" / "a.jsonl.gz",
        "parquet": root / "parquet" / "a.parquet",
    }
    for path in cases.values():
        path.parent.mkdir(parents=True)
    cases["zstd"].write_bytes(bytes(zst))
    cases["gzip"].write_bytes(bytes.fromhex("1f8b08000000000000ff"))  # a header, then the cut
    cases["parquet"].write_bytes(b"PAR1 and then nothing that is Parquet")
    return cases


def contract_plan(root: Path, bad: dict[str, Path], **overrides: Any):
    write_jsonl(root / "good" / "a.jsonl", texts(400, seed=1))
    sources = [{"name": "good", "format": "jsonl", "path": str(root / "good"), "weight": 2}]
    for name, path in bad.items():
        fmt = "parquet" if path.suffix == ".parquet" else "jsonl"
        sources.append(
            {"name": name, "format": fmt, "path": str(path.parent), "weight": 1, "epochs": 1}
        )
    return parse_plan(plan_dict(sources, on_error="skip", **overrides))


def test_a_source_whose_only_file_cannot_be_read_counts_it_in_skipped(tmp_path):
    bad = unreadable_files(tmp_path)
    plane = InlineDataPlane(contract_plan(tmp_path, bad, layout={"dp": 1}))
    plane.draw(30)
    stats = {s["name"]: s for s in plane.coord.view.stats()["sources"]}
    for name in bad:
        assert stats[name]["documents"] == 0
        assert stats[name]["skipped"] == 1, (name, stats[name])  # its one file, once
    assert stats["good"]["documents"] > 0 and stats["good"]["skipped"] == 0


def test_a_whole_epoch_without_records_fails_naming_what_was_skipped(tmp_path):
    bad = unreadable_files(tmp_path)
    plan = contract_plan(tmp_path, {"zstd": bad["zstd"]}, layout={"dp": 1})
    data = plan.to_dict()
    data["sources"][1].pop("epochs")
    with pytest.raises(Exception, match=r"source 'zstd': a whole epoch held no records \(1 bad"):
        InlineDataPlane(parse_plan(data)).draw(30)


def _table_skipped(dask_scheduler: Any) -> dict[str, int]:
    from omniload_dask.observe.dashboard import JobPage

    page = JobPage(dask_scheduler)
    page.update()
    return dict(zip(page.table.data["source"], page.table.data["skipped"], strict=True))


def test_skips_show_in_stats_the_metric_and_the_dashboard_on_a_cluster(tmp_path):
    bad = unreadable_files(tmp_path)
    parquet_with_a_corrupt_page(tmp_path / "books" / "a.parquet", checksums=True)
    bad["books"] = tmp_path / "books" / "a.parquet"
    plan = contract_plan(tmp_path, bad, layout={"dp": 1}, name="contract")
    want = {"zstd": 1, "gzip": 1, "parquet": 1, "books": GROUP, "good": 0}
    with Job.start(plan, workers=1, dashboard_address="127.0.0.1:0") as job:
        with job.feeder(rank=0, output="numpy", max_steps=40) as feeder:
            for _ in feeder:
                pass
        stats = {s["name"]: s["skipped"] for s in job.stats()["sources"]}
        base = (job.dashboard_link or "").rsplit("/", 1)[0]
        with urllib.request.urlopen(base + "/metrics", timeout=30) as reply:
            text = reply.read().decode()
        table = job.client.run_on_scheduler(_table_skipped)
    metric = {
        s.labels["source"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "omniload_source_records_skipped_total" and s.labels["job"] == "contract"
    }
    assert stats == want
    assert metric == want
    assert table == want


# ---------------------------------------------------------------------- first lines
def first_line_bad(root: Path, field: str = "text") -> Path:
    return write_jsonl(
        root / "a.jsonl", texts(50, seed=2), field=field, raw_lines={0: "{not json", 1: "[1, 2]"}
    )


def one_source(root: Path, on_error: str, epochs: int | None = 2):
    source = {"name": "web", "format": "jsonl", "path": str(root), "weight": 1}
    if epochs:
        source["epochs"] = epochs
    return parse_plan(plan_dict([source], on_error=on_error, layout={"dp": 1}))


def test_a_malformed_first_line_is_skipped_and_counted_like_any_other(tmp_path):
    first_line_bad(tmp_path)
    plane = InlineDataPlane(one_source(tmp_path, "skip"))
    plane.draw(200)
    (web,) = plane.coord.view.stats()["sources"]
    assert web["documents"] == 2 * 48 and web["skipped"] == 2 * 2  # two epochs


def test_a_malformed_first_line_stops_a_job_under_raise_naming_the_record(tmp_path):
    first_line_bad(tmp_path)
    with pytest.raises(RecordError, match=r"a\.jsonl': record at offset 0: malformed JSON"):
        InlineDataPlane(one_source(tmp_path, "raise"))


def test_the_field_check_looks_at_the_first_parseable_record(tmp_path):
    first_line_bad(tmp_path, field="body")
    with pytest.raises(SourceError, match=r"first record has no field 'text' \(has: body, n\)"):
        InlineDataPlane(one_source(tmp_path, "skip"))


def validate(tmp_path: Path, plan: Any, capsys: Any) -> tuple[int, str]:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan.to_dict()))
    code = main(["validate", str(path)])
    return code, capsys.readouterr().err


def test_validate_reports_bad_first_lines_a_wrong_field_and_page_checksums(tmp_path, capsys):
    first_line_bad(tmp_path / "web")
    code, err = validate(tmp_path, one_source(tmp_path / "web", "skip"), capsys)
    assert code == 0
    assert "sources[0] (web): 2 of the first 50 records of" in err
    assert "offset 0: malformed JSON" in err
    code, err = validate(tmp_path, one_source(tmp_path / "web", "raise"), capsys)
    assert code == 2 and "record at offset 0: malformed JSON" in err
    first_line_bad(tmp_path / "body", field="body")
    code, err = validate(tmp_path, one_source(tmp_path / "body", "skip"), capsys)
    assert code == 2 and "sources[0].text:" in err and "no field 'text' (has: body, n)" in err
    parquet_with_a_corrupt_page(tmp_path / "sum" / "a.parquet", checksums=True)
    parquet_with_a_corrupt_page(tmp_path / "plain" / "a.parquet", checksums=False)
    sources = [
        {"name": n, "format": "parquet", "path": str(tmp_path / n), "weight": 1}
        for n in ("sum", "plain")
    ]
    code, err = validate(tmp_path, parse_plan(plan_dict(sources, on_error="skip")), capsys)
    assert code == 0
    assert "sources[0] (sum): page checksums in all its 1 files" in err
    assert "sources[1] (plain): page checksums in none of its 1 files" in err

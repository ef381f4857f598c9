"""Files that cannot be read (truncated gzip, truncated or corrupt Parquet) under both policies:
``on_error: raise`` stops the job naming source and file; ``skip`` skips what cannot be read,
counts it per source with the reason and goes on, the same on a cluster as in the reference."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from omniload_dask import Job, OmniloadError
from omniload_dask.plan import parse_plan
from omniload_dask.testing import InlineDataPlane, assert_batches_equal

from .datagen import plan_dict, texts, write_parquet

STEPS = 6


@pytest.fixture(scope="module")
def bad_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bad-files")
    raw = "".join(json.dumps({"text": t}) + "\n" for t in texts(1500, seed=1, mean_words=12))
    blob = gzip.compress(raw.encode(), mtime=0)
    (root / "web").mkdir()
    (root / "web" / "a.jsonl.gz").write_bytes(blob)
    (root / "web" / "b.jsonl.gz").write_bytes(blob[: len(blob) // 2])  # truncated
    docs = texts(64, seed=2, mean_words=40)
    write_parquet(root / "books" / "a.parquet", docs)
    write_parquet(root / "books" / "b.parquet", docs)
    cut = (root / "books" / "b.parquet").read_bytes()
    (root / "books" / "b.parquet").write_bytes(cut[: len(cut) // 2])  # its footer is gone
    write_parquet(root / "books" / "c.parquet", docs)
    page = pq.ParquetFile(root / "books" / "c.parquet").metadata.row_group(1).column(0)
    data = bytearray((root / "books" / "c.parquet").read_bytes())
    for k in range(page.data_page_offset + 8, page.data_page_offset + 60):
        data[k] ^= 0x55  # a corrupt page in row group 1
    (root / "books" / "c.parquet").write_bytes(bytes(data))
    return root


def bad_plan(root: Path, on_error: str, **overrides: object):
    sources = [
        {"name": "web", "format": "jsonl", "path": str(root / "web"), "unit_bytes": 16384},
        {"name": "books", "format": "parquet", "path": str(root / "books")},
    ]
    batch = {"seq_len": 4096, "micro_batches": 2, "global_tokens": 8192}
    return parse_plan(plan_dict(sources, on_error=on_error, name="bad", batch=batch, **overrides))


@pytest.mark.parametrize("source", ["web", "books"])
def test_on_error_raise_stops_naming_the_source_and_the_file(bad_root, source):
    plan = bad_plan(bad_root, "raise", layout={"dp": 1})
    only = [s for s in plan.to_dict()["sources"] if s["name"] == source]
    plan = parse_plan({**plan.to_dict(), "sources": only})
    with pytest.raises(OmniloadError, match=rf"source '{source}': file '.*b\.") as err:
        InlineDataPlane(plan).draw(60)
    message = str(err.value)
    if source == "web":
        assert "breaks off" in message and "on_error: skip" in message
    else:
        assert "is not a readable Parquet file" in message  # at start-up


def test_on_error_skip_skips_what_cannot_be_read_counts_it_and_goes_on(bad_root):
    plan = bad_plan(bad_root, "skip", layout={"dp": 1})
    plane = InlineDataPlane(plan)
    plane.draw(60)
    stats = {s["name"]: s for s in plane.coord.view.stats()["sources"]}
    assert stats["web"]["documents"] > 0 and stats["books"]["documents"] > 0
    assert stats["books"]["epoch"] >= 1  # every books unit was read, the bad ones too
    assert stats["web"]["skipped"] >= 1
    assert stats["books"]["skipped"] >= 1 + 16  # b.parquet as one, c's row group 1 per row


def test_skipped_files_on_a_cluster_give_the_reference_batches_and_the_reasons(bad_root):
    plan = bad_plan(bad_root, "skip", layout={"dp": 1})
    plane = InlineDataPlane(plan)
    ref = [mb for _, bs in plane.stream(STEPS) for mb in bs[0].micro_batches]
    with Job.start(plan, workers=1, dashboard_address=None) as job:
        with job.feeder(rank=0, max_steps=STEPS, output="numpy") as f:
            got = [{k: v for k, v in mb.items() if k != "doc_source_name"} for mb in f]
        ready = job.stats()
    assert len(got) == len(ref)
    for a, b in zip(ref, got, strict=True):
        assert_batches_equal(a, b)
    sources = {s["name"]: s for s in ready["sources"]}
    reasons = " | ".join(sources["books"]["bad_examples"] + sources["web"]["bad_examples"])
    seen = [w for w in ("not readable Parquet", "cannot be decoded", "breaks off") if w in reasons]
    assert seen, reasons  # the reads that met bad bytes say so, naming the file
    assert "source 'books': file '" in reasons or "source 'web': file '" in reasons

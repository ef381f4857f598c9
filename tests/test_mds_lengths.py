"""MDS token counts from the shard headers: given up front only where they are exact."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from omniload_dask.core.events import StepsRequested
from omniload_dask.plan import parse_plan, parse_source
from omniload_dask.sources.registry import discover_source, read_unit_records
from omniload_dask.testing import InlineDataPlane

from .datagen import plan_dict
from .tokendata import VOCAB, documents, import_streaming


def write(folder: Path, columns: dict[str, str], rows: list[dict], **kw: object) -> str:
    streaming = import_streaming()
    with streaming.MDSWriter(out=str(folder), columns=columns, size_limit=2048, **kw) as writer:
        for row in rows:
            writer.write(row)
    return str(folder)


def source(path: str, **kw: object) -> dict:
    return {"name": "m", "format": "mds", "path": path, "tokens": "tokens", "vocabulary": VOCAB,
            **kw}  # fmt: skip


def check_known_lengths_are_the_reads(src: dict) -> None:
    sp = parse_source(src)
    cat = discover_source(sp)
    assert cat.lengths is not None
    for u in range(cat.num_units):
        for count in (1, 2, 5):
            known = cat.known_lengths(u, count)
            assert known is not None
            for lengths, pieces in zip(known, cat.reads(u, count), strict=True):
                got = [read_unit_records(sp, cat.files[f], a, b).lengths for f, a, b in pieces]
                assert np.concatenate(got).tolist() == lengths.tolist()


def test_raw_id_bytes_beside_fixed_columns_are_counted_from_the_header(tmp_path):
    docs = documents(120, seed=21)
    rows = [{"tokens": d.astype(np.uint16).tobytes(), "n": i} for i, d in enumerate(docs)]
    path = write(tmp_path / "b", {"tokens": "bytes", "n": "int"}, rows)
    src = source(path, dtype="uint16")
    check_known_lengths_are_the_reads(src)
    check_known_lengths_are_the_reads({**src, "unit_records": 7})
    plan = parse_plan(plan_dict([src]))
    run = InlineDataPlane(plan, build=False)  # (building would read the units it names)
    run.coord.handle(StepsRequested(0, 0, 1))
    run.coord.handle(StepsRequested(1, 0, 1))
    run._run(run.coord.advance())
    run._run(run.coord.advance())
    assert run.coord.view.next_step >= 1 and run.reads == 0  # drawn from the headers alone


def test_a_fixed_shape_column_needs_no_read_at_all(tmp_path):
    rng = np.random.default_rng(4)
    rows = [{"tokens": rng.integers(0, 256, (2, 8)).astype(np.uint16)} for _ in range(50)]
    path = write(tmp_path / "f", {"tokens": "ndarray:uint16:2,8"}, rows, compression="zstd")
    check_known_lengths_are_the_reads(source(path))
    assert discover_source(parse_source(source(path))).lengths.tolist() == [16] * 50


def test_counts_the_headers_do_not_tell_are_left_to_the_reads(tmp_path):
    docs = documents(40, seed=22)
    raw = [{"tokens": d.astype(np.uint16).tobytes()} for d in docs]
    cases = {
        # each sample holds its own dimensions: a 1-D and a 2-D array can be the same size
        "dynamic": (
            {"tokens": "ndarray:uint16"},
            [{"tokens": d.astype(np.uint16)} for d in docs],
            {},
        ),
        "compressed": ({"tokens": "bytes"}, raw, {"compression": "zstd"}),
        "two variable columns": (
            {"tokens": "bytes", "text": "str"},
            [{**r, "text": "x" * i} for i, r in enumerate(raw)],
            {},
        ),
    }
    for name, (columns, rows, kw) in cases.items():
        path = write(tmp_path / name.replace(" ", "-"), columns, rows, **kw)
        assert discover_source(parse_source(source(path, dtype="uint16"))).lengths is None, name
    # ids of 4 bytes in sizes of 2: no counts (the reads meet the sizes as before)
    odd = write(tmp_path / "odd", {"tokens": "bytes"}, raw[:3])
    sp = parse_source(source(odd, dtype="uint32"))
    assert any(len(d) % 2 for d in docs[:3]) and discover_source(sp).lengths is None

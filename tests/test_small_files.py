"""Small files are read several to a unit: the units, their reads and parts, the stream."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from omniload_dask import Job
from omniload_dask.cluster import tasks
from omniload_dask.core.reads import ReadAhead
from omniload_dask.plan import parse_plan
from omniload_dask.sources import Catalog, decode_sample_id, registry
from omniload_dask.sources.catalog import MAX_FILES_PER_UNIT, merge_small_files
from omniload_dask.sources.registry import discover_source, read_unit_records
from omniload_dask.testing import InlineDataPlane, check_resume_equivalence

from .conftest import record_reads
from .datagen import plan_dict, texts, write_jsonl, write_parquet
from .test_cluster import assert_same, collect, reference
from .test_stream_contract import delivered_step, record_tokens

MIB = 1 << 20


def _rows(files: list[int], counts: list[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    table = np.asarray([(f, 0, 10) for f in files], dtype=np.int64).reshape(-1, 3)
    rows = np.asarray(counts if counts is not None else [-1] * len(files), dtype=np.int64)
    return table, rows


def test_whole_small_files_merge_into_units_up_to_unit_bytes():
    table, rows = _rows([0, 1, 2, 3])
    assert merge_small_files(table, rows, [MIB, MIB, 3 * MIB, MIB], 4 * MIB).tolist() == [
        0, 2, 4,
    ]  # fmt: skip
    # a file of several units is read as before, and breaks the runs around it
    table, rows = _rows([0, 1, 1, 2, 3])
    assert merge_small_files(table, rows, [10, 10, 10, 10], MIB).tolist() == [0, 1, 2, 3, 5]
    # with unit_records, the records count too (and unknown counts do not merge)
    table, rows = _rows([0, 1, 2], [10, 10, 10])
    assert merge_small_files(table, rows, [1, 1, 1], MIB, unit_records=20).tolist() == [0, 2, 3]
    table, rows = _rows([0, 1, 2])
    assert merge_small_files(table, rows, [1, 1, 1], MIB, unit_records=20) is None
    assert merge_small_files(table, rows, [1, 1, 1], MIB).tolist() == [0, 3]
    # at most MAX_FILES_PER_UNIT files a unit; nothing to merge: None
    table, rows = _rows(list(range(100)))
    groups = merge_small_files(table, rows, [1] * 100, MIB)
    assert np.diff(groups).tolist() == [MAX_FILES_PER_UNIT, 100 - MAX_FILES_PER_UNIT]
    table, rows = _rows([0, 1])
    assert merge_small_files(table, rows, [MIB, MIB], MIB) is None
    # a file whose size the storage did not report (0) is read alone
    table, rows = _rows([0, 1, 2, 3])
    assert merge_small_files(table, rows, [5, 0, 5, 5], MIB).tolist() == [0, 1, 2, 4]


def _write(root: Path) -> None:
    for i in range(9):
        write_jsonl(root / "j" / f"{i:02d}.jsonl", texts(12, seed=i, prefix=f"j{i}-"))
    for i in range(5):
        write_parquet(
            root / "p" / f"{i:02d}.parquet", texts(6, seed=20 + i, mean_words=80, prefix=f"p{i}-")
        )


@pytest.fixture
def small_files(tmp_path: Path) -> Path:
    _write(tmp_path)
    return tmp_path


def _plan(root: Path, **overrides: object):
    sources = _write_specs(root, **overrides.pop("source_extra", {}))  # type: ignore[arg-type]
    return parse_plan(
        plan_dict(
            sources,
            batch={"seq_len": 256, "micro_batches": 1, "global_tokens": None},
            layout={"dp": 2},
            **overrides,
        )
    )


def _write_specs(root: Path, **extra: object) -> list[dict]:
    specs = [
        {"name": "j", "format": "jsonl", "path": str(root / "j"), "weight": 2,
         "unit_bytes": 6000},
        {"name": "p", "format": "parquet", "path": str(root / "p"), "weight": 1,
         "unit_bytes": 8000},
    ]  # fmt: skip
    return [{**s, **extra} for s in specs]


def test_a_unit_of_small_files_holds_their_records_in_order_under_their_own_ids(small_files):
    plan = _plan(small_files)
    for i, spec in enumerate(plan.sources):
        cat = discover_source(spec)
        assert cat.groups is not None and 1 < cat.num_units < len(cat.files)
        files_of = [len(cat.reads(u, 1)[0]) for u in range(cat.num_units)]
        assert sum(files_of) == len(cat.files)
        assert all(cat.max_portions(u) == n for u, n in enumerate(files_of) if n > 1)
        texts_in_order: list[str] = []
        for u in range(cat.num_units):
            (f, lo, hi), *rest = cat.reads(u, 1)[0]
            more = tuple((g, cat.files[g], a, b) for g, a, b in rest)
            assert [p[0] for p in cat.reads(u, 1)[0]] == list(range(f, f + len(rest) + 1))
            shard = tasks.read_unit(spec, i, plan.tokenizer, "raise", f, cat.files[f], lo, hi,
                                    more=more)  # fmt: skip
            # each record under its own file and offset
            for r, sid in enumerate(shard.sample_ids.tolist()):
                source, file, offset = decode_sample_id(sid)
                assert source == i
                one = read_unit_records(spec, cat.files[file], *cat.units[file].tolist()[1:])
                at = one.offsets.tolist().index(offset)
                texts_in_order.append(one.texts[at])
                want = tasks.read_unit(spec, i, plan.tokenizer, "raise", file, cat.files[file],
                                       *cat.units[file].tolist()[1:])  # fmt: skip
                assert shard.tokens[shard.offsets[r] : shard.offsets[r + 1]].tolist() == (
                    want.tokens[want.offsets[at] : want.offsets[at + 1]].tolist()
                )
        every = [t for f in range(len(cat.files)) for t in
                 read_unit_records(spec, cat.files[f], *cat.units[f].tolist()[1:]).texts]  # fmt: skip
        assert texts_in_order == every  # all of them, once, in file order


def test_merge_bytes_caps_the_files_a_unit_holds_and_zero_reads_each_file_alone(small_files):
    """Small files merge up to the smaller of unit_bytes and merge_bytes (1 MiB by default)."""
    file_bytes = sorted(p.stat().st_size for p in (small_files / "j").iterdir())
    by_cap = {}
    two = file_bytes[-1] * 2  # any two files fit, no three
    assert file_bytes[0] * 3 > two
    for extra in ({"unit_bytes": MIB}, {"unit_bytes": MIB, "merge_bytes": two},
                  {"unit_bytes": MIB, "merge_bytes": 0}):  # fmt: skip
        spec = _plan(small_files, source_extra=extra).sources[0]
        cat = discover_source(spec)
        cap = min(spec.unit_bytes, spec.merge_bytes)
        by_cap[cap] = cat.num_units
        if cap == 0:
            assert cat.groups is None and cat.num_units == len(cat.files)
            continue
        sizes = [sum((small_files / "j" / Path(cat.files[f]).name).stat().st_size
                     for f, _, _ in cat.reads(u, 1)[0])
                 for u in range(cat.num_units)]  # fmt: skip
        assert all(size <= cap for size in sizes if size > file_bytes[-1])  # merged: in the cap
    assert by_cap[MIB] == 1 and by_cap[two] == 5 and by_cap[0] == 9  # 9 files
    assert _plan(small_files, source_extra={"unit_bytes": 4 * MIB}).sources[0].merge_bytes == MIB


def test_a_unit_of_small_files_splits_between_files_into_runs_of_about_equal_size(small_files):
    cat = discover_source(_plan(small_files).sources[0])
    for u in range(cat.num_units):
        whole = cat.reads(u, 1)[0]
        for count in range(1, cat.max_portions(u) + 3):
            reads = cat.reads(u, count)
            assert len(reads) == min(count, len(whole)) and all(reads)
            assert [p for r in reads for p in r] == whole
            sizes = cat.read_sizes(u, count)
            assert len(sizes) == len(reads) and sum(sizes) == cat.size(u)


def test_small_files_stream_every_record_once_an_epoch_in_parts_or_whole(small_files):
    def stream(slow: bool = False) -> list:
        plan = _plan(small_files, source_extra={"epochs": 1})
        # slow: reads that take 0.1 s a record, so that units are read in portions of 0.5 s
        timing = (lambda read, shard: 0.1 * max(len(shard), 1)) if slow else None
        plane = InlineDataPlane(plan, timing=timing)
        split = record_reads(plane)
        out, step = [], 0
        while plane.coord.view.end_step is None or step < plane.coord.view.end_step:
            out += delivered_step(plane, step)
            step += 1
        if not slow:
            assert any(r.more for r in split)  # reads of several files
        else:  # units of several files, read in portions
            assert any("-p" in r.key for r in split if r.source == 0)
        return out

    whole = stream()
    full = record_tokens(_plan(small_files, source_extra={"epochs": 1}))
    assert {sid for _, sid, _, _ in whole} == set(full)
    for sid in full:
        got = sorted((off, tok) for _, s, off, tok in whole if s == sid)
        assert np.concatenate([tok for _, tok in got]).tolist() == full[sid].tolist()
    portions = stream(slow=True)
    assert len(portions) == len(whole)
    for a, b in zip(portions, whole, strict=True):
        assert a[:3] == b[:3] and a[3].tolist() == b[3].tolist()


def test_a_units_reads_are_worked_out_once_however_many_steps_draw_from_it(
    small_files, monkeypatch
):
    """Every step names the reads its documents come from; a merged unit's pieces are worked
    out from the catalog once, when it is submitted, not again for each step."""
    calls: dict[str, int] = {"catalog": 0, "named": 0}

    def counting(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any) -> Any:
            calls[name] += 1
            return method(*args)

        return counted

    monkeypatch.setattr(Catalog, "reads", counting("catalog", Catalog.reads))
    monkeypatch.setattr(ReadAhead, "read_spec", counting("named", ReadAhead.read_spec))
    plane = InlineDataPlane(_plan(small_files, source_extra={"epochs": 1}))
    submitted = record_reads(plane)
    step = 0
    while plane.coord.view.end_step is None or step < plane.coord.view.end_step:
        delivered_step(plane, step)
        step += 1
    assert any(r.more for r in submitted)  # units of several files
    assert calls["catalog"] == len(submitted)  # once a unit (none is read in portions here)
    assert calls["named"] > 2 * len(submitted)  # (steps named them far more often)


def test_small_files_on_a_cluster_stream_as_the_reference(small_files):
    plan = _plan(small_files)
    ref = reference(plan)
    with Job.start(plan, workers=2, dashboard_address=None) as job:
        got = collect(job)
    assert_same(ref, got)


def test_a_checkpoint_saved_before_files_were_merged_resumes_reading_one_file_a_unit(
    small_files, tmp_path, monkeypatch
):
    # The uninterrupted run reads one file a unit, as before merging (its checkpoint holds
    # that catalog's fingerprint); the restored runs discover merged units, and resume with
    # one file a unit instead of refusing the checkpoint.
    old = {"on": True}
    merge = registry.merge_small_files
    monkeypatch.setattr(
        registry, "merge_small_files", lambda *a, **k: None if old["on"] else merge(*a, **k)
    )

    def then_merge(run: InlineDataPlane) -> None:
        assert all(s.catalog.groups is None for s in run.coord.view.streams)
        old["on"] = False

    plan = _plan(small_files, checkpoint={"url": str(tmp_path / "ckpt"), "flush_seconds": 0.05})
    assert check_resume_equivalence(plan, 14, [4, 9], changes=then_merge) == 15
    assert discover_source(plan.sources[0]).groups is not None  # a new run merges

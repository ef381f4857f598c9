"""Token sources: files written by the real tools, read token for token, through the data plane.

Every test compares what omniload-dask delivers with what the writing tool reads back itself
(megatron-core's IndexedDataset, ``datasets.load_from_disk``, ``streaming``'s reader) or wrote.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from omniload_dask import SourceError
from omniload_dask.core.events import StepsRequested
from omniload_dask.errors import JobError, PlanError
from omniload_dask.plan import parse_plan, parse_source
from omniload_dask.sources import decode_sample_id
from omniload_dask.sources.registry import discover_source, read_unit_records
from omniload_dask.testing import InlineDataPlane

from .datagen import plan_dict
from .tokendata import (
    VOCAB,
    arrow_documents,
    documents,
    mds_documents,
    megatron_documents,
    write_arrow,
    write_flat,
    write_mds,
    write_megatron,
    write_token_parquet,
)


def read_all(sp) -> tuple[list[np.ndarray], list[int], list]:  # type: ignore[no-untyped-def]
    """Every record of every unit, in catalog order: token arrays, offsets, bad records."""
    cat = discover_source(sp)
    docs, offsets, bad = [], [], []
    for f, lo, hi in cat.units.tolist():
        rec = read_unit_records(sp, cat.files[f], lo, hi)
        assert rec.tokens is not None and rec.tokens.dtype == np.uint32
        ends = np.cumsum(rec.lengths)
        docs += np.split(rec.tokens, ends[:-1]) if len(ends) else []
        offsets += rec.offsets.tolist()
        bad += rec.bad
    return docs, offsets, bad


def same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("dtype", [np.uint8, np.int16, np.uint16, np.int32, np.int64, np.float32])
def test_megatron_every_dtype_reads_what_megatron_core_reads(tmp_path, dtype):
    docs = documents(50, seed=1)
    idx = write_megatron(tmp_path / "corpus_text_document", docs, dtype)
    prefix = str(idx)[: -len(".idx")]
    sp = parse_source({"name": "m", "format": "megatron", "path": prefix, "vocabulary": VOCAB,
                       "unit_bytes": 1024})  # fmt: skip
    got, offsets, bad = read_all(sp)
    assert bad == []
    assert same(got, megatron_documents(Path(prefix)))
    assert same(got, docs)  # documents of two sequences come back whole
    assert offsets == list(range(50))
    cat = discover_source(sp)
    assert cat.lengths is not None and cat.lengths.tolist() == [len(d) for d in docs]
    from omniload_dask.preprocess.tokens import describe_token_source

    info = describe_token_source(sp)
    assert info["documents"] == 50 and info["tokens"] == sum(len(d) for d in docs)
    assert info["dtype"] == np.dtype(dtype).name and info["vocabulary"] == VOCAB


def test_megatron_index_that_does_not_match_its_bin_names_the_file(tmp_path):
    idx = write_megatron(tmp_path / "c", documents(20, seed=2))
    sp = parse_source({"name": "m", "format": "megatron", "path": str(idx), "vocabulary": VOCAB})
    binf = tmp_path / "c.bin"
    binf.write_bytes(binf.read_bytes()[:-2])
    with pytest.raises(SourceError, match=r"c\.bin.*the index says"):
        discover_source(sp)
    raw = bytearray(idx.read_bytes())
    raw[9] = 2  # version
    idx.write_bytes(bytes(raw))
    with pytest.raises(SourceError, match="index version 2"):
        discover_source(sp)
    raw[9], raw[17] = 1, 9  # dtype code
    idx.write_bytes(bytes(raw))
    with pytest.raises(SourceError, match="dtype code 9"):
        discover_source(sp)
    raw[17] = 8
    idx.write_bytes(bytes(raw[:-8]))  # counts no longer match its size
    with pytest.raises(SourceError, match="truncated"):
        discover_source(sp)
    idx.write_bytes(b"not an index")
    with pytest.raises(SourceError, match="MMIDIDX"):
        discover_source(sp)


def test_arrow_save_to_disk_token_and_text_columns(tmp_path):
    docs = documents(90, seed=3)
    write_arrow(tmp_path / "ds", docs)
    ids, texts = arrow_documents(tmp_path / "ds")
    sp = parse_source({"name": "a", "format": "arrow", "path": str(tmp_path / "ds"),
                       "tokens": "input_ids", "vocabulary": VOCAB, "unit_records": 16})  # fmt: skip
    got, _, bad = read_all(sp)
    assert bad == [] and same(got, ids) and same(got, docs)
    assert discover_source(sp).lengths.tolist() == [len(d) for d in docs]
    text_spec = parse_source({"name": "a", "format": "arrow", "path": str(tmp_path / "ds")})
    cat = discover_source(text_spec)
    assert cat.lengths is None
    out = []
    for f, lo, hi in cat.units.tolist():
        out += read_unit_records(text_spec, cat.files[f], lo, hi).texts
    assert out == texts


def test_arrow_folder_without_the_column_or_with_a_non_integer_one(tmp_path):
    write_arrow(tmp_path / "ds", documents(10, seed=4))
    base = {"name": "a", "format": "arrow", "path": str(tmp_path / "ds"), "vocabulary": VOCAB}
    with pytest.raises(SourceError, match=r"has no column 'ids'.*input_ids"):
        discover_source(parse_source({**base, "tokens": "ids"}))
    with pytest.raises(SourceError, match=r"column 'text' has type string, expected token ids"):
        discover_source(parse_source({**base, "tokens": "text"}))


def test_parquet_token_column_written_by_datasets(tmp_path):
    docs = documents(70, seed=5)
    write_token_parquet(tmp_path / "p" / "a.parquet", docs)
    sp = parse_source({"name": "p", "format": "parquet", "path": str(tmp_path / "p"),
                       "tokens": "input_ids", "vocabulary": VOCAB})  # fmt: skip
    got, offsets, bad = read_all(sp)
    assert bad == [] and same(got, docs) and offsets == list(range(70))


@pytest.mark.parametrize(
    "encoding,kw",
    [("ndarray:uint16", {}), ("ndarray", {}), ("ndarray:int32", {"compression": "zstd"})],
)
def test_mds_token_column_reads_what_streaming_reads(tmp_path, encoding, kw):
    docs = documents(60, seed=6)
    write_mds(tmp_path / "mds", docs, encoding, **kw)
    sp = parse_source({"name": "m", "format": "mds", "path": str(tmp_path / "mds"),
                       "tokens": "tokens", "vocabulary": VOCAB})  # fmt: skip
    got, offsets, bad = read_all(sp)
    assert bad == [] and same(got, mds_documents(tmp_path / "mds")) and same(got, docs)
    assert offsets == list(range(60))


def test_mds_text_column_and_a_missing_shard(tmp_path):
    write_mds(tmp_path / "mds", documents(40, seed=7))
    sp = parse_source({"name": "m", "format": "mds", "path": str(tmp_path / "mds")})
    cat = discover_source(sp)
    texts = []
    for f, lo, hi in cat.units.tolist():
        texts += read_unit_records(sp, cat.files[f], lo, hi).texts
    assert texts == [f"sample {i} " + "y" * (i % 11) for i in range(40)]
    index = json.loads((tmp_path / "mds" / "index.json").read_text())
    missing = index["shards"][1]["raw_data"]["basename"]
    (tmp_path / "mds" / missing).unlink()
    with pytest.raises(SourceError, match=rf"shard 1 is '{missing}', which is not in"):
        discover_source(sp)


@pytest.mark.parametrize("name,dtype", [("a.bin", "uint16"), ("b.npy", "uint32")])
def test_flat_arrays_cut_at_the_end_of_document_id_in_any_parts(tmp_path, name, dtype):
    docs = documents(80, seed=8)
    write_flat(tmp_path / "f" / name, docs, eod=257, dtype=dtype)
    sp = parse_source({"name": "f", "format": "flat", "path": str(tmp_path / "f"),
                       "dtype": dtype, "vocabulary": VOCAB, "unit_bytes": 1024})  # fmt: skip
    want = [np.append(d, 257) for d in docs]
    got, offsets, bad = read_all(sp)
    assert bad == [] and same(got, want)
    starts = np.concatenate([[0], np.cumsum([len(w) for w in want])[:-1]])
    assert offsets == starts.tolist()
    cat = discover_source(sp)
    f, lo, hi = cat.units[1].tolist()
    whole = read_unit_records(sp, cat.files[f], lo, hi)
    pieces = [read_unit_records(sp, cat.files[f], a, b) for a, b in cat.portions(1, 7)]
    assert np.array_equal(np.concatenate([p.tokens for p in pieces]), whole.tokens)


def test_a_token_id_outside_the_vocabulary_is_a_bad_record_naming_it(tmp_path):
    docs = documents(12, seed=9)
    docs[4] = np.array([1, 2, 300, 4])
    idx = write_megatron(tmp_path / "c", docs)
    sp = parse_source({"name": "m", "format": "megatron", "path": str(idx), "vocabulary": VOCAB})
    got, offsets, bad = read_all(sp)
    assert 4 not in offsets and len(got) == 11
    assert bad == [(4, "token id 300 at position 2 is outside the vocabulary of 258 ids "
                       "(sources[].vocabulary.size)")]  # fmt: skip


def test_token_source_plan_fields_are_checked():
    with pytest.raises(PlanError, match=r"sources\[0\]\.vocabulary: is required"):
        parse_plan(plan_dict([{"name": "m", "format": "megatron", "path": "/x/c"}]))
    with pytest.raises(PlanError, match=r"sources\[0\]\.eod: is required"):
        parse_plan(plan_dict([{"name": "f", "format": "flat", "path": "/x/a.bin",
                               "vocabulary": {"size": 258}}]))  # fmt: skip
    with pytest.raises(PlanError, match=r"sources\[0\]\.tokens: names a token-id column"):
        parse_plan(plan_dict([{"name": "j", "format": "jsonl", "path": "/x/a.jsonl",
                               "tokens": "ids", "vocabulary": VOCAB}]))  # fmt: skip
    with pytest.raises(PlanError, match=r"sources\[0\]\.transform: must name a function"):
        parse_plan(plan_dict([{"name": "j", "format": "jsonl", "path": "/x/a.jsonl",
                               "transform": "not a function"}]))  # fmt: skip
    plan = parse_plan(plan_dict([{"name": "m", "format": "megatron", "path": "/x/c.bin",
                                  "vocabulary": VOCAB}]))  # fmt: skip
    assert plan.sources[0].paths == ("/x/c.idx",)
    assert parse_plan(plan.to_dict()) == plan


def four_sources(root: Path) -> list[dict]:
    """A megatron, an arrow, an mds and a flat source of the same kind of documents."""
    write_megatron(root / "m" / "c", documents(120, seed=11))
    write_arrow(root / "a", documents(100, seed=12))
    write_mds(root / "s", documents(90, seed=13))
    write_flat(root / "f" / "a.bin", documents(80, seed=14), eod=257)
    return [
        {"name": "meg", "format": "megatron", "path": str(root / "m" / "c"),
         "vocabulary": VOCAB, "unit_bytes": 2048, "epochs": 1, "weight": 2},
        {"name": "hf", "format": "arrow", "path": str(root / "a"), "tokens": "input_ids",
         "vocabulary": VOCAB, "unit_records": 25, "epochs": 1},
        {"name": "mos", "format": "mds", "path": str(root / "s"), "tokens": "tokens",
         "vocabulary": VOCAB, "epochs": 1},
        {"name": "nano", "format": "flat", "path": str(root / "f"), "eod": 257,
         "vocabulary": VOCAB, "unit_bytes": 2048, "epochs": 1},
    ]  # fmt: skip


def originals(root: Path) -> dict[tuple[int, int, int], np.ndarray]:
    """(source, file, offset) -> the document as its tool wrote it."""
    out = {}
    for d, doc in enumerate(megatron_documents(root / "m" / "c")):
        out[(0, 0, d)] = doc
    ids, _ = arrow_documents(root / "a")
    files = sorted((root / "a").glob("*.arrow"))
    row = 0
    import pyarrow as pa

    for f, path in enumerate(files):
        n = pa.ipc.open_stream(pa.OSFile(str(path))).read_all().num_rows
        for r in range(n):
            out[(1, f, r)] = np.asarray(ids[row + r])
        row += n
    for s, doc in enumerate(mds_documents(root / "s")):
        out[(2, 0, s)] = doc
    at = 0
    for doc in documents(80, seed=14):
        out[(3, 0, at)] = np.append(doc, 257)
        at += len(doc) + 1
    return out


def test_one_epoch_of_four_token_formats_exactly_once_token_for_token(tmp_path):
    # documents are never cut (truncate: none is longer than seq_len), so each arrives whole
    batch = {"seq_len": 256, "micro_batches": 2, "long_documents": "truncate"}
    plan = parse_plan(plan_dict(four_sources(tmp_path), layout={"dp": 2}, batch=batch))
    want = originals(tmp_path)
    run = InlineDataPlane(plan, shuffle_reports=5)
    # sources with an index plan before any read reports: the first step is drawn at once
    seen: dict[int, list[np.ndarray]] = {}
    for t, batches in run.stream(200):
        for batch in batches.values():
            for mb in batch.micro_batches:
                cu = np.asarray(mb["cu_seqlens"])
                ids = np.asarray(mb["input_ids"])
                for k, doc_id in enumerate(np.asarray(mb["doc_id"]).tolist()):
                    seen.setdefault(doc_id, []).append(ids[cu[k] : cu[k + 1]])
        if run.coord.view.end_step is not None and t + 1 >= run.coord.view.end_step:
            break  # (every source has served its one epoch)
    assert all(len(p) == 1 for p in seen.values())  # exactly once
    got = {decode_sample_id(i): p[0] for i, p in seen.items()}
    assert set(got) == set(want)
    assert all(np.array_equal(got[k], want[k]) for k in want)


def test_index_lengths_let_the_data_plane_draw_before_any_read_reports(tmp_path):
    write_megatron(tmp_path / "m" / "c", documents(200, seed=15))
    src = {"name": "meg", "format": "megatron", "path": str(tmp_path / "m" / "c"),
           "vocabulary": VOCAB, "unit_bytes": 1024}  # fmt: skip
    plan = parse_plan(plan_dict([src]))
    run = InlineDataPlane(plan, build=False)  # (building would read the units it names)
    run.coord.handle(StepsRequested(0, 0, 1))
    run.coord.handle(StepsRequested(1, 0, 1))
    run._run(run.coord.advance())  # submits the first reads
    run._run(run.coord.advance())
    assert run.coord.view.next_step >= 1 and run.reads == 0  # drawn and built from the index alone
    skip = parse_plan(plan_dict([src], on_error="skip"))
    assert (
        InlineDataPlane(skip).coord.components.sources.streams[0].catalog.lengths is None
    )  # reads decide


def test_plan_vocabulary_must_match_the_tokenizer(tmp_path):
    from omniload_dask.preprocess.tokens import check_vocabularies

    write_megatron(tmp_path / "c", documents(5, seed=16))
    plan = parse_plan(plan_dict([{"name": "m", "format": "megatron", "path": str(tmp_path / "c"),
                                  "vocabulary": {"size": 50257, "eos_id": 50256}}]))  # fmt: skip
    info = {"vocab_size": 258, "bos_id": 256, "eos_id": 257}
    with pytest.raises(PlanError, match=r"sources\[0\]\.vocabulary\.size: 50257.*258"):
        check_vocabularies(plan, info)
    ok = parse_plan(plan_dict([{"name": "m", "format": "megatron", "path": str(tmp_path / "c"),
                                "vocabulary": VOCAB}]))  # fmt: skip
    check_vocabularies(ok, info)
    # on_error raise: an id past the plan's vocabulary fails the job, naming file and record
    with pytest.raises(JobError, match=r"d\.idx'?: record at offset 1: token id 999"):
        bad = documents(3, seed=1)
        bad[1] = np.array([999])
        write_megatron(tmp_path / "d", bad)
        InlineDataPlane(parse_plan(plan_dict([{"name": "m", "format": "megatron",
                                               "path": str(tmp_path / "d"), "vocabulary": VOCAB}]))
                        ).step(0)  # fmt: skip


def test_index_lengths_of_every_portion_of_a_unit_match_what_its_reads_give(tmp_path):
    docs = documents(300, seed=17)
    write_megatron(tmp_path / "m" / "c", docs[:200])
    write_megatron(tmp_path / "m" / "d", docs[200:])
    sp = parse_source({"name": "m", "format": "megatron", "path": str(tmp_path / "m"),
                       "vocabulary": VOCAB, "unit_bytes": 4096})  # fmt: skip
    cat = discover_source(sp)
    for u in range(cat.num_units):
        for count in (1, 2, 5):
            known = cat.known_lengths(u, count)
            reads = cat.reads(u, count)
            assert len(known) == len(reads)
            for lengths, pieces in zip(known, reads, strict=True):
                got = [read_unit_records(sp, cat.files[f], a, b).lengths for f, a, b in pieces]
                assert np.concatenate(got).tolist() == lengths.tolist()

"""Mask columns of token sources (``sources[].mask``): pre-tokenized SFT sets written by the real
tools (``datasets``' ``save_to_disk``, pyarrow Parquet, ``streaming``'s ``MDSWriter``) with a
``labels`` (-100 where the loss skips a token) or ``loss_mask`` column beside the ids. The
labels every path hands a trainer (whole documents, cut ones, cp slices, resume) equal those
computed from the written rows, and ``num_loss_tokens`` / ``global_loss_tokens`` count them."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from omniload_dask.batching.formats import IGNORE_INDEX
from omniload_dask.batching.labels import Holes
from omniload_dask.batching.wire import expand
from omniload_dask.core.events import StepsRequested
from omniload_dask.errors import JobError, PlanError, RecordError, SourceError
from omniload_dask.plan import TokenMaskSpec, parse_plan, parse_source
from omniload_dask.sources import decode_sample_id
from omniload_dask.sources.registry import discover_source, read_unit_records
from omniload_dask.testing import InlineDataPlane, check_resume_equivalence

from .datagen import plan_dict
from .tokendata import VOCAB, import_streaming

Rows = list[tuple[np.ndarray, np.ndarray]]  # (ids, labels with -100) per row, as written


def sft_rows(n: int, seed: int, longest: int = 90) -> Rows:
    """``n`` rows of 2..``longest`` ids below 256, each a prompt (labels -100) then a
    completion (labels = the ids, unshifted, as ``transformers`` takes them)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids = rng.integers(0, 256, int(rng.integers(2, longest + 1)))
        prompt = int(rng.integers(0, len(ids) - 1))  # (a target after the first token)
        labels = ids.copy()
        labels[:prompt] = IGNORE_INDEX
        out.append((ids, labels))
    return out


def write_arrow(folder: Path, rows: Rows) -> Path:
    """A ``save_to_disk`` folder of several files: ``input_ids``, ``labels``, ``loss_mask``."""
    import datasets

    ds = datasets.Dataset.from_dict(
        {
            "input_ids": [ids.tolist() for ids, _ in rows],
            "labels": [labels.tolist() for _, labels in rows],
            "loss_mask": [(labels != IGNORE_INDEX).astype(int).tolist() for _, labels in rows],
        }
    )
    ds.save_to_disk(str(folder), max_shard_size="4KB")
    return folder


def write_parquet(path: Path, rows: Rows, **columns: Any) -> Path:
    """A Parquet file by pyarrow: ``input_ids`` (int32 lists) and a boolean ``loss_mask``."""
    table = pa.table(
        {
            "input_ids": pa.array([ids.tolist() for ids, _ in rows], pa.list_(pa.int32())),
            "loss_mask": pa.array(
                [(labels != IGNORE_INDEX).tolist() for _, labels in rows], pa.list_(pa.bool_())
            ),
            **columns,
        }
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, row_group_size=16)
    return path


def write_mds(folder: Path, rows: Rows, labels: str = "ndarray:int32") -> Path:
    """An MDS dataset by ``MDSWriter``: ``input_ids`` (uint16) and ``labels``."""
    streaming = import_streaming()
    columns = {"input_ids": "ndarray:uint16", "labels": labels}
    with streaming.MDSWriter(out=str(folder), columns=columns, size_limit=2048) as writer:
        for ids, lab in rows:
            value: Any = lab.tolist() if labels == "json" else lab.astype(labels.split(":")[1])
            writer.write({"input_ids": ids.astype(np.uint16), "labels": value})
    return folder


def targets(rows: Rows) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(ids, labels != IGNORE_INDEX) for ids, labels in rows]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[Any, Any]]:
    """Three masked token sources and each record's ids and targets by (source, file, offset),
    from the rows as written (the files' order: what the tools wrote, read back by pyarrow)."""
    root = tmp_path_factory.mktemp("sft-tokens")
    arrow_rows, parquet_rows, mds_rows = sft_rows(90, 1), sft_rows(70, 2), sft_rows(60, 3)
    write_arrow(root / "arrow", arrow_rows)
    write_parquet(root / "pq" / "a.parquet", parquet_rows)
    write_mds(root / "mds", mds_rows)
    docs: dict[Any, Any] = {}
    files = sorted((root / "arrow").glob("*.arrow"))
    assert len(files) > 1  # (several files: records are numbered per file)
    at = 0
    for f, path in enumerate(files):
        with pa.ipc.open_stream(str(path)) as reader:
            count = reader.read_all().num_rows
        for r in range(count):
            docs[(0, f, r)] = targets(arrow_rows)[at + r]
        at += count
    assert at == len(arrow_rows)
    for r, doc in enumerate(targets(parquet_rows)):
        docs[(1, 0, r)] = doc
    for r, doc in enumerate(targets(mds_rows)):
        docs[(2, 0, r)] = doc
    return root, docs


def sources(root: Path) -> list[dict[str, Any]]:
    return [
        {"name": "arrow", "format": "arrow", "path": str(root / "arrow"), "weight": 2,
         "tokens": "input_ids", "mask": {"column": "labels", "kind": "labels"},
         "vocabulary": VOCAB},
        {"name": "pq", "format": "parquet", "path": str(root / "pq"), "weight": 1,
         "tokens": "input_ids", "mask": {"column": "loss_mask"}, "vocabulary": VOCAB},
        {"name": "mds", "format": "mds", "path": str(root / "mds"), "weight": 1,
         "tokens": "input_ids", "mask": {"column": "labels", "kind": "labels"},
         "vocabulary": VOCAB},
    ]  # fmt: skip


def masked_plan(root: Path, **overrides: Any) -> Any:
    return parse_plan(plan_dict(sources(root), **overrides))


def reference_labels(mb: dict[str, Any], docs: dict[Any, Any]) -> np.ndarray:
    """A micro-batch's labels from the written rows, piece by piece: the next token where it
    is a target and inside the piece, else -100."""
    labels = np.full(len(mb["input_ids"]), IGNORE_INDEX, dtype=np.int64)
    cu = np.asarray(mb["cu_seqlens"])
    starts = zip(mb["doc_id"].tolist(), mb["doc_offset"].tolist(), strict=True)
    for j, (sid, lo) in enumerate(starts):
        ids, target = docs[decode_sample_id(sid)]
        n = int(cu[j + 1] - cu[j])
        assert np.array_equal(mb["input_ids"][cu[j] : cu[j] + n], ids[lo : lo + n])
        for k in range(n - 1):
            if target[lo + k + 1]:
                labels[cu[j] + k] = ids[lo + k + 1]
    return labels


def test_each_format_reads_the_mask_the_tools_wrote(corpus: tuple[Path, dict[Any, Any]]) -> None:
    root, docs = corpus
    for s, raw in enumerate(sources(root)):
        spec = parse_source(raw)
        cat = discover_source(spec)
        seen = 0
        for f, lo, hi in cat.units.tolist():
            rec = read_unit_records(spec, cat.files[f], lo, hi)
            assert rec.bad == [] and rec.mask is not None and rec.mask.dtype == bool
            assert rec.lengths is not None and len(rec.mask) == len(rec.tokens)
            ends = np.cumsum(rec.lengths)[:-1]
            pairs = zip(
                np.split(rec.tokens, ends), np.split(rec.mask, ends), rec.offsets, strict=True
            )
            for ids, mask, offset in pairs:
                want_ids, want = docs[(s, f, int(offset))]
                assert np.array_equal(ids, want_ids) and np.array_equal(mask, want)
                seen += 1
        assert seen == sum(1 for key in docs if key[0] == s)


@pytest.mark.parametrize(
    ("batch", "layout"),
    [
        ({"seq_len": 128, "long_documents": "truncate", "global_tokens": 512}, {"dp": 2}),
        ({"seq_len": 48, "global_tokens": 192}, {"dp": 2}),  # documents cut across steps
        ({"seq_len": 64, "micro_batches": 2, "global_tokens": 128}, {"dp": 1, "cp": 2}),
        ({"seq_len": 40, "global_tokens": 160}, {"dp": 2, "cp": 2}),
    ],
)
def test_labels_equal_the_written_rows_on_every_path(
    corpus: tuple[Path, dict[Any, Any]], batch: dict[str, Any], layout: dict[str, Any]
) -> None:
    from omniload_dask.batching.context_parallel import zigzag_index

    root, docs = corpus
    plan = masked_plan(root, batch=batch, layout=layout, seed=5)
    plane = InlineDataPlane(plan)
    cp = int(layout.get("cp", 1))
    masked = 0
    for step in range(5):
        total, carried = 0, set()
        for rank, ref in plane.fetch(step).items():
            group = plan.layout.coords(rank)["dp"]
            whole = plane.wholes[(ref.rsplit(":", 1)[0], step, group)]
            part = plane.batches[ref]
            for mb, got in zip(whole.micro_batches, part.micro_batches, strict=True):
                full = expand(mb)
                want = reference_labels(full, docs)
                assert np.array_equal(full["labels"], want)
                masked += int(((want == IGNORE_INDEX) & (full["position_ids"] > 0)).sum())
                if cp > 1:  # a slice holds the labels of its own positions
                    index, _ = zigzag_index(full["cu_seqlens"], cp, got["cp_rank"])
                    assert np.array_equal(got["labels"][: len(index)], want[index])
                    own = int((want[index] != IGNORE_INDEX).sum())
                else:
                    assert np.array_equal(expand(got)["labels"], want)
                    own = int((want != IGNORE_INDEX).sum())
                assert int(got["num_loss_tokens"]) == own
                total += own
                carried.add(int(got["global_loss_tokens"]))
        assert carried == {total} and total > 0
    assert masked > 0  # (prompts were left out somewhere: the masks did something)


def test_resume_gives_the_same_masked_stream(
    corpus: tuple[Path, dict[Any, Any]], tmp_path: Path
) -> None:
    root, _ = corpus
    plan = masked_plan(
        root,
        batch={"seq_len": 48, "global_tokens": 192},
        checkpoint={"url": str(tmp_path / "ckpt"), "compact_every": 3},
    )
    assert check_resume_equivalence(plan, 6, [2, 4]) > 0


def test_a_masked_arrow_source_plans_from_row_lengths_before_any_read(
    corpus: tuple[Path, dict[Any, Any]],
) -> None:
    """Arrow row lengths give a masked source's lengths up front, as an unmasked one's: the
    mask column, read beside the ids at discovery, gives each record's holes, so the data plane
    draws and counts loss tokens before any read; every read then agrees with them."""
    root, docs = corpus
    arrow = sources(root)[0]
    for mask in ({"column": "labels", "kind": "labels"}, {"column": "loss_mask"}):
        src = {**arrow, "mask": mask, "unit_records": 7}
        spec = parse_source(src)
        cat = discover_source(spec)
        assert cat.lengths is not None and cat.holes is not None
        for u in range(cat.num_units):
            for count in (1, 3):
                known, holes = cat.known_lengths(u, count), cat.known_holes(u, count)
                assert known is not None and len(known) == len(holes) == len(cat.reads(u, count))
                for lengths, got, pieces in zip(known, holes, cat.reads(u, count), strict=True):
                    recs = [read_unit_records(spec, cat.files[f], a, b) for f, a, b in pieces]
                    read_lengths = np.concatenate([r.lengths for r in recs])  # type: ignore[misc]
                    assert read_lengths.tolist() == lengths.tolist()
                    offsets = np.concatenate([[0], np.cumsum(read_lengths)])
                    want = Holes.of(offsets, np.concatenate([r.mask for r in recs]))  # type: ignore[misc]
                    assert (got is None) == (want is None)
                    if got is not None and want is not None:
                        assert np.array_equal(got.bounds, want.bounds)
                        assert np.array_equal(got.spans, want.spans)
        batch = {"seq_len": 48, "global_tokens": 192}
        run = InlineDataPlane(parse_plan(plan_dict([src], batch=batch)), build=False)
        run.coord.handle(StepsRequested(0, 0, 1))
        run._run(run.coord.advance())  # submits the first reads
        run._run(run.coord.advance())
        assert run.coord.view.next_step >= 1 and run.reads == 0  # drawn from the index alone
        # the labels and loss-token counts of a run planned that way are the written rows'
        plane = InlineDataPlane(parse_plan(plan_dict([src], batch=batch, layout={"dp": 2})))
        for step in range(4):
            total, carried = 0, set()
            for ref in plane.fetch(step).values():
                for mb in plane.batches[ref].micro_batches:
                    full = expand(mb)
                    want_labels = reference_labels(full, docs)
                    assert np.array_equal(full["labels"], want_labels)
                    total += int((want_labels != IGNORE_INDEX).sum())
                    carried.add(int(mb["global_loss_tokens"]))
            assert carried == {total} and total > 0
    skip = parse_plan(plan_dict([{**arrow, "unit_records": 7}], on_error="skip"))
    assert InlineDataPlane(skip).coord.components.sources.streams[0].catalog.lengths is None


# -- bad input --


def _one(path: Path, mask: dict[str, Any], fmt: str = "parquet", **kw: Any) -> Any:
    return parse_source({"name": "sft", "format": fmt, "path": str(path), "tokens": "input_ids",
                         "mask": mask, "vocabulary": VOCAB, **kw})  # fmt: skip


def test_mask_plan_fields_are_checked() -> None:
    base = {"name": "s", "path": "/data/x", "vocabulary": VOCAB}
    with pytest.raises(PlanError, match=r"sources\[0\]\.mask: names a mask column of .*megatron"):
        parse_plan(plan_dict([{**base, "format": "megatron", "mask": {"column": "m"}}]))
    with pytest.raises(PlanError, match=r"mask: .*flat sources have no column beside"):
        parse_plan(plan_dict([{**base, "format": "flat", "eod": 1, "mask": {"column": "m"}}]))
    with pytest.raises(PlanError, match=r"mask: .*need sources\[\]\.tokens"):
        parse_plan(plan_dict([{**base, "format": "arrow", "mask": {"column": "m"}}]))
    arrow = {**base, "format": "arrow", "tokens": "input_ids"}
    for mask, message in [
        ({"column": "labels", "kind": "label"}, r"mask\.kind: must be one of"),
        ({"column": "loss_mask", "ignore_index": -1}, r"mask\.ignore_index: only applies"),
        ({"column": "labels", "kind": "labels", "ignore_index": 0}, r"must be <= -1"),
        ({"column": "input_ids"}, r"mask\.column: must be another column"),
        ({"kind": "labels"}, r"mask\.column: is required"),
        ({"column": "m", "colour": 1}, r"mask\.colour: unknown field"),
    ]:
        with pytest.raises(PlanError, match=message):
            parse_plan(plan_dict([{**arrow, "mask": mask}]))
    plan = parse_plan(plan_dict([{**arrow, "mask": {"column": "labels", "kind": "labels"}}]))
    assert plan.sources[0].mask == TokenMaskSpec("labels", "labels", -100)
    assert parse_plan(plan.to_dict()).sources[0] == plan.sources[0]
    plain = parse_plan(plan_dict([{**arrow, "mask": {"column": "loss_mask"}}]))
    assert plain.sources[0].mask == TokenMaskSpec("loss_mask")
    assert parse_plan(plain.to_dict()).sources[0] == plain.sources[0]


def test_a_missing_or_non_integer_mask_column_names_the_file(tmp_path: Path) -> None:
    rows = sft_rows(10, 4)
    path = write_parquet(tmp_path / "p" / "a.parquet", rows,
                         weights=pa.array([[0.5] * len(i) for i, _ in rows]))  # fmt: skip
    with pytest.raises(SourceError, match=r"source 'sft': file .*a\.parquet.* no mask column "
                       r"'labels' \(columns: input_ids, loss_mask, weights\)"):  # fmt: skip
        discover_source(_one(path.parent, {"column": "labels", "kind": "labels"}))
    with pytest.raises(SourceError, match=r"mask column 'weights' has type list<.*double>"):
        discover_source(_one(path.parent, {"column": "weights"}))
    with pytest.raises(SourceError, match=r"a list of integers per row"):  # (bools: no labels)
        discover_source(_one(path.parent, {"column": "loss_mask", "kind": "labels"}))
    folder = write_mds(tmp_path / "mds", rows, labels="ndarray:float32")
    with pytest.raises(SourceError, match=r"shard 0: mask column 'labels' is encoded "
                       r"'ndarray:float32'"):  # fmt: skip
        discover_source(_one(folder, {"column": "labels", "kind": "labels"}, fmt="mds"))
    with pytest.raises(SourceError, match=r"shard 0 has no mask column 'loss_mask'"):
        discover_source(_one(folder, {"column": "loss_mask"}, fmt="mds"))


BAD_ROWS = [
    # (what is wrong with row 3, its labels, its loss_mask, the reason named)
    ("length", [-100, 7, 8], None, r"mask column 'labels' has 3 values, the ids 4"),
    ("shifted", [-100, 8, 9, -100], None,
     r"label 8 at position 1 is neither -100 nor the token id 7 there"),
    ("all -100", [-100] * 4, None, r"no target token: mask column 'labels' leaves none"),
    ("only the first", [6, -100, -100, -100], None, r"no target token"),
    ("null", None, None, r"mask column 'labels' is null"),
    ("not 0/1", None, [0, 2, 1, 1], r"mask value 2 at position 1 of column 'loss_mask' is not "
     r"0 or 1 \(a labels column\? set sources\[\]\.mask\.kind: labels\)"),
]  # fmt: skip


@pytest.mark.parametrize(("what", "labels", "loss_mask", "reason"), BAD_ROWS)
def test_a_row_whose_mask_is_wrong_is_a_bad_record_named_or_skipped_and_counted(
    tmp_path: Path, what: str, labels: Any, loss_mask: Any, reason: str
) -> None:
    ids = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 1, 2, 3], [6, 7, 8, 9], [4, 5, 6, 7]]
    all_labels: list[Any] = [[-100, *row[1:]] for row in ids]
    all_masks: list[Any] = [[0, 1, 1, 1] for _ in ids]
    all_labels[3] = labels
    all_masks[3] = loss_mask if loss_mask is not None else all_masks[3]
    table = pa.table({"input_ids": ids, "labels": pa.array(all_labels, pa.list_(pa.int64())),
                      "loss_mask": all_masks})  # fmt: skip
    (tmp_path / "p").mkdir()
    pq.write_table(table, tmp_path / "p" / "a.parquet")
    mask = {"column": "loss_mask"} if loss_mask is not None else {"column": "labels",
                                                                  "kind": "labels"}  # fmt: skip
    src = {"name": "sft", "format": "parquet", "path": str(tmp_path / "p"),
           "tokens": "input_ids", "mask": mask, "vocabulary": VOCAB}  # fmt: skip
    batch = {"seq_len": 16, "long_documents": "truncate", "global_tokens": 16}
    with pytest.raises((RecordError, JobError), match=reason) as caught:
        InlineDataPlane(parse_plan(plan_dict([src], layout={"dp": 1}, batch=batch))).step(0)
    message = str(caught.value)
    assert "source 'sft'" in message and "a.parquet" in message
    assert "record at offset 3" in message
    plane = InlineDataPlane(
        parse_plan(plan_dict([src], layout={"dp": 1}, batch=batch, on_error="skip"))
    )
    plane.step(0)
    shards = list(plane.shards.values())
    assert shards and all(s.skipped == 1 for s in shards)  # (one read of the file an epoch)
    assert any(re.search(reason, b) for s in shards for b in s.bad)


def test_transforms_see_and_return_the_mask(tmp_path: Path) -> None:
    rows = sft_rows(30, 6)
    write_parquet(tmp_path / "p" / "a.parquet", rows)
    src = {"name": "sft", "format": "parquet", "path": str(tmp_path / "p"),
           "tokens": "input_ids", "mask": {"column": "loss_mask"}, "vocabulary": VOCAB}  # fmt: skip
    batch = {"seq_len": 256, "long_documents": "truncate", "global_tokens": 512}
    docs = {(0, 0, r): (ids[1:], (labels != IGNORE_INDEX)[1:]) for r, (ids, labels)
            in enumerate(rows) if (labels[2:] != IGNORE_INDEX).any()}  # fmt: skip
    plan = parse_plan(plan_dict([{**src, "transform": "tests.user_code:drop_first_token"}],
                                batch=batch, on_error="skip"))  # fmt: skip
    plane = InlineDataPlane(plan)
    seen = 0
    for step in range(3):
        for batch_ in plane.step(step).values():
            for mb in batch_.micro_batches:
                full = expand(mb)
                assert np.array_equal(full["labels"], reference_labels(full, docs))
                seen += len(full["doc_id"])
    assert seen > 0
    plan = parse_plan(plan_dict([{**src, "transform": "tests.user_code:lose_the_mask"}],
                                batch=batch))  # fmt: skip
    with pytest.raises((RecordError, JobError), match=r"lose_the_mask returned \d+ tokens "
                       r"and a 'mask' of \d+") as caught:  # fmt: skip
        InlineDataPlane(plan).step(0)
    assert "source 'sft'" in str(caught.value) and "record at offset 0" in str(caught.value)


def test_validate_shows_each_token_sources_mask_column(
    corpus: tuple[Path, dict[Any, Any]], tmp_path: Path
) -> None:
    import subprocess
    import sys

    import yaml

    root, docs = corpus
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan_dict(sources(root))))
    done = subprocess.run(
        [sys.executable, "-m", "omniload_dask.cli", "validate", str(path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    notes = {
        line.split("'")[1]: json.loads(line.split(": ", 1)[1])
        for line in done.stderr.splitlines()
        if line.startswith("# token source ")
    }
    assert notes["arrow"]["mask"] == {"column": "labels", "kind": "labels", "ignore_index": -100}
    assert notes["pq"]["mask"] == {"column": "loss_mask", "kind": "loss_mask"}
    assert notes["mds"]["mask"]["column"] == "labels"
    assert notes["arrow"]["tokens"] == sum(len(ids) for key, (ids, _) in docs.items()
                                           if key[0] == 0)  # fmt: skip
    assert "(pq) trains on the tokens its loss_mask column 'loss_mask' marks" in done.stderr


def test_a_job_on_a_cluster_hands_every_rank_the_masked_labels(
    corpus: tuple[Path, dict[Any, Any]],
) -> None:
    from omniload_dask import Job
    from omniload_dask.testing import assert_batches_equal

    root, docs = corpus
    plan = masked_plan(root, name="masked", batch={"seq_len": 48, "global_tokens": 192})
    plane = InlineDataPlane(plan)
    seen = 0
    with Job.start(plan, workers=1, dashboard_address=None) as job:
        for rank in range(2):
            with job.feeder(rank=rank, max_steps=3, output="numpy") as feeder:
                for mb in feeder:
                    want = plane.step(int(mb["step"]))[rank].micro_batches[int(mb["micro_step"])]
                    got = {k: v for k, v in mb.items() if k != "doc_source_name"}
                    assert_batches_equal(want, got)  # (global_loss_tokens among the fields)
                    full = expand(got)
                    assert np.array_equal(full["labels"], reference_labels(full, docs))
                    seen += 1
    assert seen > 0


def test_the_labels_convention_is_the_one_transformers_models_take(tmp_path: Path) -> None:
    """A row's ``labels`` given to a ``transformers`` causal LM give the same loss as the
    labels this source delivers for that row: both score the same predictions."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    rows = sft_rows(6, 8, longest=40)
    labels_column = pa.array([lab.tolist() for _, lab in rows])
    write_parquet(tmp_path / "p" / "a.parquet", rows, labels=labels_column)
    src = {"name": "sft", "format": "parquet", "path": str(tmp_path / "p"),
           "tokens": "input_ids", "mask": {"column": "labels", "kind": "labels"},
           "vocabulary": VOCAB}  # fmt: skip
    batch = {"seq_len": 64, "micro_batches": 1, "global_tokens": 64, "long_documents": "truncate"}
    plan = parse_plan(plan_dict([src], layout={"dp": 1}, batch=batch))
    config = transformers.GPT2Config(vocab_size=258, n_positions=64, n_embd=16, n_layer=1, n_head=2)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    checked = 0
    for batch in InlineDataPlane(plan).step(0).values():
        for mb in batch.micro_batches:
            full = expand(mb)
            cu = full["cu_seqlens"]
            for j in range(len(cu) - 1):
                a, b = int(cu[j]), int(cu[j + 1])
                _, _, row = decode_sample_id(int(full["doc_id"][j]))
                ids, labels = rows[row]
                assert np.array_equal(full["input_ids"][a:b], ids)  # (whole rows: truncate)
                with torch.no_grad():
                    logits = model(torch.as_tensor(ids)[None]).logits[0]
                    theirs = model(torch.as_tensor(ids)[None],
                                   labels=torch.as_tensor(labels)[None]).loss  # fmt: skip
                ours = torch.nn.functional.cross_entropy(
                    logits, torch.as_tensor(full["labels"][a:b]), ignore_index=IGNORE_INDEX
                )
                assert torch.allclose(theirs, ours)
                checked += 1
    assert checked > 0

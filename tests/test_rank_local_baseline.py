"""The per-rank DataLoader baseline of benchmarks/head_to_head.py is a correct loader.

A benchmark against a broken baseline proves nothing, so its parts are checked here: disjoint
file shards, every document of a worker's files once per epoch, micro-batches in the packed
layout within their capacity, the mix following the plan's weights, and the figures it reports.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

from support.manysources import bpe_tokenizer, make_sources, source_specs  # noqa: E402
from support.rank_local import RankLocalLoader, SourceShard, shard_files, step_cost  # noqa: E402

from omniload_dask import parse_plan  # noqa: E402
from omniload_dask.plan.cost import CostModel  # noqa: E402
from omniload_dask.preprocess.tokenize import tokenize  # noqa: E402

SEQ_LEN = 1024


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_sources(tmp_path_factory.mktemp("h2h"), sources=3, files=4, words_per_file=3000)


def plan_for(data: Path, sources: int = 3, ranks: int = 2) -> object:
    return parse_plan(
        {
            "version": 1,
            "name": "t",
            "seed": 3,
            "tokenizer": {
                "kind": "huggingface",
                "path": str(data / "tokenizer.json"),
                "bos": "<s>",
                "eos": "</s>",
            },
            "batch": {"seq_len": SEQ_LEN, "micro_batches": 2},
            "layout": {"dp": ranks},
            "on_error": "skip",
            "sources": source_specs(data, sources),
        }
    )


def all_texts(spec: object, files: list[str]) -> list[str]:
    import pyarrow.parquet as pq
    import zstandard

    out = []
    for path in files:
        if path.endswith(".parquet"):
            out += pq.read_table(path, columns=[spec.text]).column(0).to_pylist()
            continue
        raw = Path(path).read_bytes()
        if path.endswith(".zst"):
            raw = zstandard.ZstdDecompressor().stream_reader(raw).read()
        out += [json.loads(line)[spec.text] for line in raw.decode().splitlines() if line]
    return out


def test_every_rank_gets_its_own_files_and_together_all(data):
    plan = plan_for(data, ranks=3)
    for spec in plan.sources:
        shards = [shard_files(spec, r, 3) for r in range(3)]
        flat = [f for s in shards for f in s]
        assert len(flat) == len(set(flat)) == 4
        assert all(shards)
    with pytest.raises(ValueError, match="at least one file per rank"):
        shard_files(plan.sources[0], 0, 5)


@pytest.mark.parametrize("source", [0, 1, 2])  # JSON Lines, zstd JSON Lines, Parquet
def test_a_worker_yields_every_document_of_its_files_once_per_epoch(data, source):
    plan = plan_for(data)
    spec = plan.sources[source]
    files = shard_files(spec, 1, 2)
    ds = SourceShard(source, spec, files, plan.tokenizer, plan.seed, rank=1, chunk_tokens=2000)
    _, offsets = tokenize(plan.tokenizer, all_texts(spec, files))
    want = np.sort(np.diff(offsets))
    got, states = [], []
    for chunk in ds:
        got += np.diff(chunk["offsets"]).tolist()
        states.append((chunk["state_bytes"], chunk["open_files"]))
        assert len(chunk["tokens"]) == chunk["offsets"][-1]
        if len(got) >= len(want):
            break
    assert np.array_equal(np.sort(got), want)
    assert all(b > 0 for b, _ in states)
    assert any(n == 1 for _, n in states)  # some chunks leave while the file is open


def test_micro_batches_are_packed_within_capacity_and_follow_the_mix(data):
    plan = plan_for(data)
    loader = RankLocalLoader(plan, rank=0, world=2, workers=2, chunk_tokens=2000)
    cost = CostModel.from_spec(plan.cost)
    per_source = np.zeros(3)
    steps: dict[int, list[dict]] = {}
    try:
        for mb in loader:
            steps.setdefault(mb["step"], []).append(mb)
            cu = mb["cu_seqlens"].numpy()
            ids, labels, pos = (mb[k].numpy() for k in ("input_ids", "labels", "position_ids"))
            assert cu[0] == 0 and cu[-1] == mb["num_tokens"] == len(ids) <= SEQ_LEN
            lengths = np.diff(cu)
            assert (lengths > 0).all() and mb["max_seqlen"] == lengths.max()
            assert np.array_equal(pos, np.concatenate([np.arange(n) for n in lengths]))
            ends = cu[1:] - 1
            assert (labels[ends] == -100).all()
            inner = np.setdiff1d(np.arange(len(ids) - 1), ends)
            assert np.array_equal(labels[inner], ids[inner + 1])
            per_source += np.bincount(mb["doc_source"].numpy(), lengths, minlength=3)
            if len(steps) > 40:
                break
        assert loader.produced_tokens() >= per_source.sum()
        assert loader.state_bytes() > 0
    finally:
        loader.close()
    for mbs in list(steps.values())[:-1]:
        assert [m["micro_step"] for m in mbs] == [0, 1]
        assert step_cost(cost, mbs) > 0
    shares = per_source / per_source.sum()
    np.testing.assert_allclose(shares, [0.5, 0.3, 0.2], atol=0.02)


def test_the_bpe_tokenizer_has_llama3s_size_and_the_word_level_token_counts(data):
    from tokenizers import Tokenizer

    bpe = Tokenizer.from_file(str(bpe_tokenizer(data)))
    words = Tokenizer.from_file(str(data / "tokenizer.json"))
    assert bpe.get_vocab_size() == 128_256
    spec = plan_for(data).sources[0]
    text = " ".join(all_texts(spec, shard_files(spec, 0, 1))[:200])
    n_bpe, n_words = len(bpe.encode(text).ids), len(words.encode(text).ids)
    assert abs(n_bpe - n_words) <= 0.05 * n_words
    assert bpe.decode(bpe.encode(text).ids) == text


def test_a_tokenizer_loaded_in_the_rank_gives_the_same_batches(data):
    plan = plan_for(data)
    got = {}
    for where in ("worker", "rank"):
        loader = RankLocalLoader(
            plan, rank=1, world=2, workers=2, chunk_tokens=2000, tokenizer_in=where
        )
        try:
            it = iter(loader)
            got[where] = [next(it) for _ in range(6)]
        finally:
            loader.close()
    for a, b in zip(got["worker"], got["rank"], strict=True):
        assert np.array_equal(a["input_ids"].numpy(), b["input_ids"].numpy())
        assert np.array_equal(a["doc_source"].numpy(), b["doc_source"].numpy())
    with pytest.raises(ValueError, match="tokenizer_in"):
        RankLocalLoader(plan, rank=0, world=2, tokenizer_in="nowhere")

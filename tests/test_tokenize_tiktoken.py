"""The ``tiktoken`` tokenizer kind: a byte-level BPE file of base64 token / rank lines."""

from __future__ import annotations

import base64
import importlib.util
import json
import multiprocessing
import threading
from pathlib import Path

import numpy as np
import pytest
from distributed import Client

from omniload_dask import Job, PlanError, TokenizerError, local_cluster
from omniload_dask.cluster.tasks import tokenizer_threads
from omniload_dask.plan import READ_SLOTS_PER_THREAD, TokenizerSpec, parse_plan
from omniload_dask.preprocess.tokenize import describe, load_tokenizer, own_threads, tokenize
from omniload_dask.testing import InlineDataPlane, assert_batches_equal

from .conftest import make_plan
from .datagen import plan_dict

tiktoken = pytest.importorskip("tiktoken")
# the module (the package's ``tokenize`` attribute is the function)
tokenize_module = importlib.import_module("omniload_dask.preprocess.tokenize")

# GPT-2's pre-tokenizer split, short enough to read: contractions, words, numbers, the rest
PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# every byte, then merges: "he" "ll" "llo" "hello" " w" "or" " wor" " world"
MERGES = [b"he", b"ll", b"llo", b"hello", b" w", b"or", b" wor", b"ld", b" world"]
SPECIALS = {"<|bos|>": 300, "<|eos|>": 301}


def write_bpe(path: Path, merges: list[bytes] = MERGES) -> str:
    tokens = [bytes([b]) for b in range(256)] + merges
    path.write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(tokens)))
    return str(path)


def bpe_spec(path: str, **kw: object) -> TokenizerSpec:
    fields = {"pattern": PATTERN, "special_tokens": SPECIALS, "bos": "<|bos|>", "eos": "<|eos|>"}
    return TokenizerSpec(kind="tiktoken", path=path, **{**fields, **kw})  # type: ignore[arg-type]


def test_tiktoken_file_encodes_by_its_ranks_and_adds_the_plans_specials(tmp_path):
    spec = bpe_spec(write_bpe(tmp_path / "bpe.tiktoken"))
    tokens, offsets = tokenize(spec, ["hello world", "", "hé"])
    hello, world = 256 + MERGES.index(b"hello"), 256 + MERGES.index(b" world")
    assert tokens.tolist() == [300, hello, world, 301, 300, 301, 300, ord("h"), 0xC3, 0xA9, 301]
    assert offsets.tolist() == [0, 4, 6, 11]
    assert tokens.dtype == np.uint32
    assert describe(spec) == {"vocab_size": 302, "bos_id": 300, "eos_id": 301}


def test_special_token_text_inside_a_document_stays_text(tmp_path):
    spec = bpe_spec(write_bpe(tmp_path / "bpe.tiktoken"), add_bos=False, bos=None)
    tokens, _ = tokenize(spec, ["a<|eos|>b"])
    assert tokens.tolist()[-1] == 301 and 301 not in tokens.tolist()[:-1]


def test_tokens_are_those_of_encode_ordinary_also_for_lone_surrogates(tmp_path):
    path = write_bpe(tmp_path / "bpe.tiktoken")
    spec = bpe_spec(path, add_bos=False, add_eos=False, bos=None, eos=None)
    enc = tiktoken.Encoding(
        name="check", pat_str=PATTERN, mergeable_ranks=_ranks(path), special_tokens=SPECIALS
    )
    texts = ["hello world <|bos|>", "", "a\ud800b hello", "hé world"]
    tokens, offsets = tokenize(spec, texts)
    expected = [enc.encode_ordinary(t) for t in texts]
    assert tokens.tolist() == [t for e in expected for t in e]
    assert np.diff(offsets).tolist() == [len(e) for e in expected]


def _ranks(path: str) -> dict[bytes, int]:
    lines = Path(path).read_text().splitlines()
    return {base64.b64decode(t): int(r) for t, r in (line.split() for line in lines)}


def test_tiktoken_file_from_a_memory_url(tmp_path):
    import fsspec

    local = write_bpe(tmp_path / "bpe.tiktoken")
    fsspec.filesystem("memory").pipe("/tok/bpe.tiktoken", Path(local).read_bytes())
    spec = bpe_spec("memory://tok/bpe.tiktoken", add_bos=False, bos=None)
    assert tokenize(spec, ["hello"])[0].tolist() == [256 + MERGES.index(b"hello"), 301]


def test_plan_reads_the_tiktoken_section_and_round_trips(tmp_path):
    path = write_bpe(tmp_path / "bpe.tiktoken")
    tok = {"kind": "tiktoken", "path": path, "pattern": PATTERN, "special_tokens": SPECIALS,
           "bos": "<|bos|>", "eos": "<|eos|>"}  # fmt: skip
    src = {"name": "a", "format": "jsonl", "path": str(tmp_path / "*.jsonl")}
    plan = parse_plan(plan_dict([src], tokenizer=tok))
    assert plan.tokenizer == bpe_spec(path)
    again = parse_plan(plan.to_dict())
    assert again == plan and again.stream_fingerprint() == plan.stream_fingerprint()
    # the tiktoken-only fields stay out of other kinds' plan data (their fingerprints too)
    assert "pattern" not in parse_plan(plan_dict([src])).to_dict()["tokenizer"]


@pytest.mark.parametrize(
    ("tokenizer", "message"),
    [
        ({"kind": "tiktoken", "pattern": PATTERN}, "tokenizer.path: is required"),
        ({"kind": "tiktoken", "path": "t.tiktoken", "add_bos": False, "add_eos": False},
         "tokenizer.pattern: is required with kind: tiktoken"),
        ({"kind": "tiktoken", "path": "t.tiktoken", "pattern": PATTERN, "bos": "<s>",
          "add_eos": False}, "tokenizer.bos: must be one of tokenizer.special_tokens (have none)"),
        ({"kind": "tiktoken", "path": "t.tiktoken", "pattern": PATTERN,
          "special_tokens": {"<s>": -1}, "bos": "<s>", "add_eos": False},
         "tokenizer.special_tokens['<s>']: must be a token id (an integer >= 0), got -1"),
        ({"kind": "tiktoken", "path": "t.tiktoken", "pattern": PATTERN,
          "special_tokens": {"<s>": 5, "</s>": 5}, "bos": "<s>", "eos": "</s>"},
         "tokenizer.special_tokens['</s>']: repeats the id of another special token"),
        ({"kind": "huggingface", "path": "t.json", "pattern": PATTERN, "add_bos": False,
          "add_eos": False}, "tokenizer.pattern: only applies to kind: tiktoken"),
        ({"kind": "byte", "special_tokens": {"<s>": 1}},
         "tokenizer.special_tokens: only applies to kind: tiktoken"),
        ({"kind": "sentencepiece"}, "tokenizer.kind: must be one of 'byte', 'huggingface', "
         "'tiktoken'"),
    ],
)  # fmt: skip
def test_bad_tiktoken_fields_are_named(tokenizer, message):
    src = {"name": "a", "format": "jsonl", "path": "/data/*.jsonl"}
    with pytest.raises(PlanError) as info:
        parse_plan(plan_dict([src], tokenizer=tokenizer))
    assert message in str(info.value)


def test_bad_tiktoken_files_and_patterns_are_clear_errors(tmp_path):
    with pytest.raises(TokenizerError, match=r"tokenizer.path: file '.*missing' does not exist"):
        describe(bpe_spec(str(tmp_path / "missing")))
    (tmp_path / "junk").write_text("SGVsbG8= 0\nnot base64 at all\n")
    with pytest.raises(TokenizerError, match=r"line 2 is not '<base64 token> <rank>'"):
        describe(bpe_spec(str(tmp_path / "junk")))
    path = write_bpe(tmp_path / "bpe.tiktoken")
    with pytest.raises(TokenizerError, match=r"special_tokens\['<\|bos\|>'\]: id 7 is also"):
        describe(bpe_spec(path, special_tokens={"<|bos|>": 7, "<|eos|>": 301}))
    with pytest.raises(TokenizerError, match="tokenizer.pattern: tiktoken cannot use it"):
        describe(bpe_spec(path, pattern="(unclosed"))


def test_a_tiktoken_plan_streams_the_same_inline_and_on_a_cluster(small_sources, tmp_path):
    tok = {"kind": "tiktoken", "path": write_bpe(tmp_path / "bpe.tiktoken"), "pattern": PATTERN,
           "special_tokens": SPECIALS, "bos": "<|bos|>", "eos": "<|eos|>"}  # fmt: skip
    plan = make_plan(small_sources, tokenizer=tok)
    plane = InlineDataPlane(plan)
    ref = [batches[0].micro_batches for _, batches in plane.stream(3)]
    with local_cluster(1, dashboard_address=None) as cluster:
        job = Job.start(plan, address=cluster.scheduler_address)
        try:
            with job.feeder(rank=0, max_steps=3, output="numpy") as feeder:
                got = list(feeder)
        finally:
            job.close()
        with Client(cluster.scheduler_address, set_as_default=False) as client:
            own = client.run(
                lambda: [t.name for t in threading.enumerate() if t.name.startswith("omniload-tok")]
            )
            slots = client.run(lambda dask_worker: dask_worker.state.total_resources)
    # the worker runs two reads at once (its omniload-read resource) and tokenizes them on one
    # thread: one read decodes while the other tokenizes
    assert [s.get("omniload-read") for s in slots.values()] == [READ_SLOTS_PER_THREAD] == [2]
    assert [len(names) for names in own.values()] == [1]
    flat = [mb for step in ref for mb in step]
    assert len(got) == len(flat)
    for a, b in zip(flat, got, strict=True):
        assert_batches_equal(a, {k: v for k, v in b.items() if k != "doc_source_name"})
    ids = np.concatenate([mb["input_ids"] for mb in flat])
    assert ids.max() <= 301 and (ids == 300).sum() > 0  # BPE ids and the plan's BOS


def test_a_worker_tokenizes_on_one_thread_for_every_two_read_slots():
    assert [tokenizer_threads(n) for n in (1, 2, 3, 4, 5, 8)] == [1, 1, 2, 2, 3, 4]
    assert tokenizer_threads(0) == 1  # a worker that offers no read slot still tokenizes


def _tokenize_in_child(spec: TokenizerSpec, texts: list[str], queue: object) -> None:
    tokens, _ = tokenize(spec, texts)
    queue.put(tokens.tolist())  # type: ignore[attr-defined]


def test_tokenizers_load_and_run_on_their_own_thread_whoever_calls(tmp_path, monkeypatch):
    """With own_threads, every caller's tokenizing runs on one thread of the tokenizers' own
    (where tiktoken's regex keeps its fast path); results and errors are the caller's as
    before, and a forked child tokenizes in its own threads (nothing waits on threads that
    the fork did not copy)."""
    spec = bpe_spec(write_bpe(tmp_path / "bpe.tiktoken"))
    texts = ["hello world", "hé, hello", ""]
    expected = [a.tolist() for a in tokenize(spec, texts)]
    monkeypatch.setattr(tokenize_module, "_own_pool", None)
    tokenize_module._cached.cache_clear()
    ran_on: list[str] = []
    encode = tokenize_module.TiktokenTokenizer.encode

    def spy(self, batch):  # type: ignore[no-untyped-def]
        ran_on.append(threading.current_thread().name)
        return encode(self, batch)

    monkeypatch.setattr(tokenize_module.TiktokenTokenizer, "encode", spy)
    own_threads(1)
    own_threads(1)  # no more threads asked for: the same pool
    results: list[list[list[int]]] = []
    callers = [threading.Thread(target=lambda: results.append(
        [a.tolist() for a in tokenize(spec, texts)])) for _ in range(3)]  # fmt: skip
    for t in callers:
        t.start()
    results.append([a.tolist() for a in tokenize(spec, texts)])
    for t in callers:
        t.join(timeout=60)
    assert results == [expected] * 4
    assert len(ran_on) == 4 and len(set(ran_on)) == 1 and ran_on[0].startswith("omniload-tok")
    assert load_tokenizer(spec) is load_tokenizer(spec)  # loaded once, cached as before
    with pytest.raises(TokenizerError, match="does not exist"):
        load_tokenizer(bpe_spec(str(tmp_path / "missing.tiktoken")))
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_tokenize_in_child, args=(spec, texts, queue))
    child.start()
    try:
        assert queue.get(timeout=60) == expected[0]
    finally:
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0
    tokenize_module._cached.cache_clear()


def _tekken_file() -> Path | None:
    """mistral-common's Tekken file, where the package is installed (or in the benchmarks'
    third-party folder)."""
    found = importlib.util.find_spec("mistral_common")
    roots = list(found.submodule_search_locations or []) if found else []
    roots.append(str(Path(__file__).resolve().parents[1] / "benchmarks" / ".thirdparty"
                     / "mistral_common"))  # fmt: skip
    for root in roots:
        path = Path(root) / "data" / "tekken_240911.json"
        if path.is_file():
            return path
    return None


@pytest.mark.skipif(_tekken_file() is None, reason="mistral-common (its Tekken file) not installed")
def test_the_tekken_bpe_as_a_tiktoken_file_round_trips_real_text(tmp_path):
    tekken = json.loads(_tekken_file().read_text())  # type: ignore[union-attr]
    config = tekken["config"]
    size = config["default_vocab_size"] - config["default_num_special_tokens"]
    vocab = sorted(tekken["vocab"], key=lambda v: v["rank"])[:size]
    path = tmp_path / "tekken.tiktoken"
    path.write_text("".join(f"{v['token_bytes']} {v['rank']}\n" for v in vocab))
    spec = TokenizerSpec(kind="tiktoken", path=str(path), pattern=config["pattern"],
                         special_tokens={"<s>": size, "</s>": size + 1}, bos="<s>",
                         eos="</s>")  # fmt: skip
    text = Path(__file__).read_text()
    tokens, offsets = tokenize(spec, [text, "déjà vu, naïve café"])
    assert tokens[0] == size and tokens[offsets[1] - 1] == size + 1
    enc = tiktoken.Encoding("check", pat_str=config["pattern"],
                            mergeable_ranks={base64.b64decode(v["token_bytes"]): v["rank"]
                                             for v in vocab}, special_tokens={})  # fmt: skip
    assert enc.decode(tokens[1 : offsets[1] - 1].tolist()) == text
    assert len(text) / (offsets[1] - 2) > 2.5  # a real BPE: several characters per token
    assert describe(spec)["vocab_size"] == size + 2

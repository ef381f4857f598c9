"""A plan of token sources only checks its tokenizer's vocabulary without building it."""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import pytest

from omniload_dask import Job, PlanError, TokenizerError, local_cluster
from omniload_dask.plan import TokenizerSpec, parse_plan
from omniload_dask.preprocess.tokenize import describe
from omniload_dask.preprocess.vocabulary import describe_vocabulary

from .datagen import plan_dict
from .tokendata import VOCAB, documents, megatron_documents, write_megatron

pytest.importorskip("tiktoken")
PATTERN = r""" ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+"""


def write_ranks(path: Path, merges: tuple[bytes, ...] = (), first: int = 0) -> str:
    tokens = [bytes([b]) for b in range(256)] + list(merges)
    lines = (f"{base64.b64encode(t).decode()} {first + i}\n" for i, t in enumerate(tokens))
    path.write_text("".join(lines))
    return str(path)


def spec(path: str, specials: dict[str, int], **kw: object) -> TokenizerSpec:
    fields = {"pattern": PATTERN, "special_tokens": specials, "bos": "<b>", "eos": "<e>"}
    return TokenizerSpec(kind="tiktoken", path=path, **{**fields, **kw})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("merges", "first", "specials"),
    [
        ((), 0, {"<b>": 256, "<e>": 257}),
        ((b"he", b"ll"), 0, {"<b>": 400, "<e>": 300}),  # a gap: ids up to the highest special
        ((b"he",), 10, {"<b>": 0, "<e>": 1}),  # specials below the ranks
    ],
)
def test_the_vocabulary_is_the_one_the_built_tokenizer_reports(tmp_path, merges, first, specials):
    sp = spec(write_ranks(tmp_path / "t.tiktoken", merges, first), specials)
    assert describe_vocabulary(sp) == describe(sp)
    assert describe_vocabulary(TokenizerSpec()) == describe(TokenizerSpec())


def test_a_bad_tiktoken_file_gives_the_loaders_errors(tmp_path):
    cases = [
        (tmp_path / "missing", {"<b>": 256, "<e>": 257}),
        (tmp_path / "junk", {"<b>": 256, "<e>": 257}),
        (tmp_path / "empty", {"<b>": 256, "<e>": 257}),
        (tmp_path / "clash", {"<b>": 7, "<e>": 257}),
    ]
    (tmp_path / "junk").write_text("SGVsbG8= 0\nnot a rank line\n")
    (tmp_path / "empty").write_text("\n")
    write_ranks(tmp_path / "clash")
    for path, specials in cases:
        sp = spec(str(path), specials)
        with pytest.raises(TokenizerError) as light:
            describe_vocabulary(sp)
        with pytest.raises(TokenizerError) as built:
            describe(sp)
        assert str(light.value) == str(built.value)


def test_a_token_only_job_starts_without_building_its_tokenizer(tmp_path):
    docs = documents(40, seed=3)
    write_megatron(tmp_path / "m" / "c", docs)
    src = {"name": "m", "format": "megatron", "path": str(tmp_path / "m" / "c"),
           "vocabulary": VOCAB}  # fmt: skip
    ranks = write_ranks(tmp_path / "t.tiktoken")
    # a pattern tiktoken rejects: building the tokenizer would fail, and no token needs it
    tok = {"kind": "tiktoken", "path": ranks, "pattern": "(unclosed", "bos": "<b>", "eos": "<e>",
           "special_tokens": {"<b>": 256, "<e>": 257}}  # fmt: skip
    plan = parse_plan(plan_dict([src], tokenizer=tok))
    with pytest.raises(TokenizerError, match="tokenizer.pattern"):
        describe(plan.tokenizer)
    specials = {"<b>": 256, "<e>": 300}  # ids 0..300: not the sources' 258
    wrong = parse_plan(plan_dict([src], name="w", tokenizer={**tok, "special_tokens": specials}))
    with local_cluster(1, dashboard_address=None) as cluster:
        job = Job.start(plan, address=cluster.scheduler_address)
        try:
            with job.feeder(rank=0, max_steps=1, output="numpy") as feeder:
                got = list(feeder)
        finally:
            job.close()
        with pytest.raises(PlanError, match=r"sources\[0\]\.vocabulary\.size: 258.*301 ids"):
            Job.start(wrong, address=cluster.scheduler_address)
    ids = np.concatenate([mb["input_ids"].reshape(-1) for mb in got])
    written = set(np.concatenate(megatron_documents(tmp_path / "m" / "c")).tolist())
    assert len(ids) > 0 and set(ids.tolist()) <= written | {256, 257, 0}

"""Whole documents: under ``truncate``, or ``split`` with ``max_document_tokens`` at or under
``seq_len``, no document (a conversation above all) is ever cut between micro-batches or steps;
a conversation longer than the plan allows is a counted skip, never truncated."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from omniload_dask.errors import PlanError
from omniload_dask.plan import Plan, parse_plan
from omniload_dask.testing import InlineDataPlane

from .chatdata import conversations, write_chat_tokenizer
from .datagen import plan_dict, read_records, texts, write_jsonl

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("whole")
    tok = write_chat_tokenizer(root / "tok")
    convs = conversations(120, seed=11)
    (root / "chat").mkdir()
    lines = [json.dumps({"messages": c}) for c in convs]
    (root / "chat" / "a.jsonl").write_text("\n".join(lines) + "\n")
    write_jsonl(root / "plain" / "b.jsonl", texts(80, seed=12, mean_words=60))
    return root, tok


def _plan(root: Path, tok: Path, **overrides: Any) -> Plan:
    sources = [
        {"name": "chat", "format": "jsonl", "path": str(root / "chat"), "weight": 2,
         "chat": {"layout": "messages"}},
        {"name": "plain", "format": "jsonl", "path": str(root / "plain"), "weight": 1},
    ]  # fmt: skip
    tokenizer = {"kind": "huggingface", "path": str(tok), "add_bos": False, "add_eos": False}
    return parse_plan(plan_dict(sources, tokenizer=tokenizer, on_error="skip", **overrides))


def _records(plan: Plan) -> dict[int, int]:
    """Tokens of every record as its read task hands it over (capped; bad ones left out)."""
    return {sid: len(tokens) for _, sid, tokens in read_records(plan)}


def _pieces(plan: Plan, steps: int) -> Counter[tuple[int, int, int, int]]:
    """(source, epoch, sample id, offset, tokens) of every piece delivered, counted."""
    got: Counter[Any] = Counter()
    for _, batches in InlineDataPlane(plan).stream(steps):
        for batch in batches.values():
            for mb in batch.micro_batches:
                sizes = np.diff(mb["cu_seqlens"]).tolist()
                keys = zip(mb["doc_source"].tolist(), mb["doc_epoch"].tolist(),
                           mb["doc_id"].tolist(), mb["doc_offset"].tolist(), sizes,
                           strict=True)  # fmt: skip
                got.update(keys)
    return got


def test_no_document_is_cut_when_whole_documents_are_asked_for(corpus: tuple[Path, Path]) -> None:
    from hypothesis import HealthCheck, example, given, settings
    from hypothesis import strategies as st

    root, tok = corpus

    @settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
    @example(seq_len=300, how="cap_below", dp=1, micro=1, fill=0.6, by="tokens", seed=0)
    @given(
        seq_len=st.sampled_from([300, 400, 512]),
        how=st.sampled_from(["truncate", "cap_at_seq_len", "cap_below", "buckets"]),
        dp=st.integers(1, 3),
        micro=st.integers(1, 2),
        fill=st.sampled_from([0.6, 0.9, 1.0, 1.3]),
        by=st.sampled_from(["tokens", "documents"]),
        seed=st.integers(0, 50),
    )
    def check(seq_len: int, how: str, dp: int, micro: int, fill: float, by: str, seed: int) -> None:
        batch: dict[str, Any] = {"seq_len": seq_len, "micro_batches": micro}
        if how == "truncate":
            batch["long_documents"] = "truncate"
        elif how == "buckets":  # two buckets: a document may spill to the shorter one
            batch = {"seq_len": None, "micro_batches": None,
                     "buckets": [{"seq_len": 256, "micro_batches": 1},
                                 {"seq_len": seq_len, "micro_batches": micro}],
                     "max_document_tokens": seq_len}  # fmt: skip
        else:
            batch["max_document_tokens"] = seq_len if how == "cap_at_seq_len" else seq_len - 60
        cap = batch.get("max_document_tokens", seq_len)
        batch["global_tokens"] = max(cap, int(fill * seq_len * micro * dp))
        plan = _plan(root, tok, batch=batch, layout={"dp": dp}, seed=seed, mixing={"by": by})
        assert plan.batch.whole_documents
        full = _records(plan)
        pieces = _pieces(plan, 8)
        assert pieces
        seen = Counter((s, e, sid) for s, e, sid, _, _ in pieces.elements())
        for source, epoch, sid, offset, n in pieces:
            # a plain text longer than the cap keeps its first cap tokens (the rest is dropped,
            # as max_document_tokens says); a conversation longer than it was skipped at read
            want = full[sid] if source == 0 else min(full[sid], plan.batch.document_cap)
            assert offset == 0 and n == want, (source, sid, offset, n, full[sid])
            assert seen[(source, epoch, sid)] == 1  # one piece: the whole document

    check()


def test_split_without_a_cap_at_seq_len_does_cut(corpus: tuple[Path, Path]) -> None:
    """The control: the same check fails where documents may be cut (so it can fail)."""
    root, tok = corpus
    for cap in (None, 600):  # no cap, or one above seq_len
        batch = {"seq_len": 300, "micro_batches": 2, "global_tokens": 900}
        if cap:
            batch["max_document_tokens"] = cap
        plan = _plan(root, tok, batch=batch, layout={"dp": 2})
        assert not plan.batch.whole_documents
        assert any(offset > 0 for _, _, _, offset, _ in _pieces(plan, 8))


def test_a_conversation_longer_than_the_cap_is_skipped_and_counted(
    corpus: tuple[Path, Path],
) -> None:
    root, tok = corpus
    batch = {"seq_len": 512, "micro_batches": 1, "global_tokens": 1024, "max_document_tokens": 120}
    plan = _plan(root, tok, batch=batch, layout={"dp": 2})
    plane = InlineDataPlane(plan)
    lengths = []
    for _, batches in plane.stream(6):
        for batch_ in batches.values():
            for mb in batch_.micro_batches:
                chat = mb["doc_source"] == 0
                lengths += np.diff(mb["cu_seqlens"])[chat].tolist()
                assert (mb["doc_offset"] == 0).all()
    assert lengths and max(lengths) <= 120
    assert sum(s.skipped for s in plane.shards.values()) > 0


def test_a_budget_below_the_cap_of_whole_documents_is_refused(
    corpus: tuple[Path, Path],
) -> None:
    root, tok = corpus
    batch = {"seq_len": 512, "global_tokens": 300, "max_document_tokens": 400}
    with pytest.raises(PlanError, match=r"batch\.global_tokens: must be >= max_document_tokens"):
        _plan(root, tok, batch=batch, layout={"dp": 1})

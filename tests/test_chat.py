"""Chat sources: token ids equal ``transformers``' ``apply_chat_template``, the train-on rules,
labels that survive packing, and bad conversations named or skipped and counted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from omniload_dask.batching.formats import IGNORE_INDEX
from omniload_dask.batching.wire import expand
from omniload_dask.demo.chat import CHATML_GENERATION
from omniload_dask.errors import JobError, PlanError, RecordError
from omniload_dask.plan import TokenizerSpec, parse_plan
from omniload_dask.plan.chat import ChatSpec
from omniload_dask.preprocess.chat_encode import encode_chats
from omniload_dask.sources.ids import decode_sample_id
from omniload_dask.testing import InlineDataPlane

from .chatdata import CHATML, conversations, write_chat_tokenizer
from .datagen import plan_dict, texts, write_jsonl

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def chat_tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tok")
    return {
        "chatml": write_chat_tokenizer(root / "chatml", CHATML),
        "generation": write_chat_tokenizer(root / "generation", CHATML_GENERATION),
    }


def _spec(path: Path) -> TokenizerSpec:
    return TokenizerSpec(kind="huggingface", path=str(path), add_bos=False, add_eos=False)


@pytest.mark.parametrize("which", ["chatml", "generation"])
def test_token_ids_equal_apply_chat_template(chat_tokenizers: dict[str, Path], which: str) -> None:
    path = chat_tokenizers[which]
    reference = transformers.AutoTokenizer.from_pretrained(str(path.parent))
    convs = conversations(60, seed=1)
    out = encode_chats(ChatSpec(), _spec(path), "chat", convs)
    assert out.bad == [] and len(out.kept) == len(convs)
    mismatches = 0
    for i, conv in enumerate(convs):
        ids = out.tokens[out.offsets[i] : out.offsets[i + 1]].tolist()
        want = reference.apply_chat_template(conv, tokenize=True, return_dict=True)["input_ids"]
        mismatches += ids != list(want)
    assert mismatches == 0


def test_generation_blocks_give_transformers_assistant_mask(
    chat_tokenizers: dict[str, Path],
) -> None:
    path = chat_tokenizers["generation"]
    reference = transformers.AutoTokenizer.from_pretrained(str(path.parent))
    convs = conversations(60, seed=2)
    out = encode_chats(ChatSpec(), _spec(path), "chat", convs)
    for i, conv in enumerate(convs):
        want = reference.apply_chat_template(
            conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )["assistant_masks"]
        got = out.target[out.offsets[i] : out.offsets[i + 1]].astype(int).tolist()
        assert got == list(want), i


def _decoded_targets(path: Path, chat: ChatSpec, conv: Any) -> str:
    from tokenizers import Tokenizer

    out = encode_chats(chat, _spec(path), "chat", [conv])
    assert out.bad == [], out.bad
    ids = out.tokens[out.target]
    return str(Tokenizer.from_file(str(path)).decode(ids.tolist(), skip_special_tokens=False))


CONV = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "the sea?"},
    {"role": "assistant", "content": "blue water"},
    {"role": "user", "content": "and the sun?"},
    {"role": "assistant", "content": "hot light"},
]


@pytest.mark.parametrize("which", ["chatml", "generation"])
def test_train_on_rules_pick_their_turns(chat_tokenizers: dict[str, Path], which: str) -> None:
    path = chat_tokenizers[which]
    assistant = _decoded_targets(path, ChatSpec(train_on="assistant"), CONV)
    assert "blue water<|im_end|>" in assistant and "hot light<|im_end|>" in assistant
    assert "sea" not in assistant and "assistant" not in assistant and "brief" not in assistant
    last = _decoded_targets(path, ChatSpec(train_on="last_assistant"), CONV)
    assert "hot light" in last and "blue" not in last
    every = _decoded_targets(path, ChatSpec(train_on="all"), CONV)
    assert all(w in every for w in ("brief", "sea", "blue water", "sun", "hot light"))
    everything = encode_chats(ChatSpec(train_on="everything"), _spec(path), "c", [CONV])
    assert everything.target.all()


def test_prompt_completion_trains_on_the_completion(chat_tokenizers: dict[str, Path]) -> None:
    path = chat_tokenizers["chatml"]
    chat = ChatSpec(layout="prompt_completion", field="prompt", train_on="completion")
    plain = {"prompt": "the sea is ", "completion": "blue water"}
    assert _decoded_targets(path, chat, plain).strip() == "blue water"
    turns = {"prompt": CONV[1:2], "completion": CONV[2:3]}
    assert _decoded_targets(path, chat, turns) == "blue water<|im_end|>\n"
    spec = TokenizerSpec(kind="byte")  # BOS/EOS as the plan adds them, the EOS a target
    out = encode_chats(chat, spec, "pc", [{"prompt": "ab", "completion": "cd"}])
    assert out.tokens.tolist() == [256, 97, 98, 99, 100, 257]
    assert out.target.tolist() == [False, False, False, True, True, True]


# -- through the data plane: labels of every micro-batch against the unpacked conversations --


def _write_chat_sources(root: Path, n: int = 80) -> list[list[dict[str, str]]]:
    convs = conversations(n, seed=5)
    half = n // 2
    lines = [json.dumps({"messages": c}) for c in convs[:half]]
    (root / "chat").mkdir(parents=True)
    (root / "chat" / "a.jsonl").write_text("\n".join(lines) + "\n")
    sharegpt = [
        [{"from": {"user": "human", "assistant": "gpt"}.get(t["role"], t["role"]),
          "value": t["content"]} for t in c]
        for c in convs[half:]
    ]  # fmt: skip
    table = pa.table({"conversations": sharegpt})
    (root / "sg").mkdir()
    pq.write_table(table, root / "sg" / "b.parquet", row_group_size=16)
    write_jsonl(root / "plain" / "c.jsonl", texts(60, seed=6, mean_words=30))
    return convs


def _chat_plan(root: Path, tok: Path, **overrides: Any) -> Any:
    sources = [
        {"name": "chat", "format": "jsonl", "path": str(root / "chat"), "weight": 2,
         "chat": {"layout": "messages"}},
        {"name": "sg", "format": "parquet", "path": str(root / "sg"), "weight": 1,
         "chat": {"layout": "sharegpt"}},
        {"name": "plain", "format": "jsonl", "path": str(root / "plain"), "weight": 1},
    ]  # fmt: skip
    tokenizer = {"kind": "huggingface", "path": str(tok), "add_bos": False, "add_eos": False}
    return parse_plan(plan_dict(sources, tokenizer=tokenizer, **overrides))


def reference_documents(
    root: Path, tok: Path, convs: list[Any]
) -> dict[tuple[int, int], tuple[list[int], list[bool]]]:
    """Each record's tokens and target mask, by (source, offset), from ``transformers`` (chat)
    and ``tokenizers`` (plain text): what the labels must follow from."""
    reference = transformers.AutoTokenizer.from_pretrained(str(tok.parent))
    out: dict[tuple[int, int], tuple[list[int], list[bool]]] = {}
    data = (root / "chat" / "a.jsonl").read_bytes()
    offset = 0
    for line in data.splitlines(keepends=True):
        conv = json.loads(line)["messages"]
        got = reference.apply_chat_template(
            conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        out[(0, offset)] = (list(got["input_ids"]), [bool(m) for m in got["assistant_masks"]])
        offset += len(line)
    for row, conv in enumerate(convs[len(convs) // 2 :]):
        got = reference.apply_chat_template(
            conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        out[(1, row)] = (list(got["input_ids"]), [bool(m) for m in got["assistant_masks"]])
    offset = 0
    for line in (root / "plain" / "c.jsonl").read_bytes().splitlines(keepends=True):
        ids = reference(json.loads(line)["text"], add_special_tokens=False)["input_ids"]
        out[(2, offset)] = (list(ids), [True] * len(ids))
        offset += len(line)
    return out


def reference_labels(mb: dict[str, Any], docs: dict[Any, Any]) -> np.ndarray:
    """A micro-batch's labels computed piece by piece from the unpacked documents: the next
    token where it is a target and inside the piece, else -100."""
    width = len(mb["input_ids"])
    labels = np.full(width, IGNORE_INDEX, dtype=np.int64)
    cu = np.asarray(mb["cu_seqlens"])
    for j, (sid, lo) in enumerate(
        zip(mb["doc_id"].tolist(), mb["doc_offset"].tolist(), strict=True)
    ):
        source, _, offset = decode_sample_id(sid)
        ids, target = docs[(source, offset)]
        n = int(cu[j + 1] - cu[j])
        for k in range(n - 1):
            if target[lo + k + 1]:
                labels[cu[j] + k] = ids[lo + k + 1]
    return labels


def _check_step_labels(plane: InlineDataPlane, steps: int, docs: dict[Any, Any]) -> int:
    checked = 0
    for _, batches in plane.stream(steps):
        for batch in batches.values():
            for mb in batch.micro_batches:
                full = expand(mb)
                want = reference_labels(full, docs)
                assert np.array_equal(full["labels"], want)
                assert full["num_loss_tokens"] == int((want != IGNORE_INDEX).sum())
                checked += 1
    return checked


def test_labels_follow_the_conversations_through_packing(
    tmp_path: Path, chat_tokenizers: dict[str, Path]
) -> None:
    tok = chat_tokenizers["generation"]
    convs = _write_chat_sources(tmp_path)
    docs = reference_documents(tmp_path, tok, convs)
    plan = _chat_plan(tmp_path, tok, batch={"long_documents": "truncate", "seq_len": 512})
    assert _check_step_labels(InlineDataPlane(plan), 4, docs) > 0
    # split: conversations cut between micro-batches and steps keep their masks
    plan = _chat_plan(tmp_path, tok, batch={"seq_len": 64, "global_tokens": 256})
    assert _check_step_labels(InlineDataPlane(plan), 6, docs) > 0


# -- bad input --


def _bad_plan(root: Path, chat: dict[str, Any], on_error: str) -> Any:
    sources = [{"name": "chat", "format": "jsonl", "path": str(root), "chat": chat}]
    return parse_plan(
        plan_dict(
            sources,
            on_error=on_error,
            layout={"dp": 1},
            batch={"long_documents": "truncate", "seq_len": 512, "global_tokens": 512},
        )
    )


ROLE_CHECK = (
    "{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
)
FAILS_ON_BOOM = (
    "{% if messages[0]['content'] == 'boom' %}{{ messages.x.y() }}{% endif %}" + ROLE_CHECK
)
NOT_A_PREFIX = "{% if messages | length > 2 %}{{ messages | length }}{% endif %}" + ROLE_CHECK


@pytest.mark.parametrize(
    ("record", "chat", "reason"),
    [
        ({"text": "x"}, {}, "no field 'messages'"),
        ({"messages": [{"role": "critic", "content": "x"}]}, {"template": ROLE_CHECK},
         "unknown role critic"),
        ({"messages": [{"role": "user", "content": "boom"}]}, {"template": FAILS_ON_BOOM},
         "the chat template fails"),
        ({"messages": [{"role": "user", "content": "only a question"}]},
         {"template": ROLE_CHECK}, "no target token"),
        ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}] * 2},
         {"template": NOT_A_PREFIX}, "is not the start of its rendering"),
        ({"messages": [{"role": "user", "content": "q" * 600},
                       {"role": "assistant", "content": "a"}]},
         {"template": ROLE_CHECK}, "longer than the plan allows"),
    ],
)  # fmt: skip
def test_bad_conversations_are_named_or_skipped_and_counted(
    tmp_path: Path, record: dict[str, Any], chat: dict[str, Any], reason: str
) -> None:
    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    lines = [good] * 3 + [record] + [good] * 3
    if "messages" not in record:  # (the first record names the field the source reads)
        lines = [good, record] + [good] * 3
    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    chat = {"template": ROLE_CHECK, **chat}
    with pytest.raises((RecordError, JobError), match=reason) as caught:
        InlineDataPlane(_bad_plan(tmp_path, chat, "raise")).step(0)
    assert "source 'chat'" in str(caught.value) and "a.jsonl" in str(caught.value)
    assert "record at offset" in str(caught.value)
    plane = InlineDataPlane(_bad_plan(tmp_path, chat, "skip"))
    batch = plane.step(0)[0]
    assert sum(len(mb["doc_id"]) for mb in batch.micro_batches) >= 1
    shards = list(plane.shards.values())
    assert shards and all(s.skipped == 1 for s in shards)  # (one read of the file an epoch)
    assert any(reason in b for s in shards for b in s.bad)


def test_chat_plan_fields_are_checked() -> None:
    base = {"name": "c", "format": "jsonl", "path": "/data/*.jsonl"}
    with pytest.raises(PlanError, match=r"sources\[0\]\.chat\.train_on: must be one of"):
        parse_plan(plan_dict([{**base, "chat": {"train_on": "assistants"}}]))
    with pytest.raises(PlanError, match=r"chat\.train_on: only applies to layout"):
        parse_plan(plan_dict([{**base, "chat": {"train_on": "completion"}}]))
    with pytest.raises(PlanError, match=r"chat\.lay: unknown field"):
        parse_plan(plan_dict([{**base, "chat": {"lay": "messages"}}]))
    with pytest.raises(PlanError, match=r"sources\[0\]\.text: a chat source names"):
        parse_plan(plan_dict([{**base, "text": "body", "chat": {}}]))
    plan = parse_plan(plan_dict([{**base, "chat": {}}], batch={"long_documents": "truncate"}))
    assert plan.sources[0].chat == ChatSpec(max_tokens=256)
    again = parse_plan(plan.to_dict())
    assert again.sources[0].chat == plan.sources[0].chat


# -- every path, by property: whole/cut/continued pieces, cp slices, wire and full forms --


@pytest.fixture(scope="module")
def chat_corpus(
    tmp_path_factory: pytest.TempPathFactory, chat_tokenizers: dict[str, Path]
) -> tuple[Path, Path, dict[Any, Any]]:
    root = tmp_path_factory.mktemp("corpus")
    tok = chat_tokenizers["generation"]
    convs = _write_chat_sources(root, 60)
    return root, tok, reference_documents(root, tok, convs)


def test_labels_equal_the_unpacked_reference_on_every_path(
    chat_corpus: tuple[Path, Path, dict[Any, Any]],
) -> None:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from omniload_dask.batching.context_parallel import zigzag_index

    root, tok, docs = chat_corpus

    @settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        seq_len=st.sampled_from([48, 96, 300]),
        truncate=st.booleans(),
        dp=st.integers(1, 2),
        cp=st.integers(1, 2),
        micro=st.integers(1, 2),
        seed=st.integers(0, 50),
    )
    def check(seq_len: int, truncate: bool, dp: int, cp: int, micro: int, seed: int) -> None:
        if truncate and seq_len < 300:
            seq_len = 300  # (whole conversations: shorter ones would all be skipped)
        batch = {"seq_len": seq_len, "micro_batches": micro, "global_tokens": seq_len * micro * dp}
        if truncate:
            batch["long_documents"] = "truncate"
        plan = _chat_plan(root, tok, batch=batch, layout={"dp": dp, "cp": cp}, seed=seed,
                          on_error="skip")  # fmt: skip
        plane = InlineDataPlane(plan)
        for step in range(3):
            refs = plane.fetch(step)
            for rank, ref in refs.items():
                group = plan.layout.coords(rank)["dp"]
                whole = plane.wholes[(ref.rsplit(":", 1)[0], step, group)]
                part = plane.batches[ref]
                for mb, got in zip(whole.micro_batches, part.micro_batches, strict=True):
                    full = expand(mb)
                    want = reference_labels(full, docs)
                    assert np.array_equal(full["labels"], want)
                    if cp > 1:  # the slice holds the labels of its own positions
                        index, _ = zigzag_index(full["cu_seqlens"], cp, got["cp_rank"])
                        n = len(index)
                        assert np.array_equal(got["labels"][:n], want[index])
                        assert got["num_loss_tokens"] == int((want[index] != -100).sum())
                    else:
                        assert np.array_equal(expand(got)["labels"], want)

    check()


def test_resume_gives_the_same_labels(tmp_path: Path, chat_tokenizers: dict[str, Path]) -> None:
    from omniload_dask.testing import check_resume_equivalence

    _write_chat_sources(tmp_path)
    plan = _chat_plan(
        tmp_path,
        chat_tokenizers["generation"],
        batch={"seq_len": 64, "global_tokens": 256},
        checkpoint={"url": str(tmp_path / "ckpt"), "compact_every": 3},
    )
    assert check_resume_equivalence(plan, 6, [2, 4]) > 0


def test_the_sft_plan_mixes_chat_pairs_and_text() -> None:
    from omniload_dask.plan import load_plan
    from omniload_dask.preprocess.chat_encode import target_notes

    plan = load_plan(Path(__file__).parent.parent / "plans" / "sft.yaml")
    notes = target_notes(plan.sources, plan.tokenizer, load=True)
    assert [n.split(" trains on ")[1].split(":")[0] for n in notes] == [
        "assistant",
        "completion",
        "plain text",
    ]
    chat = plan.sources[0].chat
    assert chat is not None and chat.max_tokens == plan.batch.seq_len


def test_the_sft_plan_runs_from_the_command_line_as_the_docs_show() -> None:
    import json
    import subprocess
    import sys

    plan = Path(__file__).parent.parent / "plans" / "sft.yaml"
    proc = subprocess.run(
        [sys.executable, "-m", "omniload_dask.cli", "run", str(plan), "--make-demo-data",
         "--steps", "3", "--workers", "1", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report["steps"] == 3 and report["tokens"] > 0
    assert [s["name"] for s in report["sources"]] == ["chat", "qa", "web"]

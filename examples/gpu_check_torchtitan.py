"""Check examples/train_torchtitan.py on a GPU: an uninterrupted run, a killed one, its resume.

    python examples/gpu_check_torchtitan.py --steps 30 --kill-after 15 --out runs/titan-check

Runs ``torchrun --nproc-per-node 1 examples/train_torchtitan.py`` three times: N steps straight
through; the same killed (SIGKILL) right after its checkpoint of step K; and again in the
killed run's folder, which resumes from torchtitan's checkpoint. Further arguments go to every
run as torchtitan overrides (``--model.flavor debugmodel`` for plain SDPA under torchtitan 0.2). It prints one PASS or FAIL
line per check and a final ``RESULT {json}`` line: the loss at the first and last step, whether
the batches after the resume equal the uninterrupted run's, whether the validator ran and gave
the same validation batches every pass. Exit status 0 only when every check passes.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def environment() -> dict[str, str]:
    """This process's environment with the repository first on ``PYTHONPATH`` (the paths
    already there, where torchtitan may be installed, kept after it)."""
    paths = [str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def titan_version() -> tuple[int, ...]:
    """The installed torchtitan's release (0.2 and 0.3 name the validator's section apart)."""
    from omniload_dask.integrations.versions import parse_version

    return parse_version(importlib.metadata.version("torchtitan"))


def run(out: Path, steps: int, every: int, extra: list[str], timeout: float) -> int:
    """One run of the example into ``out`` (its record in ``out/record.jsonl``)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--standalone"]
    cmd += [str(REPO / "examples" / "train_torchtitan.py"), "--out", str(out)]
    cmd += ["--record", str(out / "record.jsonl"), "--training.steps", str(steps)]
    validation = "validation" if titan_version() < (0, 3) else "validator"  # 0.2's name
    cmd += ["--checkpoint.interval", str(every), f"--{validation}.freq", str(every), *extra]
    env = environment()
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "log.txt", "a") as log:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=log, timeout=timeout)
    print(f"run {out.name} {' '.join(extra)}: exit {proc.returncode}", flush=True)
    return proc.returncode


def lines(out: Path) -> list[dict[str, Any]]:
    path = out / "record.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def of(record: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [x for x in record if x["kind"] == kind]


def passes(record: list[dict[str, Any]]) -> list[list[str]]:
    """The validation digests, one list per pass (a pass starts at step 0, micro_step 0)."""
    out: list[list[str]] = []
    for x in of(record, "validation"):
        if x["step"] == 0 and x["micro_step"] == 0:
            out.append([])
        out[-1].append(x["digest"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kill-after", type=int, default=15)
    parser.add_argument("--every", type=int, default=5, help="checkpoint and validation interval")
    parser.add_argument("--out", default="runs/titan-check")
    parser.add_argument("--timeout", type=float, default=300)
    args, titan_args = parser.parse_known_args()  # the rest go to every run (torchtitan's)
    root = Path(args.out).resolve()
    shutil.rmtree(root, ignore_errors=True)
    subprocess.run(
        [sys.executable, "-m", "omniload_dask.cli", "demo-data", "plans/demo-data"],
        cwd=REPO,
        env=environment(),
        check=True,
    )
    n, k, every = args.steps, args.kill_after, args.every
    straight, resumed = root / "uninterrupted", root / "resumed"
    codes = [run(straight, n, every, titan_args, args.timeout)]
    kill = ["--kill-after-step", str(k), *titan_args]
    codes.append(run(resumed, n, every, kill, args.timeout))
    killed_part = lines(resumed)
    codes.append(run(resumed, n, every, titan_args, args.timeout))
    whole, both = lines(straight), lines(resumed)
    after = both[len(killed_part) :]
    digests = [(x["step"], x["micro_step"], x["digest"]) for x in of(whole, "train")]
    losses = {x["step"]: x["loss"] for x in of(whole, "loss")}
    resumed_losses = {x["step"]: x["loss"] for x in of(after, "loss")}
    after_train = [(x["step"], x["micro_step"], x["digest"]) for x in of(after, "train")]
    starts = [x["step"] for x in of(after, "start")]
    val_passes = passes(whole) + passes(both)
    checks = {
        "uninterrupted run exits 0": codes[0] == 0,
        "killed run dies by SIGKILL after step K": codes[1] != 0
        and [x["step"] for x in of(killed_part, "killed")] == [k],
        "resumed run exits 0": codes[2] == 0,
        "resume starts after step K": starts == [k],
        "uninterrupted run trained every step": sorted(losses) == list(range(1, n + 1)),
        "loss falls": bool(losses) and losses[max(losses)] < losses[min(losses)],
        "batches after resume equal the uninterrupted run's": bool(after_train)
        and after_train == [d for d in digests if d[0] >= k],
        "resumed run trained steps K+1..N": sorted(resumed_losses) == list(range(k + 1, n + 1)),
        "validator ran": bool(of(whole, "val_loss")) and bool(of(after, "val_loss")),
        "validation batches equal on every pass": len(val_passes) > 1
        and all(p == val_passes[0] for p in val_passes),
    }
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'} {name}", flush=True)
    gaps = [abs(resumed_losses[s] - losses[s]) for s in resumed_losses if s in losses]
    result = {
        "steps": n,
        "kill_after": k,
        "loss_first": losses.get(1),
        "loss_last": losses.get(n),
        "batches_equal_after_resume": checks["batches after resume equal the uninterrupted run's"],
        "micro_batches_compared": len(after_train),
        "max_loss_gap_after_resume": max(gaps) if gaps else None,
        "validator_ran": checks["validator ran"],
        "validation_passes": len(val_passes),
        "val_loss_last": of(whole, "val_loss")[-1]["loss"] if of(whole, "val_loss") else None,
        "passed": all(checks.values()),
    }
    print("RESULT " + json.dumps(result), flush=True)
    sys.exit(0 if result["passed"] else 1)


if __name__ == "__main__":
    main()

"""Helpers for the framework examples' tests: run an example under torchrun, read what each
rank trained on, and the stream an uninterrupted run gives (straight from feeders)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PLAN = REPO / "plans" / "tiny_trainers.yaml"


def torchrun(example: str, *args: str, nproc: int = 2, timeout: float = 400) -> Any:
    """``torchrun --nproc-per-node N examples/EXAMPLE ARGS`` from the repository root."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    cmd += ["--standalone", str(REPO / "examples" / example), *args]  # a free port
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def losses(stdout: str) -> list[float]:
    """The losses an example printed as ``step N loss X``."""
    return [float(x) for x in re.findall(r"^step \d+ loss (\d+\.\d+)", stdout, flags=re.M)]


def eval_losses(stdout: str) -> list[float]:
    """The evaluation losses an example printed as ``step N eval_loss X``."""
    return [float(x) for x in re.findall(r"^step \d+ eval_loss (\d+\.\d+)", stdout, flags=re.M)]


def recorded(
    folder: Path, ranks: int = 2, name: str = "rank"
) -> dict[int, list[tuple[int, int, str]]]:
    """Per rank, the (step, micro_step, digest) of each micro-batch it trained on (``name``
    "eval-rank": evaluated on), in order."""
    out = {}
    for rank in range(ranks):
        lines = (folder / f"{name}{rank}.jsonl").read_text().splitlines()
        out[rank] = [
            (r["step"], r["micro_step"], r["digest"]) for r in (json.loads(x) for x in lines)
        ]
    return out


def digest(mb: dict[str, Any]) -> str:
    """The examples' digest of a micro-batch (its tokens and targets)."""
    return hashlib.sha1(
        mb["input_ids"].numpy().tobytes() + mb["labels"].numpy().tobytes()
    ).hexdigest()


def uninterrupted(steps: int, dp: int = 2) -> dict[int, list[tuple[int, int, str]]]:
    """Per DP rank, every micro-batch of steps ``0..steps-1`` as one run reads them."""
    from omniload_dask import Job, load_plan

    out: dict[int, list[tuple[int, int, str]]] = {r: [] for r in range(dp)}
    with Job.start(load_plan(PLAN), dp=dp, dashboard_address=None) as job:
        feeders = [job.feeder(dp_rank=r, max_steps=steps) for r in range(dp)]
        iters = [f.steps() for f in feeders]
        for _ in range(steps):  # rank by rank within a step: no rank runs far ahead
            for rank, it in enumerate(iters):
                for mb in next(it):
                    out[rank].append((int(mb["step"]), int(mb["micro_step"]), digest(mb)))
    return out

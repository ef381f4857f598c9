"""Helpers for the framework examples' tests: run an example under torchrun, read what each
rank trained on, and the stream an uninterrupted run gives (straight from feeders)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
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


@dataclass(frozen=True)
class KilledAndResumed:
    """A run killed after its step-2 checkpoint, and the run that resumed from it."""

    killed: Any
    resumed: Any
    first: Path  # the killed run's per-rank records
    second: Path  # the resumed run's


def kill_and_resume(example: str, tmp_path: Path, checkpoint: str) -> KilledAndResumed:
    """Run ``example`` for 5 steps, killed after the checkpoint of step 2 (``checkpoint``, a
    path under ``--out``, must exist then), resume it, and check what every framework's
    example must give: each rank trained steps 0-1 and then 2-4 as an uninterrupted run reads
    them (none skipped or repeated), and 5 losses that fall."""
    from omniload_dask.demo import make_demo_data

    make_demo_data(REPO / "plans" / "demo-data")
    out, first, second = tmp_path / "out", tmp_path / "rec1", tmp_path / "rec2"
    common = ["--out", str(out), "--steps", "5", "--save-steps", "2"]
    killed = torchrun(example, *common, "--record", str(first), "--kill-after-step", "2")
    assert killed.returncode != 0, killed.stdout[-2000:]  # rank 0 was killed
    assert "killing rank 0 after step 2" in killed.stdout, killed.stderr[-3000:]
    assert (out / checkpoint).exists()
    resumed = torchrun(example, *common, "--record", str(second), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    before, after, reference = recorded(first), recorded(second), uninterrupted(5)
    for rank in (0, 1):
        # rank 1 may start step 2 before rank 0's kill stops the world: not in the checkpoint
        assert [b for b in before[rank] if b[0] < 2] == reference[rank][:4]
        assert after[rank] == reference[rank][4:]
    all_losses = losses(killed.stdout) + losses(resumed.stdout)
    assert len(all_losses) == 5
    assert all_losses[-1] < all_losses[0]
    return KilledAndResumed(killed, resumed, first, second)

"""Run a plan with simulated trainer ranks and report what was delivered (``omniload run``).

Every rank of the plan's layout gets a Feeder on a thread of this process; they consume as fast
as they can (no model), which measures the loader, not a trainer. The report shows steps,
delivered tokens/s, the realised share per source against its target, the balance efficiency
per step (mean/max of the DP groups' costs) and the records skipped; each term it uses is
explained on its line (or in the legend under the sources' table).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omniload_dask.cluster.job import Job
from omniload_dask.plan import Plan

__all__ = ["RunReport", "format_report", "run_plan"]


@dataclass
class RunReport:
    """What ``omniload run`` measured (``--json`` prints :meth:`to_dict`).

    Times are seconds from the start of :func:`run_plan`; ``tokens`` counts each DP group's
    batches once; ``sources`` holds each source's realised and target share over the run.
    """

    plan_name: str
    steps: int
    ranks: int
    seconds: float
    startup_seconds: float
    first_batch_seconds: float
    tokens: int
    tokens_per_second: float
    wait_p50_ms: float
    wait_p99_ms: float
    sources: list[dict[str, Any]] = field(default_factory=list)
    efficiency: list[float] = field(default_factory=list)
    extra_micro_steps: int = 0
    fill: float = 0.0
    documents_cut: int = 0
    padding_share: float = 0.0  # empty positions of the micro-batches over their capacity

    def to_dict(self) -> dict[str, Any]:
        """The report as plain data (JSON-able)."""
        return dict(vars(self))


def run_plan(
    plan: Plan,
    *,
    steps: int,
    address: str | None = None,
    workers: int | None = None,
    progress: bool = True,
    job: Job | None = None,
    resume: bool = False,
    security: Any = None,
) -> RunReport:
    """Start (or use) the plan's job, drive all its ranks for ``steps`` steps, report
    (``security``: as :meth:`Job.start`'s)."""
    t0 = time.perf_counter()
    own = job is None
    if job is None:
        job = Job.start(
            plan, address=address, workers=workers, resume=resume or None, security=security
        )
    started = time.perf_counter() - t0
    try:
        return _drive(job, steps, t0, started, progress)
    finally:
        if own:
            job.close()


def _drive(job: Job, steps: int, t0: float, started: float, progress: bool) -> RunReport:
    """One thread per rank consumes ``steps`` steps; then the figures of those steps."""
    layout = job.plan.layout
    ranks = layout.world_size
    first_step = int(job.info.get("start_step") or 0)
    feeders = [
        job.feeder(rank=r, max_steps=first_step + steps, output="numpy") for r in range(ranks)
    ]
    tokens = np.zeros(ranks, dtype=np.int64)
    first: list[float] = []
    errors: list[BaseException] = []
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=steps, unit="step", desc=f"omniload {job.name}", leave=True)

    def consume(r: int) -> None:
        try:
            for mb in feeders[r]:
                if not first:
                    first.append(time.perf_counter() - t0)
                tokens[r] += int(mb["num_tokens"])
                if r == 0 and bar is not None and mb["micro_step"] == mb["num_micro_steps"] - 1:
                    bar.update(1)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=consume, args=(r,), daemon=True) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    if errors:
        raise errors[0]
    waits = np.concatenate([np.asarray(f.waits) for f in feeders]) if feeders else np.zeros(1)
    warm = waits[len(waits) // 10 :] if len(waits) > 10 else waits
    stats = job.stats()
    figures = [f for f in job.steps() if first_step <= f["step"] < first_step + steps]
    # Realised and target shares over the steps of this run (targets may follow a schedule).
    n = len(stats["sources"])
    by_tokens = job.plan.mixing_by == "tokens"
    got = np.zeros(n)
    target = np.zeros(n)
    for f in figures:
        amounts = f["source_tokens"] if by_tokens else f["source_documents"]
        got[: len(amounts)] += amounts
        target[: len(f["target"])] += f["target"]
    got = got / got.sum() if got.sum() else got
    target = target / target.sum() if target.sum() else target
    sources = []
    for i, s in enumerate(stats["sources"]):
        sources.append(
            {
                "name": s["name"],
                "target_share": float(target[i]),
                "realised_share": float(got[i]),
                "skipped": s["skipped"],
                "filtered": s.get("filtered", 0),
                "truncated_tokens": s["truncated_tokens"],
                "epoch": s["epoch"],
                "bad_examples": list(s.get("bad_examples") or [])[:2],
            }
        )
    # Each DP group's batch counts once: its tp/pp peers share it, its cp ranks split it.
    leaders = [r for r in range(ranks) if layout.coords(r)["tp"] == layout.coords(r)["pp"] == 0]
    delivered = int(tokens[leaders].sum())
    return RunReport(
        plan_name=job.name,
        steps=steps,
        ranks=ranks,
        seconds=elapsed,
        startup_seconds=started,
        first_batch_seconds=first[0] if first else float("nan"),
        tokens=delivered,
        tokens_per_second=delivered / elapsed if elapsed else 0.0,
        wait_p50_ms=float(np.percentile(warm, 50) * 1e3),
        wait_p99_ms=float(np.percentile(warm, 99) * 1e3),
        sources=sources,
        efficiency=[float(f["efficiency"]) for f in figures],
        extra_micro_steps=int(stats["extra_micro_steps"]),
        documents_cut=int(stats["documents_cut"]),
        fill=stats["tokens"] / stats["capacity_tokens"] if stats["capacity_tokens"] else 0.0,
        padding_share=float(stats.get("padding_share") or 0.0),
    )


def format_report(r: RunReport) -> str:
    """The report as aligned text."""
    eff = np.asarray(r.efficiency) if r.efficiency else np.ones(1)
    lines = [
        f"omniload run report: plan {r.plan_name!r}",
        f"  steps               {r.steps} ({r.ranks} ranks)",
        f"  wall time           {r.seconds:.2f} s (start-up {r.startup_seconds:.2f} s, "
        f"first batch at {r.first_batch_seconds:.2f} s)",
        f"  delivered tokens    {r.tokens:,} ({r.tokens_per_second:,.0f} tokens/s)",
        f"  feeder wait         p50 {r.wait_p50_ms:.3f} ms, p99 {r.wait_p99_ms:.3f} ms",
        f"  balance efficiency  mean {eff.mean():.4f}, min {eff.min():.4f} "
        "(mean/max of the ranks' step costs; 1 = none waits)",
        "  per step efficiency "
        + " ".join(f"{e:.3f}" for e in r.efficiency[:12])
        + (" ..." if len(r.efficiency) > 12 else ""),
        f"  capacity used       {r.fill:.1%} of dp x micro-batches x seq_len (the rest: empty room)",
        f"  extra micro-steps   {r.extra_micro_steps} (micro-batches a step needed beyond the "
        "plan's micro_batches)",
        f"  documents cut       {r.documents_cut} (split to fill micro-batches or even out ranks; "
        "pieces go on, same doc_id)",
        f"  padding share       {r.padding_share:.2%} (positions of the micro-batches left empty)",
        "",
        f"  {'source':<16}{'target':>8}{'realised':>10}{'skipped':>9}{'filtered':>10}"
        f"{'truncated':>11}{'epoch':>7}",
    ]
    legend = (
        "  (target, realised: shares of the mix; skipped: bad records, on_error: skip;\n"
        "   filtered: records a source's filter or transform dropped;\n"
        "   truncated: tokens cut off, long_documents: truncate; epoch: passes over the source)"
    )
    for s in r.sources:
        lines.append(
            f"  {s['name']:<16}{s['target_share']:>8.1%}{s['realised_share']:>10.1%}"
            f"{s['skipped']:>9}{s['filtered']:>10}{s['truncated_tokens']:>11}{s['epoch']:>7}"
        )
    lines.append(legend)
    for s in r.sources:
        for example in s["bad_examples"]:
            lines.append(f"  skipped ({s['name']}): {example}")
    return "\n".join(lines)

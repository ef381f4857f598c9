"""Where the time from ``Job.start`` to the first batch goes, on the README cluster.

``watch_tasks(address)`` registers Dask's task-stream plugin on the scheduler before the job
starts (it records each task's compute start and stop on its worker);
``first_batch_timeline(address, t_launch, marks, firsts)`` then reads it back after every rank
has its first batch and puts it on one clock with the ranks' own marks (``go``, the job
started, the loader ready, the first batch: ``time.monotonic`` in each rank, one clock on one
host). Every figure is seconds after the driver sent GO to rank 0 (``t_launch``)::

    job_started        Job.start returned in rank 0 (client, plugin, discovery, coordinator)
    loaders_ready      the last rank's Feeder was constructed (its link to the scheduler)
    discover           first start .. last stop of the discovery tasks
    tokenizer_check    the task that checks the plan's tokenizer (discovery waits for it; a plan of
                       token sources only reads its vocabulary, a text plan loads it)
    first_read         the first read task's compute start .. stop (its worker)
    reads_before_block reads that finished before the first batch task started
    first_block        the first batch task's compute start .. stop
    first_batch        the first rank's first batch .. the last rank's

Only the benchmark reads it (``--breakdown``): the plugin costs the scheduler a little per task.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["first_batch_timeline", "watch_tasks"]


def watch_tasks(address: str) -> None:
    """Start Dask's task stream on the scheduler at ``address`` (it stays for the run)."""
    from distributed import Client

    with Client(address, timeout=60) as client:
        client.get_task_stream()  # (the scheduler adds its TaskStreamPlugin on the first ask)


def first_batch_timeline(
    address: str, t_launch: float, marks: list[dict[str, float]], firsts: list[float]
) -> dict[str, Any]:
    """The breakdown described in the module docstring (seconds after ``t_launch``)."""
    from distributed import Client

    offset = time.time() - time.monotonic()  # task stream: wall clock; ranks: monotonic
    with Client(address, timeout=60) as client:
        stream = client.get_task_stream()

    def at(t: float) -> float:
        return round(t - offset - t_launch, 3)

    def span(kind: str) -> list[tuple[float, float, str]]:
        out = []
        for task in stream:
            key = str(task.get("key", ""))
            if not key.startswith(f"omniload-{kind}-"):
                continue
            compute = [s for s in task.get("startstops", ()) if s.get("action") == "compute"]
            if compute:
                out.append((compute[0]["start"], compute[0]["stop"], key))
        return sorted(out)

    out: dict[str, Any] = {}
    job = [m["job_started"] for m in marks if "job_started" in m]
    if job:
        out["job_started"] = round(job[0] - t_launch, 3)
    ready = [m["loader_ready"] for m in marks if "loader_ready" in m]
    if ready:
        out["loaders_ready"] = [round(min(ready) - t_launch, 3), round(max(ready) - t_launch, 3)]
    discover, reads, blocks = span("discover"), span("read"), span("batch")
    if discover:
        out["discover"] = [at(discover[0][0]), at(max(s[1] for s in discover))]
    tokenizer = span("tokenizer")  # (discovery waits for it too: the plan's tokenizer, loaded)
    if tokenizer:
        out["tokenizer_check"] = [at(tokenizer[0][0]), at(tokenizer[0][1])]
    if reads:
        out["first_read"] = [at(reads[0][0]), at(reads[0][1])]
    if blocks:
        first = blocks[0]
        out["reads_before_block"] = sum(1 for r in reads if r[1] <= first[0])
        out["reads_total"] = len(reads)
        out["first_block"] = [at(first[0]), at(first[1])]
        out["first_block_key"] = first[2]
    out["first_batch"] = [round(min(firsts) - t_launch, 3), round(max(firsts) - t_launch, 3)]
    return out

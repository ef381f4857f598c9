"""``omniload status``: a compact, live terminal view of running jobs (the page's figures).

It asks the data plane for ``stats()`` (one RPC per job and refresh) and prints::

    omniload job quickstart · run 1a2b3c4d · running · up 41 s · 2 workers · checkpoint: none yet
      steps drawn 230 · every rank past step 228 · 5.10 steps/s · tokens drawn 1.21M
      balance efficiency last 0.9981 · mean 0.9912 · min 0.9520 · capacity used 97.1%

      source    target realised epoch  documents     tokens  records/s  tokens/s  reading/held  window  skipped
      web        50.0%    49.8%     0      1,234    951,032      126.8     20.8k           0/3       3        0

      ranks: 1 fetching, 0 idle, 0 not started
      rank   step  buffered  wait p50  wait p99  last request
         0    228       1/2   0.02 ms   1.90 ms  0.1 s ago

Rates are the data plane's own, over its last 10 s of events, so ``--once`` shows them too.
A rank whose feeder has not asked for a batch for :data:`IDLE_AFTER` seconds is *idle*: its
feeder finished (``max_steps``), was closed, or its trainer pauses; a rank that never asked is
*not started*. ``omniload jobs`` prints one line per job (:func:`format_jobs`)::

    job         state      step    drawn  ranks               age
    quickstart  running     228      236  4/4 fetching        41 s
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from omniload_dask.errors import JobError
from omniload_dask.internals import comms as _comms
from omniload_dask.observe.formatting import (
    checkpoint_text,
    efficiency_text,
    fetched_text,
    format_si,
    held_back_text,
    milliseconds,
)

__all__ = [
    "IDLE_AFTER",
    "connect",
    "format_jobs",
    "format_status",
    "job_state",
    "job_stats",
    "rank_states",
    "watch",
]

MAX_RANK_ROWS = 8
IDLE_AFTER = 10.0  # seconds without a request after which a rank's feeder counts as idle


def connect(address: str, timeout: float, security: Any = None) -> Any:
    """A client of the scheduler at ``address`` (``security``: a ``distributed.Security``;
    None: Dask's config); JobError naming the address if unreachable or refused."""
    from distributed import Client

    try:
        _comms.probe_scheduler(address, timeout, security)
    except (ValueError, TypeError) as exc:
        raise JobError(f"not a scheduler address: {address!r} ({exc})") from None
    except (OSError, TimeoutError) as exc:
        raise JobError(
            f"cannot reach a Dask scheduler at {address!r} within {timeout:g} s: {exc}"
        ) from None
    return Client(address, timeout=timeout, security=security, set_as_default=False)


def job_stats(client: Any, job: str | None, address: str) -> list[dict[str, Any]]:
    """``stats()`` of job ``job``, or of every job when None (errors name what is wrong)."""
    jobs = _comms.call(client, "jobs")
    if jobs is None:  # Dask answers None for a handler it does not have
        raise JobError(
            f"the scheduler at {address!r} runs no omniload data plane: start a job there "
            "(Job.start) or run it with `dask scheduler --preload omniload_dask.preload`"
        )
    if job is not None:
        if job not in jobs:
            have = ", ".join(jobs) or "none"
            raise JobError(f"no omniload job named {job!r} at {address!r} (running: {have})")
        jobs = [job]
    return [_comms.call(client, "stats", job=name) for name in jobs]


def format_status(stats: dict[str, Any], now: float | None = None) -> str:
    """One job's figures as compact aligned text."""
    now = time.time() if now is None else now
    sources = stats["sources"]
    rate = stats.get("steps_per_second")
    capacity = stats.get("capacity_tokens") or 0
    state = job_state(stats)
    if state.startswith("failed"):
        state = f"failed: {stats['error']}"
    lines = [
        f"omniload job {stats['name']} · run {stats['run_id']} · {state} · "
        f"up {stats['uptime']:.0f} s · {stats['workers']} workers · "
        f"checkpoint: {checkpoint_text(stats.get('checkpoint'), now)}",
        f"  steps drawn {stats['steps_drawn']} · {fetched_text(stats)} · "
        f"{'-' if rate is None else f'{rate:.2f}'} steps/s · "
        f"tokens drawn {format_si(stats['tokens'])}",
        "  balance efficiency "
        + efficiency_text(stats, " · ")
        + (f" · capacity used {stats['tokens'] / capacity:.1%}" if capacity else ""),
        "",
    ]
    quota = any(s.get("quota") is not None for s in sources)
    width = max([6, *(len(str(s["name"])) for s in sources)])
    header = (
        f"  {'source':<{width}} {'target':>7} {'realised':>8} {'epoch':>5} {'documents':>10} "
        f"{'tokens':>11} {'records/s':>10} {'tokens/s':>9} {'reading/held':>13} "
        f"{'quota' if quota else 'window':>7} {'skipped':>8}"
    )
    lines.append(header)
    for s in sources:
        realised = s.get("realised_share")
        limit = s["quota"] if quota else s.get("read_window", 0)
        held = s["units_in_flight"] - s["reads_pending"]
        tasks = f"{s['reads_pending']}/{held}"
        lines.append(
            f"  {s['name']:<{width}} {s['target_share']:>7.1%} "
            f"{'-' if realised is None else f'{realised:.1%}':>8} {s['epoch']:>5} "
            f"{s['documents']:>10,} {s['tokens']:>11,} {format_si(s['records_per_s']):>10} "
            f"{format_si(s['tokens_per_s']):>9} {tasks:>13} "
            f"{'-' if limit is None else limit:>7} {s['skipped']:>8,}"
        )
    lines.append("")
    ranks = sorted(((int(r), v) for r, v in stats["ranks"].items()), key=lambda kv: kv[0])
    counts = rank_states(stats)
    lines.append(
        f"  ranks: {counts['fetching']} fetching, {counts['idle']} idle (no request for "
        f"{IDLE_AFTER:g} s: finished or paused), {counts['not started']} not started"
    )
    lines.append(
        f"  {'rank':>4} {'step':>6} {'buffered':>9} {'wait p50':>10} {'wait p99':>10}  last request"
    )
    shown = ranks
    if len(ranks) > MAX_RANK_ROWS:  # the ranks that wait longest matter; say how many are left
        shown = sorted(ranks, key=lambda kv: -(kv[1].get("wait_p99") or 0.0))[:MAX_RANK_ROWS]
        shown.sort(key=lambda kv: kv[0])
    for rank, r in shown:
        buffered = f"{r['buffered']}/{r['prefetch']}" if r.get("buffered") is not None else "-"
        lines.append(
            f"  {rank:>4} {r['position']:>6} {buffered:>9} {milliseconds(r.get('wait_p50')):>10} "
            f"{milliseconds(r.get('wait_p99')):>10}  {_last_request(r)}"
        )
    if len(shown) < len(ranks):
        lines.append(f"  ... {len(ranks) - len(shown)} more ranks (shown: longest p99 waits)")
    if stats.get("held_back"):
        lines.append("  " + held_back_text(stats["held_back"]))
    for s in sources:
        for example in (s.get("bad_examples") or [])[-1:]:
            lines.append(f"  last skipped ({s['name']}): {example}")
    return "\n".join(lines)


def _rank_state(rank: dict[str, Any]) -> str:
    """``fetching``, ``idle`` or ``not started``: how recently the rank's feeder asked."""
    ago = rank.get("reported_ago")
    if ago is None:
        return "not started"
    return "idle" if ago >= IDLE_AFTER else "fetching"


def _last_request(rank: dict[str, Any]) -> str:
    ago = rank.get("reported_ago")
    if ago is None:
        return "never"
    return f"{_age(ago)} ago" + (" (idle)" if ago >= IDLE_AFTER else "")


def rank_states(stats: dict[str, Any]) -> dict[str, int]:
    """How many of the job's ranks are fetching, idle and not started."""
    counts = {"fetching": 0, "idle": 0, "not started": 0}
    for rank in stats["ranks"].values():
        counts[_rank_state(rank)] += 1
    return counts


def job_state(stats: dict[str, Any]) -> str:
    """``failed``, ``running`` (a rank fetches), ``idle`` (every rank that started stopped
    asking: its feeders finished or paused) or ``waiting for ranks`` (none started yet)."""
    if stats.get("error"):
        return "failed"
    counts = rank_states(stats)
    if counts["fetching"]:
        return "running"
    return "idle" if counts["idle"] else "waiting for ranks"


def format_jobs(stats: list[dict[str, Any]]) -> str:
    """One line per job: its state, the step every rank had reached at its last request (a
    feeder asks ahead of its trainer, so this lags), the steps the data plane drew, how many
    ranks fetch, the job's age."""
    if not stats:
        return "no omniload job runs on this scheduler"
    width = max(3, *(len(str(s["name"])) for s in stats))
    lines = [f"{'job':<{width}}  {'state':<17} {'step':>8} {'drawn':>8}  {'ranks':<18} age"]
    for s in stats:
        counts = rank_states(s)
        ranks = f"{counts['fetching']}/{len(s['ranks'])} fetching"
        step = s["start_step"] + s["steps_fetched"]
        lines.append(
            f"{s['name']:<{width}}  {job_state(s):<17} {step:>8} {s['steps_drawn']:>8}  "
            f"{ranks:<18} {_age(s['uptime'])}"
        )
        if s.get("error"):
            lines.append(f"{'':<{width}}  {s['error']}")
    return "\n".join(lines)


def _age(seconds: float) -> str:
    """``4.2 s``, ``12 s``, ``3 min``, ``2.5 h``."""
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def watch(
    client: Any,
    job: str | None,
    address: str,
    *,
    once: bool,
    interval: float,
    out: TextIO | None = None,
) -> int:
    """Print the jobs' figures once, or redraw them every ``interval`` s until interrupted."""
    out = sys.stdout if out is None else out
    live = not once and out.isatty()
    while True:
        stats = job_stats(client, job, address)
        text = (
            "\n\n".join(format_status(s) for s in stats)
            if stats
            else f"no omniload job runs on the scheduler at {address}"
        )
        if live:
            out.write("\x1b[H\x1b[J")  # cursor home, clear the screen
        out.write(text + "\n")
        if not live and not once:
            out.write("\n")
        out.flush()
        if once:
            return 0
        time.sleep(interval)

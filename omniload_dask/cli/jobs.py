"""The commands that act on jobs running on a cluster: ``status``, ``jobs``, ``stop``,
``set-weights``, ``update-plan`` and ``mixture``.

A job started on a cluster (``Job.start(plan, address=...)``, ``omniload run PLAN --address``)
runs until it is stopped, whoever started it: its data plane lives in the scheduler. Its life
from the command line::

    omniload jobs --address tcp://scheduler:8786           # state, step, ranks, age of each
    omniload status --address tcp://scheduler:8786         # one job's figures, live
    omniload set-weights --address tcp://scheduler:8786 web=2 books=1
    omniload stop quickstart --address tcp://scheduler:8786

Each connects with ``--address`` (and the TLS options), waits at most ``--timeout`` seconds for
the scheduler, and names what is wrong in one line (no data plane there, no such job, several
jobs and no ``--job``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
from collections.abc import Iterator
from typing import Any

from omniload_dask.cli.tls import add_tls_options, security_of
from omniload_dask.errors import JobError
from omniload_dask.plan import load_plan

__all__ = ["add_job_commands", "name_taken"]


def name_taken(client: Any, name: str, address: str) -> str | None:
    """What to say when a job named ``name`` already runs at ``address`` (None: it does not):
    how far it is and the three ways on (stop it, attach to it, another name)."""
    from omniload_dask.internals import comms as _comms
    from omniload_dask.observe.status import job_state

    if name not in (_comms.call(client, "jobs") or ()):
        return None
    stats = _comms.call(client, "stats", job=name)
    step = stats["start_step"] + stats["steps_fetched"]
    return (
        f"a job named {name!r} already runs at {address} ({job_state(stats)}, its ranks at step "
        f"{step}); stop it (`omniload stop {name} --address {address}`), attach to it "
        f"(Job.attach({name!r}, address={address!r})), or give the plan another name (its "
        "`name:` field)"
    )


def _connected(args: argparse.Namespace) -> Any:
    from omniload_dask.observe.status import connect

    if args.timeout <= 0:
        raise JobError(f"--timeout must be > 0 seconds, got {args.timeout:g}")
    logging.getLogger("distributed").setLevel(logging.CRITICAL)  # our errors say it better
    return connect(args.address, args.timeout, security_of(args))


@contextlib.contextmanager
def _client(args: argparse.Namespace) -> Iterator[Any]:
    client = _connected(args)
    try:
        yield client
    finally:
        client.close()


@contextlib.contextmanager
def _running_job(args: argparse.Namespace) -> Iterator[tuple[Any, str]]:
    """A client of ``--address`` and the job to act on (``--job``, or the only one)."""
    from omniload_dask.observe.status import job_stats

    with _client(args) as client:
        names = [s["name"] for s in job_stats(client, args.job, args.address)]
        if len(names) != 1:
            raise JobError(
                f"{len(names)} jobs run at {args.address!r} ({', '.join(names) or 'none'}); "
                "name one with --job"
            )
        yield client, names[0]


def _status(args: argparse.Namespace) -> int:
    """``omniload status``: the running jobs' figures, once or live."""
    from omniload_dask.observe.status import watch

    if args.interval <= 0:
        raise JobError(f"--interval must be > 0 seconds, got {args.interval:g}")
    with _client(args) as client:
        return watch(client, args.job, args.address, once=args.once, interval=args.interval)


def _jobs(args: argparse.Namespace) -> int:
    """``omniload jobs``: one line per job on the scheduler."""
    from omniload_dask.observe.status import format_jobs, job_state, job_stats

    with _client(args) as client:
        stats = job_stats(client, None, args.address)
    if args.json:
        rows = [
            {
                "name": s["name"],
                "state": job_state(s),
                "step": s["start_step"] + s["steps_fetched"],
                "drawn": s["steps_drawn"],
                "ranks": len(s["ranks"]),
                "age_seconds": s["uptime"],
                "error": s.get("error"),
            }
            for s in stats
        ]
        print(json.dumps(rows, indent=2))
    else:
        print(format_jobs(stats))
    return 0


def _stop(args: argparse.Namespace) -> int:
    """``omniload stop NAME``: stop the job (a last checkpoint flush first, if it has one)."""
    from omniload_dask.internals import comms as _comms
    from omniload_dask.observe.status import job_stats

    with _client(args) as client:
        job_stats(client, args.name, args.address)  # no such job: an error naming those that run
        if not _comms.call(client, "stop", job=args.name, call_timeout=args.timeout + 30):
            raise JobError(f"job {args.name!r} ended before it could be stopped")
    print(f"stopped job {args.name!r} at {args.address}")
    return 0


def _parse_weights(items: list[str]) -> dict[str, float]:
    """``["web=2", "books=1"]`` -> ``{"web": 2.0, "books": 1.0}`` (JobError names a bad one)."""
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            if not sep or not name:
                raise ValueError
            out[name] = float(value)
        except ValueError:
            raise JobError(f"weights: expected SOURCE=WEIGHT, got {item!r}") from None
    return out


def _set_weights(args: argparse.Namespace) -> int:
    """``omniload set-weights``: re-weight sources of a running job."""
    from omniload_dask.internals import comms as _comms

    weights = _parse_weights(args.weights)
    with _running_job(args) as (client, job):
        reply = _comms.call(client, "set_weights", job=job, weights=weights, at_step=args.at_step)
        print(f"job {job!r}: weights {reply['weights']} from step {reply['step']}")
    return 0


def _update_plan(args: argparse.Namespace) -> int:
    """``omniload update-plan``: apply a new version of a running job's plan."""
    from omniload_dask.internals import comms as _comms

    plan = load_plan(args.plan)
    with _running_job(args) as (client, job):
        reply = _comms.call(
            client, "update_plan", job=job, plan=plan.to_dict(), at_step=args.at_step
        )
        print(
            f"job {job!r}: from step {reply['step']}: added {reply['added']}, "
            f"removed {reply['removed']}, weights {reply['weights']}"
            + (f", stages {reply['stages']}" if reply.get("stages") else "")
        )
    return 0


def _mixture(args: argparse.Namespace) -> int:
    """``omniload mixture``: target and realised share per source of a running job."""
    from omniload_dask.internals import comms as _comms

    with _running_job(args) as (client, job):
        rows = _comms.call(client, "mixture", job=job, window=args.window)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'source':<16}{'target':>8}{'window':>9}{'total':>9}{'epoch':>7}")
    for r in rows:
        state = " (removed)" if r["retired"] else " (done)" if r["exhausted"] else ""
        print(
            f"{r['name']:<16}{r['target_now']:>8.1%}{r['realised_window']:>9.1%}"
            f"{r['realised_total']:>9.1%}{r['epoch']:>7}{state}"
        )
    return 0


def add_job_commands(sub: Any) -> None:
    """Add ``status``, ``jobs``, ``stop``, ``set-weights``, ``update-plan`` and ``mixture``."""
    p = _add(sub, "status", "watch running jobs: a compact live view", _status)
    p.add_argument("--job", help="one job by name (default: every job on the scheduler)")
    p.add_argument("--once", action="store_true", help="print one snapshot and exit")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    p = _add(sub, "jobs", "list the jobs on a cluster: state, step, ranks, age", _jobs)
    p.add_argument("--json", action="store_true", help="print JSON")
    p = _add(sub, "stop", "stop a job running on a cluster", _stop)
    p.add_argument("name", help="the job's name (its plan's name; see `omniload jobs`)")
    p = _add(sub, "set-weights", "change source weights of a running job", _set_weights)
    p.add_argument("weights", nargs="+", metavar="SOURCE=WEIGHT")
    p.add_argument("--job", help="the job's name (default: the only job running)")
    p.add_argument("--at-step", type=int, help="first step to use them (default: next step)")
    p = _add(
        sub, "update-plan", "apply a new plan version live (sources, weights, stages)", _update_plan
    )
    p.add_argument("plan")
    p.add_argument("--job", help="the job's name (default: the only job running)")
    p.add_argument("--at-step", type=int, help="first step to use it (default: next step)")
    p = _add(sub, "mixture", "target and realised share per source", _mixture)
    p.add_argument("--job", help="the job's name (default: the only job running)")
    p.add_argument("--window", type=int, default=100, help="steps in the recent window")
    p.add_argument("--json", action="store_true", help="print JSON")


def _add(sub: Any, name: str, help: str, func: Any) -> argparse.ArgumentParser:
    """A subcommand that talks to a scheduler (``--address``, ``--timeout``, TLS)."""
    p: argparse.ArgumentParser = sub.add_parser(name, help=help, description=help)
    p.add_argument("--address", required=True, help="scheduler address, e.g. tcp://host:8786")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the scheduler")
    add_tls_options(p)
    p.set_defaults(func=func)
    return p

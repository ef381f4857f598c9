"""``omniload``: the command line, thin over the library.

::

    omniload validate PLAN                 print the resolved plan, or what is wrong with it
    omniload run PLAN [--steps N]          run the plan with simulated ranks and print a report
    omniload demo-data FOLDER              write the deterministic demo data
    omniload status --address ADDR         watch running jobs (figures of the dashboard page)
    omniload set-weights --address ADDR web=2 books=1 [--at-step N]   re-weight a running job
    omniload update-plan --address ADDR PLAN [--at-step N]   add/remove sources live
    omniload mixture --address ADDR        target vs realised share per source
    omniload checkpoint inspect URL        what a data-plane checkpoint holds
    omniload calibrate MODEL --seq-len N --out FILE   measure the cost terms on this device

Subcommands that connect to a scheduler take ``--tls-ca-file``, ``--tls-cert`` and ``--tls-key``
(default: Dask's config, ``distributed.comm.tls.*``); ``run --tls`` runs the embedded cluster on
TLS. ``validate`` prints credentials as ``***`` (see :mod:`omniload_dask.plan.credentials`).

Each subcommand parses its arguments, calls the library (plans, :class:`Job` via
:mod:`.runner`, :mod:`omniload_dask.observe.status`, the data plane's handlers, the checkpoint
store) and prints the answer; an error of the library prints one line and exits with 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from omniload_dask.cli.tls import add_tls_options, security_of
from omniload_dask.errors import OmniloadError
from omniload_dask.plan import load_plan

__all__ = ["build_parser", "main"]


def _validate(args: argparse.Namespace) -> int:
    """``omniload validate``: the resolved plan on stdout, the verdict on stderr."""
    plan = load_plan(args.plan)
    data = plan.redacted()  # credentials never printed (references as written)
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=True))
    else:
        print(yaml.safe_dump(data, sort_keys=False).rstrip())
    if not args.no_files:
        problems = _file_problems(plan)
        for problem in problems:
            print(f"omniload: error: {problem}", file=sys.stderr)
        if problems:
            print(
                "# (the files are listed from this machine; --no-files skips that)",
                file=sys.stderr,
            )
            return 2
    from omniload_dask.batching.mixing import mix_guarantee

    print(
        f"# plan {plan.name!r} is valid: {len(plan.sources)} sources, "
        f"stream fingerprint {plan.stream_fingerprint()}",
        file=sys.stderr,
    )
    for note in [] if args.no_files else _tokenizer_notes(plan):
        print(f"# {note}", file=sys.stderr)
    from omniload_dask.preprocess.tokens import validate_notes  # token sources, user code

    notes, problems = validate_notes(plan, files=not args.no_files)
    for line in [*(f"# {n}" for n in notes), *(f"omniload: error: {p}" for p in problems)]:
        print(line, file=sys.stderr)
    if problems:
        return 2
    weights = [s.weight for s in plan.sources]
    print(f"# {mix_guarantee(plan.batch, plan.mixing_by, weights)}", file=sys.stderr)
    return 0


def _file_problems(plan: Any) -> list[str]:
    """Each source whose paths find no files, by field (``validate``: found before a job)."""
    from omniload_dask.sources.registry import list_source

    problems = []
    for i, spec in enumerate(plan.sources):
        try:
            list_source(spec)
        except OmniloadError as exc:
            problems.append(f"sources[{i}].path: {exc}")
    return problems


def _tokenizer_notes(plan: Any) -> list[str]:
    """What ``validate`` says of the plan's tokenizer file: settings of it that are turned off."""
    if plan.tokenizer.kind == "byte":
        return []
    from omniload_dask.preprocess.tokenize import describe

    try:
        info = describe(plan.tokenizer)
    except OmniloadError as exc:
        return [f"tokenizer not loaded here: {exc}"]
    return [
        f"tokenizer.path: the file's {what} is turned off (documents are tokenized whole and "
        "packed here; batch.long_documents and batch.max_document_tokens say how long ones are "
        "cut, and count it)"
        for what in info.get("turned_off", ())
    ]


def _run(args: argparse.Namespace) -> int:
    """``omniload run``: drive every rank of the plan for ``--steps`` steps; print the report."""
    from omniload_dask.cli.runner import format_report, run_plan

    if args.make_demo_data:
        from omniload_dask.demo import make_demo_data

        make_demo_data(Path(args.plan).resolve().parent / "demo-data")
    plan = load_plan(args.plan)
    logging.getLogger("distributed").setLevel(logging.CRITICAL)  # our errors say it better
    report = run_plan(
        plan,
        steps=args.steps,
        address=args.address,
        workers=args.workers,
        progress=not args.json,
        resume=args.resume,
        security=True if args.tls and not args.address else security_of(args),
    )
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(format_report(report))
    return 0


def _demo(args: argparse.Namespace) -> int:
    """``omniload demo-data``: write the deterministic demo data; print where."""
    from omniload_dask.demo import make_demo_data

    print(make_demo_data(args.folder))
    return 0


def _status(args: argparse.Namespace) -> int:
    """``omniload status``: the running jobs' figures, once or live."""
    from omniload_dask.errors import JobError
    from omniload_dask.observe.status import connect, watch

    if args.interval <= 0:
        raise JobError(f"--interval must be > 0 seconds, got {args.interval:g}")
    if args.timeout <= 0:
        raise JobError(f"--timeout must be > 0 seconds, got {args.timeout:g}")
    logging.getLogger("distributed").setLevel(logging.CRITICAL)
    client = connect(args.address, args.timeout, security_of(args))
    try:
        return watch(client, args.job, args.address, once=args.once, interval=args.interval)
    finally:
        client.close()


def _one_job(client: object, job: str | None, address: str) -> str:
    """The job named, or the only job on the scheduler."""
    from omniload_dask.errors import JobError
    from omniload_dask.observe.status import job_stats

    names = [s["name"] for s in job_stats(client, job, address)]
    if len(names) != 1:
        raise JobError(
            f"{len(names)} jobs run at {address!r} ({', '.join(names) or 'none'}); "
            "name one with --job"
        )
    return names[0]


def _parse_weights(items: list[str]) -> dict[str, float]:
    """``["web=2", "books=1"]`` -> ``{"web": 2.0, "books": 1.0}`` (JobError names a bad one)."""
    from omniload_dask.errors import JobError

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


@contextlib.contextmanager
def _running_job(args: argparse.Namespace) -> Iterator[tuple[Any, str]]:
    """A client of ``--address`` and the job to act on (``--job``, or the only one)."""
    from omniload_dask.observe.status import connect

    logging.getLogger("distributed").setLevel(logging.CRITICAL)
    client = connect(args.address, args.timeout, security_of(args))
    try:
        yield client, _one_job(client, args.job, args.address)
    finally:
        client.close()


def _set_weights(args: argparse.Namespace) -> int:
    """``omniload set-weights``: re-weight sources of a running job."""
    from omniload_dask.cluster import internals as _dask

    with _running_job(args) as (client, job):
        weights = _parse_weights(args.weights)
        reply = _dask.call(client, "set_weights", job=job, weights=weights, at_step=args.at_step)
        print(f"job {job!r}: weights {reply['weights']} from step {reply['step']}")
    return 0


def _update_plan(args: argparse.Namespace) -> int:
    """``omniload update-plan``: apply a new version of a running job's plan."""
    from omniload_dask.cluster import internals as _dask

    with _running_job(args) as (client, job):
        plan = load_plan(args.plan)
        reply = _dask.call(
            client, "update_plan", job=job, plan=plan.to_dict(), at_step=args.at_step
        )
        print(
            f"job {job!r}: from step {reply['step']}: added {reply['added']}, "
            f"removed {reply['removed']}, weights {reply['weights']}"
        )
    return 0


def _mixture(args: argparse.Namespace) -> int:
    """``omniload mixture``: target and realised share per source of a running job."""
    from omniload_dask.cluster import internals as _dask

    with _running_job(args) as (client, job):
        rows = _dask.call(client, "mixture", job=job, window=args.window)
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


def _checkpoint_inspect(args: argparse.Namespace) -> int:
    """``omniload checkpoint inspect``: what a data-plane checkpoint holds."""
    from omniload_dask.checkpoint import Checkpoint

    options = json.loads(args.storage_options) if args.storage_options else {}
    summary = Checkpoint(args.url, options).summary()
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    first, last = summary["restorable_steps"]
    print(f"checkpoint {summary['url']}")
    print(f"  plan            {summary['plan']} (stream fingerprint {summary['plan_fingerprint']})")
    print(f"  restorable      steps {first} to {last}")
    print(
        f"  files           {len(summary['bases'])} bases at {summary['bases']}, "
        f"{summary['segments']} delta segments, {summary['bytes']:,} bytes"
    )
    positions = summary["rank_positions"]
    if positions:
        print(
            f"  rank positions  {min(positions.values())} to {max(positions.values())} "
            f"({len(positions)} ranks)"
        )
    print(f"  {'source':<16}{'epoch':>6}{'position':>10}{'row':>7}{'documents':>11}{'skipped':>9}")
    for src in summary["sources"]:
        if src.get("joins_later"):
            print(f"  {src['name']:<16} joins later")
            continue
        state = " (removed)" if src["retired"] else ""
        print(
            f"  {src['name']:<16}{src['epoch']:>6}{src['position']:>10}{src['row']:>7}"
            f"{src['documents']:>11}{src['skipped']:>9}{state}"
        )
    for entry in summary["log"]:
        print(
            f"  change at step {entry['step']}: {entry['kind']} "
            f"{entry.get('weights') or entry.get('source')}"
        )
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    """``omniload calibrate``: time the model, fit the cost terms, print them, write the file."""
    from omniload_dask.calibrate import calibrate
    from omniload_dask.errors import CalibrationError

    model: str | dict[str, Any] | None = None
    encoder: dict[str, Any] | None = None
    seq_len, patch_size, merge = args.seq_len, 14, 2
    if args.plan:
        plan = load_plan(args.plan)
        if plan.cost.model is not None:
            model = dict(plan.cost.model)
        if plan.cost.encoder_model is not None:
            encoder = dict(plan.cost.encoder_model)
        seq_len = seq_len or plan.batch.seq_len  # the longest bucket's
        if plan.images is not None:
            patch_size, merge = plan.images.patch_size, plan.images.merge
    if args.model:
        model = _model_argument(args.model, "MODEL")
    if args.encoder:
        described = _model_argument(args.encoder, "--encoder")
        if not isinstance(described, dict):
            raise CalibrationError("--encoder: must be a transformer description {hidden: ...}")
        encoder = described
    if model is None:
        raise CalibrationError(
            "MODEL: name the model (package.module:factory, or a description such as "
            "'{hidden: 64, layers: 2, heads: 4}'), or give --plan with a cost.model"
        )
    if not seq_len:
        raise CalibrationError("--seq-len: is required without --plan")
    images = [int(x) for x in args.images.split(",")] if args.images else []
    quick = args.quick

    def progress(phase: str, done: int, total: int) -> None:
        if not args.quiet and (done == total or done % max(1, total // 20) == 0):
            print(f"\r{phase} {done}/{total}", end="\n" if done == total else "", file=sys.stderr)

    result = calibrate(
        model,
        seq_len=seq_len,
        device=args.device,
        threads=args.threads,
        repeats=args.repeats or (3 if quick else 5),
        attention=args.attention,
        encoder=encoder,
        images=images,
        patch_size=args.patch_size or patch_size,
        merge=args.merge or merge,
        vocab=args.vocab,
        random=8 if quick else 24,
        held_back_count=8 if quick else 24,
        seed=args.seed,
        progress=progress,
    )
    print(result.summary())
    path = result.write(args.out)
    print(f"wrote {path}: use it with cost: {{calibration: {path.name}}}")
    return 0


def _model_argument(text: str, name: str) -> str | dict[str, Any]:
    """``package.module:factory`` as it is, or a YAML/JSON mapping describing a transformer."""
    from omniload_dask.errors import CalibrationError

    if text.lstrip().startswith("{"):
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise CalibrationError(f"{name}: not a valid YAML mapping ({exc})") from None
        if not isinstance(value, dict):
            raise CalibrationError(f"{name}: must be a mapping, got {text!r}")
        return value
    return text


def build_parser() -> argparse.ArgumentParser:
    """The ``omniload`` argument parser; each subcommand sets ``func``, the function to run."""
    parser = argparse.ArgumentParser(prog="omniload", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("validate", help="check a plan and print it resolved")
    p.add_argument("plan")
    p.add_argument("--json", action="store_true", help="print JSON instead of YAML")
    p.add_argument(
        "--no-files",
        action="store_true",
        help="check the plan only: list no source files, load no tokenizer (files elsewhere)",
    )
    p.set_defaults(func=_validate)
    p = sub.add_parser("run", help="run a plan with simulated trainer ranks")
    p.add_argument("plan")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--address", help="scheduler address (default: embedded LocalCluster)")
    p.add_argument("--workers", type=int, help="workers of the embedded cluster")
    p.add_argument(
        "--make-demo-data",
        action="store_true",
        help="write the demo data next to the plan first (if missing)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--resume", action="store_true", help="continue from the plan's checkpoint (checkpoint.url)"
    )
    p.add_argument(
        "--tls",
        action="store_true",
        help="embedded cluster on TLS with temporary certificates (as loader.tls)",
    )
    add_tls_options(p)
    p.set_defaults(func=_run)
    p = sub.add_parser("demo-data", help="write the deterministic demo data")
    p.add_argument("folder")
    p.set_defaults(func=_demo)
    p = sub.add_parser("status", help="watch running jobs: a compact live view")
    p.add_argument("--address", required=True, help="scheduler address, e.g. tcp://host:8786")
    p.add_argument("--job", help="one job by name (default: every job on the scheduler)")
    p.add_argument("--once", action="store_true", help="print one snapshot and exit")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the scheduler")
    add_tls_options(p)
    p.set_defaults(func=_status)
    p = sub.add_parser("checkpoint", help="look at a data-plane checkpoint")
    csub = p.add_subparsers(dest="action", required=True)
    c = csub.add_parser("inspect", help="what a checkpoint holds")
    c.add_argument("url", help="the checkpoint folder (any fsspec URL)")
    c.add_argument("--storage-options", help="fsspec options as JSON (e.g. an S3 endpoint)")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=_checkpoint_inspect)
    p = sub.add_parser(
        "calibrate", help="measure the cost terms: time forward + backward on this device"
    )
    p.add_argument(
        "model",
        nargs="?",
        metavar="MODEL",
        help="package.module:factory, or a transformer description '{hidden: 64, layers: 2}'",
    )
    p.add_argument("--plan", help="take the model, encoder and seq_len from this plan's cost")
    p.add_argument("--seq-len", type=int, help="the micro-batches' capacity in tokens")
    p.add_argument("--out", default="calibration.yaml", help="the file to write")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--repeats", type=int, help="timings per micro-batch, best kept (default 5)")
    p.add_argument("--attention", default="auto", help="auto, loop or jagged (described model)")
    p.add_argument("--encoder", help="a vision encoder description (described model)")
    p.add_argument("--images", help="patch counts of images to time, e.g. 256,1024")
    p.add_argument("--patch-size", type=int, help="image patch size in pixels (default 14)")
    p.add_argument("--merge", type=int, help="patches merged per token, per side (default 2)")
    p.add_argument(
        "--vocab", type=int, help="token ids drawn below this (default: the model's, or 256)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="fewer micro-batches and repeats")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(func=_calibrate)
    p = _add_live(sub, "set-weights", "change source weights of a running job", _set_weights)
    p.add_argument("weights", nargs="+", metavar="SOURCE=WEIGHT")
    p.add_argument("--at-step", type=int, help="first step to use them (default: next step)")
    p = _add_live(
        sub, "update-plan", "apply a new plan version live (sources, weights)", _update_plan
    )
    p.add_argument("plan")
    p.add_argument("--at-step", type=int, help="first step to use it (default: next step)")
    p = _add_live(sub, "mixture", "target and realised share per source", _mixture)
    p.add_argument("--window", type=int, default=100, help="steps in the recent window")
    p.add_argument("--json", action="store_true")
    return parser


def _add_live(
    sub: argparse._SubParsersAction, name: str, help: str, func: Any
) -> argparse.ArgumentParser:
    """A subcommand that acts on a running job (``--address``, ``--job``, ``--timeout``)."""
    p = sub.add_parser(name, help=help)
    p.add_argument("--address", required=True, help="scheduler address, e.g. tcp://host:8786")
    p.add_argument("--job", help="the job's name (default: the only job running)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the scheduler")
    add_tls_options(p)
    p.set_defaults(func=func)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run ``omniload`` with ``argv`` (default: the process's); returns the exit status.

    Errors of the library (a bad plan, an unreachable scheduler, ...) print one line and
    return 2; Ctrl-C returns 130.
    """
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except OmniloadError as exc:
        print(f"omniload: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130

"""``omniload``: the command line, thin over the library.

::

    omniload validate PLAN                 print the resolved plan, or what is wrong with it
    omniload run PLAN [--steps N]          run the plan with simulated ranks and print a report
    omniload demo-data FOLDER              write the deterministic demo data
    omniload jobs --address ADDR           the jobs on a cluster: state, step, ranks, age
    omniload status --address ADDR         watch running jobs (figures of the dashboard page)
    omniload set-weights --address ADDR web=2 books=1 [--at-step N]   re-weight a running job
    omniload update-plan --address ADDR PLAN [--at-step N]   add/remove sources live
    omniload mixture --address ADDR        target vs realised share per source
    omniload stop NAME --address ADDR      stop a job on a cluster
    omniload checkpoint inspect URL        what a data-plane checkpoint holds
    omniload calibrate MODEL --seq-len N --out FILE   measure the cost terms on this device

Subcommands that connect to a scheduler take ``--tls-ca-file``, ``--tls-cert`` and ``--tls-key``
(default: Dask's config, ``distributed.comm.tls.*``); ``run --tls`` runs the embedded cluster on
TLS. ``validate`` prints credentials as ``***`` (see :mod:`omniload_dask.plan.credentials`).

Each subcommand parses its arguments, calls the library (plans, :class:`Job` via
:mod:`.runner`, :mod:`.jobs` for jobs on a cluster, :mod:`.validate`, the checkpoint store) and
prints the answer; an error of the library prints one line and exits with 2. ``--help`` is
plain text (:data:`DESCRIPTION`) and shows each option's default.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

import yaml

from omniload_dask.cli.jobs import add_job_commands, name_taken
from omniload_dask.cli.tls import add_tls_options, security_of
from omniload_dask.cli.validate import validate
from omniload_dask.errors import OmniloadError
from omniload_dask.plan import load_plan

__all__ = ["DESCRIPTION", "build_parser", "main"]

DESCRIPTION = """\
omniload: a distributed data loader for training on many sources at once, on Dask.

Without --address, `omniload run` starts a Dask cluster in the process (embedded) and stops
it at the end. A job started on a cluster of your own (--address, or Job.start(plan,
address=...)) runs until it is stopped: `omniload jobs` lists them, `omniload status` watches
one, `omniload set-weights` re-weights it, `omniload stop NAME` stops it.

Errors print one line (`omniload: error: ...`) and exit with 2.
"""


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written; each option's help ends with its default (when it has one)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            action.option_strings
            and default not in (None, False, argparse.SUPPRESS)
            and "default" not in text
        ):
            text += " (default: %(default)s)"
        return text


class _Parser(argparse.ArgumentParser):
    """An argument parser whose help (and its subcommands') is :class:`_HelpFormatter`'s."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        if kwargs.get("help") and not kwargs.get("description"):
            kwargs["description"] = kwargs["help"]
        kwargs.pop("help", None)
        super().__init__(*args, **kwargs)


def _run(args: argparse.Namespace) -> int:
    """``omniload run``: drive every rank of the plan for ``--steps`` steps; print the report.

    On the embedded cluster the job ends with the command. On a cluster (``--address``) it
    keeps running after the report, and the command says so and how to stop it; a job of the
    plan's name that runs there already is an error naming the ways on.
    """
    from omniload_dask.cli.runner import format_report, run_plan

    if args.make_demo_data:
        from omniload_dask.demo import make_demo_data

        make_demo_data(Path(args.plan).resolve().parent / "demo-data")
    plan = load_plan(args.plan)
    logging.getLogger("distributed").setLevel(logging.CRITICAL)  # our errors say it better
    if args.address:
        report = _run_on_cluster(args, plan)
    else:
        report = run_plan(
            plan,
            steps=args.steps,
            workers=args.workers,
            progress=not args.json,
            resume=args.resume,
            security=True if args.tls else security_of(args),
        )
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(format_report(report))
    if args.address:
        name, address = plan.name, args.address
        print(
            f"# job {name!r} keeps running at {address}: its data plane still holds its place, "
            f"reads and batches ahead. Watch it: `omniload status --address {address}`; stop "
            f"it: `omniload stop {name} --address {address}`",
            file=sys.stderr,
        )
    return 0


def _run_on_cluster(args: argparse.Namespace, plan: Any) -> Any:
    """Start the plan's job on the cluster at ``--address`` (not one that runs already) and
    drive it; the job is left running."""
    from omniload_dask.cli.runner import run_plan
    from omniload_dask.cluster.job import Job
    from omniload_dask.errors import JobError
    from omniload_dask.observe.status import connect

    client = connect(args.address, 10.0, security_of(args))
    try:
        taken = name_taken(client, plan.name, args.address)
        if taken:
            raise JobError(taken)
        job = Job.start(plan, client=client, resume=args.resume or None)
        return run_plan(job.plan, steps=args.steps, job=job, progress=not args.json)
    finally:
        client.close()


def _demo(args: argparse.Namespace) -> int:
    """``omniload demo-data``: write the deterministic demo data; print where."""
    from omniload_dask.demo import make_demo_data

    print(make_demo_data(args.folder))
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
    parser = _Parser(prog="omniload", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("validate", help="check a plan and print it resolved")
    p.add_argument("plan", help="the plan file (YAML)")
    p.add_argument("--json", action="store_true", help="print JSON instead of YAML")
    p.add_argument(
        "--no-files",
        action="store_true",
        help="check the plan only: list no source files, load no tokenizer (files elsewhere)",
    )
    p.set_defaults(func=validate)
    p = sub.add_parser("run", help="run a plan with simulated trainer ranks")
    p.add_argument("plan", help="the plan file (YAML)")
    p.add_argument("--steps", type=int, default=200, help="steps to deliver to every rank")
    p.add_argument(
        "--address",
        help="a Dask scheduler to run on; the job keeps running there after the report "
        "(default: an embedded cluster, stopped at the end)",
    )
    p.add_argument(
        "--workers", type=int, help="workers of the embedded cluster (default: loader.workers)"
    )
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
    p.add_argument("folder", help="where to write it, e.g. plans/demo-data")
    p.set_defaults(func=_demo)
    add_job_commands(sub)
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
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``omniload`` with ``argv`` (default: the process's); returns the exit status.

    Errors of the library (a bad plan, an unreachable scheduler, ...) print one line and
    return 2; Ctrl-C returns 130.
    """
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except OmniloadError as exc:
        from omniload_dask.fixes import with_fix

        print(f"omniload: error: {with_fix(str(exc))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130

"""``omniload validate PLAN``: the resolved plan on stdout, the verdict on stderr.

The plan is parsed (every field checked, an unknown or misspelt one named), then every file it
names on this machine is checked: each source's paths list files, the first records of its
first file read (a wrong field, malformed lines, whether Parquet files carry page checksums),
the tokenizer file loads; each source's training target rule is named. A
missing one fails like a glob that matches nothing (exit 2, one line each, and the command that
writes the demo data where that is what is missing). Remote files (``s3://``, ``memory://``,
chained URLs) are not opened here: a ``#`` note names each, and the workers check them when the
job starts. ``--no-files`` checks the plan alone.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import yaml

from omniload_dask.errors import OmniloadError
from omniload_dask.plan import load_plan

__all__ = ["validate"]


def validate(args: argparse.Namespace) -> int:
    """``omniload validate``: the resolved plan on stdout, the verdict on stderr.

    Every file the plan names on this machine is checked (each source's paths list files, the
    tokenizer file loads): a missing one fails like a glob that matches nothing. Remote files
    (``s3://``, ``memory://`` ...) are not opened here; a note says so.
    """
    from omniload_dask.fixes import demo_data_fix

    plan = load_plan(args.plan)
    data = plan.redacted()  # credentials never printed (references as written)
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=True))
    else:
        print(yaml.safe_dump(data, sort_keys=False).rstrip())
    problems: list[str] = []
    notes: list[str] = []
    if not args.no_files:
        problems, notes = _file_checks(plan)
        for problem in problems:
            print(f"omniload: error: {problem}", file=sys.stderr)
        if problems:
            fix = demo_data_fix(" ".join(problems))
            if fix:
                print(f"# {fix}", file=sys.stderr)
            print(
                "# (the files are listed from this machine; --no-files skips that)",
                file=sys.stderr,
            )
            return 2
    from omniload_dask.preprocess.tokens import validate_notes  # token sources, user code

    token_notes, token_problems = validate_notes(plan, files=not args.no_files)
    if token_problems:
        for problem in token_problems:
            print(f"omniload: error: {problem}", file=sys.stderr)
        return 2
    from omniload_dask.batching.mixing import mix_guarantee

    print(
        f"# plan {plan.name!r} is valid: {len(plan.sources)} sources, "
        f"stream fingerprint {plan.stream_fingerprint()}",
        file=sys.stderr,
    )
    if args.no_files:
        notes = ["files not checked (--no-files)"]
    from omniload_dask.preprocess.chat_encode import target_notes

    notes += target_notes(plan.sources, plan.tokenizer, load=not args.no_files)
    notes += token_notes
    for note in notes:
        print(f"# {note}", file=sys.stderr)
    weights = [s.weight for s in plan.sources]
    print(f"# {mix_guarantee(plan.batch, plan.mixing_by, weights)}", file=sys.stderr)
    return 0


def _is_local(url: str) -> bool:
    """Whether ``url`` names a file of this machine (``memory://`` is the process's own)."""
    if "::" in url:
        return False
    protocol, sep, _ = url.partition("://")
    return not sep or protocol.lower() in ("file", "local")


def _file_checks(plan: Any) -> tuple[list[str], list[str]]:
    """What ``validate`` finds of the plan's files: problems (each names its field), and
    notes (settings of the tokenizer file turned off, files not checked because remote)."""
    from omniload_dask.sources.preview import check_source

    problems: list[str] = []
    notes: list[str] = []
    for i, spec in enumerate(plan.sources):
        remote = [url for url in spec.paths if not _is_local(url)]
        if remote:
            notes.append(
                f"sources[{i}].path: {', '.join(remote)} not checked here (remote: the "
                "workers list it when the job starts)"
            )
            continue
        # the files listed, then the first records of the first one read (a wrong field, bad
        # lines, Parquet page checksums)
        found, said = check_source(i, spec, plan.on_error)
        problems += found
        notes += said
    tokenizer = plan.tokenizer
    if tokenizer.kind == "byte":
        return problems, notes
    if not _is_local(tokenizer.path):
        notes.append(
            f"tokenizer.path: {tokenizer.path} not checked here (remote: the workers load it "
            "when the job starts)"
        )
        return problems, notes
    from omniload_dask.preprocess.tokenize import describe

    try:
        info = describe(tokenizer)
    except OmniloadError as exc:
        problems.append(str(exc))
        return problems, notes
    notes.extend(
        f"tokenizer.path: the file's {what} is turned off (documents are tokenized whole and "
        "packed here; batch.long_documents and batch.max_document_tokens say how long ones are "
        "cut, and count it)"
        for what in info.get("turned_off", ())
    )
    return problems, notes

"""What a user reads when a plan fails in a task: omniload's own error once, with the fix where
one is known, and none of Dask's worker dumps ("Compute Failed") or handler tracebacks
("Exception while handling op"), both from a training script and from ``omniload run``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from omniload_dask.fixes import demo_data_fix, with_fix

from .datagen import plan_dict, texts, write_jsonl

REPO = Path(__file__).resolve().parents[1]
DASK_DUMPS = ("Compute Failed", "Exception while handling op", "distributed.worker - ERROR")
SCRIPT = """
from omniload_dask import Job, load_plan

if __name__ == "__main__":
    with Job.start(load_plan("plan.yaml")) as job:
        for mb in job.feeder(dp_rank=0, max_steps=100, output="numpy"):
            pass
"""


def _write_plan(folder: Path, path: str, on_error: str = "raise") -> None:
    source = {"name": "web", "format": "jsonl", "path": path}
    plan = plan_dict([source], on_error=on_error, layout={"dp": 1}, loader={"workers": 1})
    (folder / "plan.yaml").write_text(yaml.safe_dump(plan))


def _with_a_bad_record(folder: Path) -> None:
    write_jsonl(folder / "a.jsonl", texts(200, seed=1))
    with open(folder / "a.jsonl", "a") as f:
        f.write("{not json\n")


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=240
    )


def _assert_no_dask_dumps(stderr: str) -> None:
    for dump in DASK_DUMPS:
        assert dump not in stderr, stderr[-3000:]


def test_a_script_without_the_demo_data_reads_one_error_naming_the_command_that_writes_it(
    tmp_path,
):
    _write_plan(tmp_path, "demo-data/web/*.jsonl")
    (tmp_path / "train.py").write_text(SCRIPT)
    proc = _run(["train.py"], tmp_path)
    assert proc.returncode == 1
    _assert_no_dask_dumps(proc.stderr)
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("omniload_dask.errors.SourceError: source 'web': glob "), last
    assert last.endswith("run `omniload demo-data demo-data` to write the demo data"), last
    assert proc.stderr.count("matched no files") == 1, proc.stderr


def test_a_script_whose_source_has_a_bad_record_reads_one_error_naming_file_and_record(tmp_path):
    _with_a_bad_record(tmp_path)
    _write_plan(tmp_path, "a.jsonl")
    (tmp_path / "train.py").write_text(SCRIPT)
    proc = _run(["train.py"], tmp_path)
    assert proc.returncode == 1
    _assert_no_dask_dumps(proc.stderr)
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("omniload_dask.errors.JobError: job 't' failed: source 'web': file "), (
        last
    )
    assert "record at offset" in last and "malformed JSON" in last, last
    assert "set on_error: skip" in last, last
    assert proc.stderr.count("malformed JSON") == 1, proc.stderr


def test_omniload_run_prints_one_line_for_a_bad_record_and_for_missing_demo_data(tmp_path):
    _with_a_bad_record(tmp_path)
    _write_plan(tmp_path, "a.jsonl")
    proc = _run(["-m", "omniload_dask.cli", "run", "plan.yaml", "--json"], tmp_path)
    assert proc.returncode == 2
    _assert_no_dask_dumps(proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("omniload: error: job 't' failed: source 'web': file "), lines
    assert "record at offset" in lines[0] and "set on_error: skip" in lines[0]
    _write_plan(tmp_path, "demo-data/web/*.jsonl")
    proc = _run(["-m", "omniload_dask.cli", "run", "plan.yaml", "--json"], tmp_path)
    assert proc.returncode == 2
    _assert_no_dask_dumps(proc.stderr)
    assert proc.stderr.strip().splitlines() == [
        f"omniload: error: source 'web': glob '{tmp_path / 'demo-data/web/*.jsonl'}' matched "
        "no files; run `omniload demo-data demo-data` to write the demo data"
    ]
    assert json.loads(proc.stdout or "null") is None


def test_the_demo_data_fix_names_the_missing_folder_as_typed_and_only_when_missing(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    missing = f"glob '{tmp_path}/plans/demo-data/web/*.jsonl' matched no files"
    assert (
        demo_data_fix(missing) == "run `omniload demo-data plans/demo-data` to write the demo data"
    )
    assert with_fix(missing).endswith(
        "; run `omniload demo-data plans/demo-data` to write the demo data"
    )
    (tmp_path / "plans" / "demo-data").mkdir(parents=True)
    assert demo_data_fix(missing) is None  # there: something else is wrong
    assert demo_data_fix("glob 's3://b/demo-data/*.jsonl' matched no files") is None
    assert with_fix("sources[0].weight: must be >= 0, got -1").endswith("got -1")


def test_dask_records_of_our_errors_leave_the_terminal_for_the_debug_log(caplog):
    import logging

    from omniload_dask.cluster import quiet

    def compute_failed(key: str, exception_text: str) -> logging.LogRecord:
        return logging.LogRecord(
            "distributed.worker", logging.ERROR, __file__, 1,
            "Compute Failed\nKey:       %s\nState:     %s\nTask:  %s\nException: %r\nTraceback: %r\n",
            (key, "executing", "<Task ...>", exception_text, "  File ..."), None,
        )  # fmt: skip

    ours = compute_failed("omniload-read-1a2b-0-0-0", "RecordError(\"source 'web': bad\")")
    a_bug = compute_failed("omniload-read-1a2b-0-0-0", "TypeError('unsupported operand')")
    theirs = compute_failed("inc-123", "SourceError('not ours')")
    terminal, echo = quiet._OffTerminal(), quiet._Echo()
    assert not terminal.filter(ours)
    assert terminal.filter(a_bug) and terminal.filter(theirs)  # stays as Dask prints it
    with caplog.at_level(logging.DEBUG, logger="omniload_dask.cluster.quiet"):
        assert echo.filter(ours) and echo.filter(a_bug)
    (echoed,) = caplog.records
    assert echoed.levelno == logging.DEBUG and "RecordError" in echoed.getMessage()

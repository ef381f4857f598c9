from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from omniload_dask.cli import build_parser, main

from .datagen import plan_dict, texts, write_jsonl

REPO = Path(__file__).resolve().parents[1]


def test_validate_prints_the_resolved_plan(capsys):
    from omniload_dask.demo import make_demo_data

    make_demo_data(REPO / "plans" / "demo-data")
    assert main(["validate", str(REPO / "plans" / "quickstart.yaml")]) == 0
    out = capsys.readouterr()
    data = yaml.safe_load(out.out)
    assert [s["name"] for s in data["sources"]] == ["web", "code", "books"]
    assert Path(data["sources"][0]["path"][0]).is_absolute()
    assert "is valid" in out.err


def test_validate_names_the_bad_field(tmp_path, capsys):
    bad = plan_dict([{"name": "a", "format": "jsonl", "path": "x.jsonl", "weight": -1}])
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
    assert main(["validate", str(tmp_path / "bad.yaml")]) == 2
    assert "sources[0].weight: must be >= 0, got -1" in capsys.readouterr().err


def test_validate_lists_the_files_so_a_glob_that_matches_nothing_is_found_before_a_job(
    tmp_path, capsys
):
    write_jsonl(tmp_path / "a.jsonl", texts(5))
    sources = [
        {"name": "a", "format": "jsonl", "path": str(tmp_path / "*.jsonl")},
        {"name": "b", "format": "jsonl", "path": str(tmp_path / "nothing" / "*.jsonl")},
    ]
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(plan_dict(sources)))
    assert main(["validate", str(tmp_path / "p.yaml")]) == 2
    err = capsys.readouterr().err
    assert "omniload: error: sources[1].path: source 'b': glob '" in err
    assert "matched no files" in err and "sources[0]" not in err
    assert main(["validate", "--no-files", str(tmp_path / "p.yaml")]) == 0


def test_validate_fails_on_a_missing_local_tokenizer_file_as_on_an_empty_glob(tmp_path, capsys):
    write_jsonl(tmp_path / "a.jsonl", texts(5))
    sources = [{"name": "a", "format": "jsonl", "path": str(tmp_path / "a.jsonl")}]
    tokenizer = {"kind": "huggingface", "path": "nowhere/tokenizer.json", "bos": "<s>"}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(plan_dict(sources, tokenizer=tokenizer)))
    assert main(["validate", str(tmp_path / "p.yaml")]) == 2
    err = capsys.readouterr().err
    missing = tmp_path / "nowhere" / "tokenizer.json"
    assert f"omniload: error: tokenizer.path: file '{missing}' does not exist" in err
    assert "is valid" not in err
    assert main(["validate", "--no-files", str(tmp_path / "p.yaml")]) == 0
    assert "# files not checked (--no-files)" in capsys.readouterr().err


def test_validate_says_which_remote_files_it_did_not_check(tmp_path, capsys):
    write_jsonl(tmp_path / "a.jsonl", texts(5))
    sources = [
        {"name": "a", "format": "jsonl", "path": str(tmp_path / "a.jsonl")},
        {"name": "b", "format": "jsonl", "path": "s3://no-such-bucket/b/*.jsonl"},
    ]
    tokenizer = {"kind": "huggingface", "path": "s3://no-such-bucket/tokenizer.json"}
    plan = plan_dict(sources, tokenizer={**tokenizer, "add_bos": False, "add_eos": False})
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(plan))
    assert main(["validate", str(tmp_path / "p.yaml")]) == 0
    err = capsys.readouterr().err
    assert "is valid" in err
    assert (
        "# sources[1].path: s3://no-such-bucket/b/*.jsonl not checked here (remote: the workers "
        "list it when the job starts)"
    ) in err
    assert "# tokenizer.path: s3://no-such-bucket/tokenizer.json not checked here" in err
    assert "sources[0].path" not in err  # a local one that is there: checked, nothing to say


def test_run_prints_a_report_as_json(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", texts(200))
    plan = plan_dict([{"name": "a", "format": "jsonl", "path": str(tmp_path / "a.jsonl")}])
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(plan))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "omniload_dask.cli",
            "run",
            str(tmp_path / "p.yaml"),
            "--steps",
            "5",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report["steps"] == 5 and report["ranks"] == 2 and report["tokens"] > 0
    assert [s["name"] for s in report["sources"]] == ["a"]
    assert len(report["efficiency"]) == 5
    assert all(0 < e <= 1 for e in report["efficiency"])


def test_run_of_the_quickstart_plan_shuts_down_cleanly():
    # 20 steps end while read-ahead reads still run on the workers: closing the embedded
    # cluster under them used to make every worker log a CancelledError.
    from omniload_dask.demo import make_demo_data

    make_demo_data(REPO / "plans" / "demo-data")
    proc = subprocess.run(
        [sys.executable, "-m", "omniload_dask.cli", "run", str(REPO / "plans" / "quickstart.yaml"),
         "--steps", "20", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["steps"] == 20
    assert "CancelledError" not in proc.stderr, proc.stderr[-2000:]
    assert "still alive after" not in proc.stderr, proc.stderr[-2000:]  # no worker killed


def test_help_is_plain_text_and_shows_the_defaults(capsys):

    commands = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    for argv in (["--help"], *([name, "--help"] for name in commands)):
        with pytest.raises(SystemExit):
            main(argv)
        out = capsys.readouterr().out
        assert "``" not in out and ":class:" not in out and ":mod:" not in out, argv
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = capsys.readouterr().out
    assert "steps to deliver to every rank (default: 200)" in out
    assert "--json" in out and "(default: False)" not in out
    with pytest.raises(SystemExit):
        main(["status", "--help"])
    assert "seconds between refreshes (default: 2.0)" in capsys.readouterr().out

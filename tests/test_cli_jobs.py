"""A job's whole life on a cluster from the command line: run it, list it, watch it,
re-weight it, meet its name taken, stop it (and stop one through ``Job.stop``)."""

from __future__ import annotations

import json

import yaml

from omniload_dask import Job
from omniload_dask.cli import main
from omniload_dask.cluster.job import local_cluster

from .datagen import plan_dict, texts, write_jsonl


def _plan_file(tmp_path) -> str:
    write_jsonl(tmp_path / "a" / "a.jsonl", texts(400, seed=1))
    write_jsonl(tmp_path / "b" / "b.jsonl", texts(400, seed=2))
    sources = [
        {"name": "a", "format": "jsonl", "path": str(tmp_path / "a" / "*.jsonl")},
        {"name": "b", "format": "jsonl", "path": str(tmp_path / "b" / "*.jsonl")},
    ]
    path = tmp_path / "life.yaml"
    path.write_text(yaml.safe_dump(plan_dict(sources, name="life")))
    return str(path)


def test_a_jobs_life_on_a_cluster_from_the_command_line(tmp_path, capsys):
    plan = _plan_file(tmp_path)
    with local_cluster(1, processes=False, dashboard_address=None) as cluster:
        addr = cluster.scheduler_address
        assert main(["run", plan, "--address", addr, "--steps", "3", "--json"]) == 0
        out = capsys.readouterr()
        assert json.loads(out.out)["steps"] == 3
        assert f"# job 'life' keeps running at {addr}" in out.err
        assert f"stop it: `omniload stop life --address {addr}`" in out.err

        assert main(["jobs", "--address", addr]) == 0
        header, row = capsys.readouterr().out.splitlines()
        assert header.split() == ["job", "state", "step", "drawn", "ranks", "age"]
        assert row.split()[0] == "life" and row.split()[1] in ("running", "idle")
        assert "/2 fetching" in row
        assert main(["jobs", "--address", addr, "--json"]) == 0
        (listed,) = json.loads(capsys.readouterr().out)
        assert listed["name"] == "life" and listed["ranks"] == 2 and listed["error"] is None

        # Run again while it runs: the name is taken, and the message says what to do.
        assert main(["run", plan, "--address", addr, "--steps", "3"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"omniload: error: a job named 'life' already runs at {addr} (")
        assert f"stop it (`omniload stop life --address {addr}`)" in err
        assert f"attach to it (Job.attach('life', address={addr!r}))" in err
        assert "give the plan another name" in err and "checkpoint" not in err

        assert main(["status", "--address", addr, "--once"]) == 0
        status = capsys.readouterr().out
        assert "  ranks: " in status and "last request" in status
        assert main(["set-weights", "--address", addr, "a=3", "b=1"]) == 0
        assert "job 'life': weights" in capsys.readouterr().out

        assert main(["stop", "life", "--address", addr]) == 0
        assert capsys.readouterr().out.strip() == f"stopped job 'life' at {addr}"
        assert main(["jobs", "--address", addr]) == 0
        assert capsys.readouterr().out.strip() == "no omniload job runs on this scheduler"
        assert main(["stop", "life", "--address", addr]) == 2
        assert "no omniload job named 'life'" in capsys.readouterr().err

        # The same from the API: a handle on the running job stops it.
        assert main(["run", plan, "--address", addr, "--steps", "2", "--json"]) == 0
        capsys.readouterr()
        job = Job.attach("life", address=addr)
        try:
            job.stop()
        finally:
            job.close()
        assert main(["jobs", "--address", addr, "--json"]) == 0
        assert json.loads(capsys.readouterr().out) == []

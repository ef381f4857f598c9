"""Deterministic errors fail the job at once; only transient ones are tried again."""

from __future__ import annotations

import json

import pytest

from omniload_dask import Job, OmniloadError
from omniload_dask.cluster import retry
from omniload_dask.errors import RecordError, SourceError
from omniload_dask.plan import parse_plan

from .datagen import plan_dict, texts


class EndpointConnectionError(Exception):
    """Named as botocore's: an S3 endpoint nobody answers at (after botocore's own retries)."""


class ReadTimeoutError(Exception):
    """Named as botocore's and urllib3's: a read that timed out mid-stream."""


@pytest.mark.parametrize(
    "exc",
    [
        FileNotFoundError("no such file: a.jsonl"),
        PermissionError("denied"),
        ConnectionRefusedError("refused"),
        EndpointConnectionError("Could not connect to the endpoint URL"),
        RecordError("source 'web': record at offset 5: not JSON"),
        SourceError("source 'web': file 'a.jsonl.zst': data corruption"),
        UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"),
        ValueError("bad row group"),
    ],
)
def test_deterministic_errors_are_not_tried_again(exc):
    assert not retry.is_transient(exc)
    calls = []

    def read():
        calls.append(1)
        raise exc

    with pytest.raises(type(exc)):
        retry.with_retries(read, 5)
    assert len(calls) == 1


@pytest.mark.parametrize(
    "exc",
    [
        TimeoutError("timed out"),
        ConnectionResetError("reset by peer"),
        BrokenPipeError("broken pipe"),
        ReadTimeoutError("read timed out"),
    ],
)
def test_transient_errors_are_tried_again_then_raised(exc, monkeypatch):
    monkeypatch.setattr(retry, "FIRST_BACKOFF", 0.0)
    assert retry.is_transient(exc)
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) <= 2:
            raise exc
        return "shard"

    assert retry.with_retries(flaky, 2) == "shard"
    calls.clear()

    def broken():
        calls.append(1)
        raise exc

    with pytest.raises(type(exc)):
        retry.with_retries(broken, 2)
    assert len(calls) == 3


@pytest.mark.slow
def test_a_bad_record_with_on_error_raise_fails_the_job_after_one_try(tmp_path):
    # Dask's retries used to run the failing read again and again (each a "Compute Failed"
    # block in a worker's log) before the job failed. Now each read of the bad unit runs once
    # (the unit's next epoch may be read ahead too, under its own key).
    lines = [json.dumps({"text": t}) for t in texts(400, seed=1, mean_words=10)]
    lines[200] = "{not json"
    (tmp_path / "a.jsonl").write_text("\n".join(lines) + "\n")
    plan = parse_plan(
        plan_dict(
            [{"name": "web", "format": "jsonl", "path": str(tmp_path / "a.jsonl")}],
            name="badrecord",
            loader={"read_retries": 5},
        )
    )
    with Job.start(plan, workers=1, dashboard_address=None) as job:
        feeder = job.feeder(dp_rank=0, output="numpy")
        with pytest.raises(OmniloadError, match="record at offset"):
            for _ in feeder:
                pass
        logs = job.client.get_worker_logs()
    failed = [m for lines in logs.values() for _, m in lines if "Compute Failed" in m]
    keys = [m.split("Key:")[1].split()[0] for m in failed]
    assert keys and len(keys) == len(set(keys)), keys  # each failing read ran once

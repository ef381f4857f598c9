"""s3:// sources against a real S3-compatible server (moto in server mode) on loopback."""

from __future__ import annotations

from pathlib import Path

import pytest

from omniload_dask import Job, SourceError, TokenizerError
from omniload_dask.plan import parse_plan
from omniload_dask.testing import InlineDataPlane, batch_digest

from .datagen import plan_dict, texts, write_jsonl, write_parquet
from .test_tokenize import write_tokenizer

boto3 = pytest.importorskip("boto3")
moto_server = pytest.importorskip("moto.server")


@pytest.fixture(scope="module")
def s3():
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )
    client.create_bucket(Bucket="corpus")
    yield endpoint, client
    server.stop()


def options(endpoint: str) -> dict:
    return {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
        "config_kwargs": {"connect_timeout": 2, "retries": {"max_attempts": 2}},
    }


def sources(root: Path, prefix: str, opts: dict | None) -> list[dict]:
    extra = {"storage_options": opts} if opts else {}
    return [
        {
            "name": "web",
            "format": "jsonl",
            "path": f"{prefix}/web/*.jsonl",
            "weight": 2,
            "unit_bytes": 2048,
            **extra,
        },
        {
            "name": "books",
            "format": "parquet",
            "path": f"{prefix}/books/*.parquet",
            "text": "body",
            **extra,
        },
    ]


def test_s3_sources_and_tokenizer_give_the_same_stream_as_local_files(s3, tmp_path):
    endpoint, client = s3
    write_jsonl(tmp_path / "web" / "a.jsonl", texts(80, seed=5))
    write_jsonl(tmp_path / "web" / "b.jsonl", texts(40, seed=6))
    write_parquet(
        tmp_path / "books" / "c.parquet", texts(30, seed=7, mean_words=150), column="body"
    )
    write_tokenizer(tmp_path / "tok.json")
    for path in tmp_path.rglob("*"):
        if path.is_file():
            client.upload_file(str(path), "corpus", str(path.relative_to(tmp_path)))
    opts = options(endpoint)

    def plan_for(prefix: str, tok_path: str, tok_opts: dict | None):
        tok = {"kind": "huggingface", "path": tok_path, "bos": "<s>", "eos": "</s>"}
        if tok_opts:
            tok["storage_options"] = tok_opts
        return parse_plan(
            plan_dict(
                sources(tmp_path, prefix, tok_opts), name="s3", tokenizer=tok, layout={"dp": 2}
            )
        )

    local = plan_for(str(tmp_path), str(tmp_path / "tok.json"), None)
    remote = plan_for("s3://corpus", "s3://corpus/tok.json", opts)
    ref = [
        {g: batch_digest(b) for g, b in bs.items()} for _, bs in InlineDataPlane(local).stream(5)
    ]
    with Job.start(remote, workers=2, dashboard_address=None) as job:
        assert job.info["files"] == [2, 1]
        got = []
        feeders = [job.feeder(dp_rank=g, max_steps=5, output="numpy") for g in range(2)]
        for _ in range(5):
            step = {}
            for g, f in enumerate(feeders):
                step[g] = [
                    tuple(mb["input_ids"].tolist())
                    + tuple(mb["doc_id"].tolist())
                    + tuple(mb["cu_seqlens"].tolist())
                    + tuple(mb["labels"].tolist())  # (batch_digest's order)
                    for mb in next(f.steps())
                ]
            got.append(step)
    assert got == ref


def test_unreachable_endpoint_is_a_clear_start_up_error(tmp_path):
    opts = options("http://127.0.0.1:9")  # nothing listens on the discard port
    plan = parse_plan(
        plan_dict(
            [
                {
                    "name": "far",
                    "format": "jsonl",
                    "path": "s3://corpus/web/*.jsonl",
                    "storage_options": opts,
                }
            ],
            loader={"read_retries": 0},
        )
    )
    with pytest.raises(
        SourceError,
        match=r"source 'far': cannot list 's3://corpus/web/\*\.jsonl'"
        r": .*Could not connect",
    ):
        InlineDataPlane(plan)


def test_missing_s3_objects_and_tokenizer(s3):
    endpoint, _ = s3
    opts = options(endpoint)
    plan = parse_plan(
        plan_dict(
            [
                {
                    "name": "x",
                    "format": "jsonl",
                    "storage_options": opts,
                    "path": "s3://corpus/nothing/*.jsonl",
                }
            ]
        )
    )
    with pytest.raises(SourceError, match="matched no files"):
        InlineDataPlane(plan)
    from omniload_dask.plan import TokenizerSpec
    from omniload_dask.preprocess.tokenize import describe

    with pytest.raises(TokenizerError, match="does not exist"):
        describe(
            TokenizerSpec(
                kind="huggingface",
                path="s3://corpus/none.json",
                add_bos=False,
                add_eos=False,
                storage_options=opts,
            )
        )


def test_s3_credentials_from_the_environment_never_reach_an_output_or_the_checkpoint(
    s3, tmp_path, monkeypatch
):
    """Key, secret and endpoint as ${env:...}: resolved on the workers (and, for the
    checkpoint, the scheduler); the plan, the feeders' info, the figures and every checkpoint
    object hold the references only."""
    import json

    import zstandard

    endpoint, client = s3
    key, secret = "AKIAFROMTHEENVIRONMENT", "secret-from-the-environment-5d1e"
    monkeypatch.setenv("OMNILOAD_S3_KEY", key)
    monkeypatch.setenv("OMNILOAD_S3_SECRET", secret)
    monkeypatch.setenv("OMNILOAD_S3_ENDPOINT", endpoint)  # unresolved, nothing would be read
    write_jsonl(tmp_path / "env" / "a.jsonl", texts(60, seed=11))
    client.upload_file(str(tmp_path / "env" / "a.jsonl"), "corpus", "env/a.jsonl")
    opts = {
        "key": "${env:OMNILOAD_S3_KEY}",
        "secret": "${env:OMNILOAD_S3_SECRET}",
        "client_kwargs": {
            "endpoint_url": "${env:OMNILOAD_S3_ENDPOINT}",
            "region_name": "us-east-1",
        },
    }
    plan = parse_plan(
        plan_dict(
            [
                {
                    "name": "env",
                    "format": "jsonl",
                    "path": "s3://corpus/env/*.jsonl",
                    "storage_options": opts,
                }
            ],
            name="s3env",
            layout={"dp": 1},
            checkpoint={"url": "s3://corpus/ckpt-env", "storage_options": opts},
        )
    )
    with Job.start(plan, workers=1, dashboard_address=None) as job:
        with job.feeder(dp_rank=0, max_steps=3, output="numpy") as feeder:
            assert sum(mb["num_tokens"] for mb in feeder) > 0
        job.flush_checkpoint()
        shown = json.dumps([job.info, job.stats()])
    assert "${env:OMNILOAD_S3_SECRET}" in shown
    listed = client.list_objects_v2(Bucket="corpus", Prefix="ckpt-env/")["Contents"]
    assert any(o["Key"].endswith("MANIFEST.json") for o in listed)
    for obj in listed:
        blob = client.get_object(Bucket="corpus", Key=obj["Key"])["Body"].read()
        if obj["Key"].endswith(".zst"):
            blob = zstandard.ZstdDecompressor().decompressobj().decompress(blob)
        for text in (blob.decode(), shown):
            assert key not in text and secret not in text, obj["Key"]

"""Secure jobs: TLS with client certificates on every way in; credentials that never leak.

The TLS cluster is the security guide's (docs/guides/security.md, "A TLS cluster"): its
`dask scheduler` / `dask worker` / `omniload status` commands and trainer code are read from
that page and run as written, with this machine's host, ports and the certificates this
module's test CA makes; so is its credentials example.
"""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import re
import shlex
import ssl
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
import zstandard

from omniload_dask import Feeder, Job
from omniload_dask.cli.main import main as cli_main
from omniload_dask.plan import parse_plan
from omniload_dask.plan.credentials import (
    REDACTED,
    StorageOptions,
    is_credential_key,
    redact,
    resolve,
    scrub,
    without_credentials,
)
from omniload_dask.testing import InlineDataPlane

from .conftest import make_plan
from .datagen import plan_dict
from .pki import Authority

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "guides" / "security.md"
KEY = "AKIAOMNILOADLITERALKEY"
SECRET = "literal-secret-0b1f5e"
ENV_TOKEN = "token-from-the-env-77c2"
CONNECT_TIMEOUT = 3.0  # seconds a stranger's connection may take to be refused
WAIT = 60.0  # upper bound of every wait for the cluster


def guide_blocks(kind: str) -> list[str]:
    """The page's code blocks of one language, in order."""
    return re.findall(rf"```{kind}\n(.*?)```", GUIDE.read_text(), re.S)


def secret_plan(root: Path, name: str, **overrides: object):
    """A plan with literal credentials, a reference and a checkpoint (local files: the
    options reach fsspec's local filesystem, which takes and ignores them)."""
    opts = {
        "key": KEY,
        "secret": SECRET,
        "token": "${env:OMNILOAD_TEST_TOKEN}",
        "client_kwargs": {"aws_session_token": SECRET + "-nested", "region_name": "eu-1"},
    }
    data = make_plan(root, name=name, **overrides).to_dict()
    for src in data["sources"]:
        src["storage_options"] = opts
    if "checkpoint" in data:
        data["checkpoint"]["storage_options"] = {"password": SECRET + "-ckpt"}
    return parse_plan(data)


LEAKS = (KEY, SECRET, ENV_TOKEN)


def assert_no_leak(text: str, where: str) -> None:
    for value in LEAKS:
        assert value not in text, f"{where} shows a credential"


def checkpoint_text(folder: Path) -> str:
    """Every file of a checkpoint folder, decompressed, as one text."""
    out = []
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            blob = path.read_bytes()
            if path.suffix == ".zst":
                blob = zstandard.ZstdDecompressor().decompressobj().decompress(blob)
            out.append(blob.decode())
    assert out, f"no checkpoint files under {folder}"
    return "\n".join(out)


# ---------------------------------------------------------------------- credentials, no cluster
def test_what_counts_as_a_credential():
    for name in (
        "key",
        "secret",
        "token",
        "password",
        "aws_secret_access_key",
        "secretAccessKey",
        "sas_token",
        "Authorization",
        "client-secret",
        "private_key_id",
    ):
        assert is_credential_key(name), name
    for name in ("endpoint_url", "region_name", "anon", "use_ssl", "client_kwargs", "tokens"):
        assert not is_credential_key(name), name


def test_redacted_form_hides_values_keeps_references_and_url_passwords_are_hidden():
    data = {
        "storage_options": {
            "key": KEY,
            "secret": "${env:S3_SECRET}",
            "anon": False,
            "client_kwargs": {"endpoint_url": "http://s3:9000", "aws_session_token": SECRET},
            "headers": {"Authorization": "Bearer " + SECRET},
        },
        "path": ["https://reader:" + SECRET + "@host/data/*.jsonl"],
    }
    out = redact(data)
    assert out["storage_options"] == {
        "key": REDACTED,
        "secret": "${env:S3_SECRET}",
        "anon": False,
        "client_kwargs": {"endpoint_url": "http://s3:9000", "aws_session_token": REDACTED},
        "headers": {"Authorization": REDACTED},
    }
    assert out["path"] == ["https://reader:***@host/data/*.jsonl"]
    stripped = without_credentials(data)["storage_options"]
    assert stripped == {
        "anon": False,
        "client_kwargs": {"endpoint_url": "http://s3:9000"},
        "headers": {},
    }
    assert scrub(f"denied for {SECRET} and {KEY}", {SECRET, KEY}) == "denied for *** and ***"


def test_references_resolve_where_storage_is_opened_and_an_unset_one_is_named(monkeypatch):
    monkeypatch.setenv("OMNILOAD_TEST_TOKEN", ENV_TOKEN)
    opts = {"token": "${env:OMNILOAD_TEST_TOKEN}", "nested": {"x": ["${env:OMNILOAD_TEST_TOKEN}"]}}
    assert resolve(opts) == {"token": ENV_TOKEN, "nested": {"x": [ENV_TOKEN]}}
    monkeypatch.delenv("OMNILOAD_TEST_TOKEN")
    with pytest.raises(
        Exception,
        match=r"storage_options\.token: environment variable "
        r"OMNILOAD_TEST_TOKEN is not set",
    ):
        resolve(opts)


def test_a_malformed_reference_names_the_field_and_never_a_literal_value(small_sources):
    data = make_plan(small_sources).to_dict()
    data["sources"][0]["storage_options"] = {"secret": "${env:NOT A NAME}"}
    with pytest.raises(Exception, match=r"sources\[0\]\.storage_options\.secret: an environment"):
        parse_plan(data)
    data["sources"][0]["storage_options"] = SECRET
    with pytest.raises(Exception, match="must be a mapping") as err:
        parse_plan(data)
    assert SECRET not in str(err.value)


def test_specs_print_no_credentials_and_travel_whole(small_sources):
    plan = secret_plan(small_sources, "reprs")
    spec = plan.sources[0]
    assert_no_leak(repr(spec) + str(plan), "a spec's repr")
    assert isinstance(spec.storage_options, StorageOptions)
    assert dict(pickle.loads(pickle.dumps(spec)).storage_options)["secret"] == SECRET
    assert parse_plan(plan.to_dict()) == plan  # the real plan still goes to the scheduler


def test_the_fingerprint_does_not_depend_on_credentials(small_sources):
    plan = secret_plan(small_sources, "fp")
    rotated = plan.to_dict()
    for src in rotated["sources"]:  # other values, a literal moved to the environment and back
        src["storage_options"] = {
            **src["storage_options"],
            "key": "AKIAANOTHERKEY",
            "secret": "${env:OMNILOAD_TEST_SECRET}",
            "token": "a-literal-token",
        }
    assert parse_plan(rotated).stream_fingerprint() == plan.stream_fingerprint()
    assert parse_plan(plan.redacted()).stream_fingerprint() == plan.stream_fingerprint()
    plain = make_plan(small_sources, name="fp")  # no options at all: as before this change
    assert plain.stream_fingerprint() == parse_plan(plain.redacted()).stream_fingerprint()


def test_validate_prints_no_credentials(small_sources, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("OMNILOAD_TEST_TOKEN", ENV_TOKEN)  # validate lists the files from here
    plan = secret_plan(small_sources, "shown")
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan.to_dict()))
    for args in ([], ["--json"]):
        assert cli_main(["validate", str(path), *args]) == 0
        out = capsys.readouterr()
        assert_no_leak(out.out + out.err, "omniload validate")
        assert "${env:OMNILOAD_TEST_TOKEN}" in out.out and REDACTED in out.out


def test_a_checkpoint_of_a_plan_with_credentials_holds_none(small_sources, tmp_path, monkeypatch):
    monkeypatch.setenv("OMNILOAD_TEST_TOKEN", ENV_TOKEN)
    ckpt = tmp_path / "ckpt"
    plan = secret_plan(small_sources, "inline", checkpoint={"url": str(ckpt), "compact_every": 2})
    plane = InlineDataPlane(plan)
    list(plane.stream(6))
    assert_no_leak(checkpoint_text(ckpt), "the checkpoint")
    # resuming takes the options from the plan it resumes with
    again = InlineDataPlane(plan, resume=True)
    assert dict(again.coord.view.streams[0].spec.storage_options)["secret"] == SECRET


# ---------------------------------------------------------------------- a TLS cluster
@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    ca = Authority(root / "ca", "omniload-test-ca")
    other = Authority(root / "other", "someone-elses-ca")
    return SimpleNamespace(
        ca=ca,
        files={
            "ca.pem": ca.ca_file,
            **{f"{who}.pem": ca.issue(who).cert for who in ("scheduler", "worker", "trainer")},
        },
        other=other.issue("stranger"),
    )


def trainer_security(pki):
    from distributed import Security

    return Security(
        tls_ca_file=pki.ca.ca_file,
        tls_client_cert=pki.files["trainer.pem"],
        tls_client_key=pki.files["trainer.pem"][: -len(".pem")] + ".key",
        require_encryption=True,
    )


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def localise(command: str, pki, port: int) -> list[str]:
    """A command of the guide for this machine: its host, a free port, the test CA's files."""
    files = {**pki.files}
    for name, path in list(files.items()):
        files[name.replace(".pem", ".key")] = path[: -len(".pem")] + ".key"
    out = []
    for token in shlex.split(command):
        token = files.get(token, token)
        token = token.replace("scheduler:8786", f"127.0.0.1:{port}")
        token = token.replace("127.0.0.1:8787", "127.0.0.1:0")
        out.append(token)
    if out[:2] == ["dask", "scheduler"]:
        out[out.index("--port") + 1] = str(port)
        out += ["--host", "127.0.0.1"]
    bindir = Path(sys.executable).parent
    if out[0] == "dask":
        out[0] = str(bindir / "dask")
    elif out[0] == "omniload":
        out[:1] = [sys.executable, "-m", "omniload_dask.cli"]
    return out


@pytest.fixture(scope="module")
def tls_cluster(pki, tmp_path_factory):
    from distributed import Client

    commands = [line for line in guide_blocks("bash")[0].splitlines() if line.strip()]
    scheduler, worker, status = commands
    assert scheduler.startswith("dask scheduler") and worker.startswith("dask worker")
    port = free_port()
    env = {
        **os.environ,
        "DASK_DISTRIBUTED__DASHBOARD__EXPORT_TOOL": "False",
        "OMNILOAD_TEST_TOKEN": ENV_TOKEN,  # the workers' environment, not the trainer's
    }
    logs = tmp_path_factory.mktemp("logs")

    def spawn(cmd: str, name: str) -> subprocess.Popen:
        log = (logs / f"{name}.log").open("w")
        return subprocess.Popen(localise(cmd, pki, port), env=env, stdout=log, stderr=log)

    procs = [spawn(scheduler, "scheduler")]
    procs += [spawn(worker, f"worker{i}") for i in range(2)]
    try:
        sec = trainer_security(pki)
        address = f"tls://127.0.0.1:{port}"
        deadline = time.monotonic() + WAIT
        while True:
            try:
                client = Client(address, security=sec, timeout=5, set_as_default=False)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        client.wait_for_workers(2, timeout=WAIT)
        client.close()
        yield SimpleNamespace(
            address=address, port=port, security=sec, status=status, logs=logs, procs=procs
        )
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)


def run_guide_trainer(tls_cluster, pki, plan_path: Path) -> dict:
    """The guide's trainer code, run here with this machine's files and address."""
    (code,) = guide_blocks("python")
    key = pki.files["trainer.pem"][: -len(".pem")] + ".key"
    for name, path in {**pki.files, "trainer.key": key, "plan.yaml": str(plan_path)}.items():
        code = code.replace(f'"{name}"', repr(path))
    code = code.replace("scheduler:8786", f"127.0.0.1:{tls_cluster.port}")
    namespace: dict = {}
    exec(compile(code, "security.md", "exec"), namespace)
    return namespace


async def stranger_calls(address: str, connection_args: dict, plan: dict) -> list:
    """A stranger tries every way in: list, re-weight, update the plan, stop, attach."""
    from distributed.core import rpc

    calls = [
        ("omniload_jobs", {}),
        ("omniload_set_weights", {"job": "secure", "weights": {"web": 100.0}}),
        ("omniload_update_plan", {"job": "secure", "plan": plan}),
        ("omniload_stop", {"job": "secure"}),
        ("omniload_info", {"job": "secure"}),  # what a feeder asks first
    ]

    async def one(name: str, kwargs: dict) -> object:
        remote = rpc(address, connection_args=connection_args, timeout=CONNECT_TIMEOUT)
        try:
            return await asyncio.wait_for(getattr(remote, name)(**kwargs), WAIT)
        except Exception as exc:  # what the stranger gets instead of an answer
            return exc
        finally:
            await remote.close_rpc()

    return await asyncio.gather(*(one(name, kw) for name, kw in calls))


def strangers(pki, tls_cluster) -> dict[str, tuple[str, dict, object]]:
    """name -> (address, connection args, Security for a Feeder or None)."""
    from distributed import Security

    no_cert = ssl.create_default_context(cafile=pki.ca.ca_file)  # trusts the cluster, no cert
    no_cert.check_hostname = False
    other = Security(  # trusts the cluster's CA, but its certificate is another CA's
        tls_ca_file=pki.ca.ca_file,
        tls_client_cert=pki.other.cert,
        tls_client_key=pki.other.key,
        require_encryption=True,
    )
    plain = f"tcp://127.0.0.1:{tls_cluster.port}"
    return {
        "no certificate": (tls_cluster.address, {"ssl_context": no_cert}, None),
        "plain tcp": (plain, {}, Security(require_encryption=False)),
        "another CA": (tls_cluster.address, other.get_connection_args("client"), other),
    }


@pytest.mark.slow
def test_the_guides_tls_cluster_serves_its_trainers_and_refuses_strangers(
    tls_cluster, pki, small_sources, tmp_path, monkeypatch
):
    from omniload_dask.trainer import link

    ckpt = tmp_path / "ckpt"
    plan = secret_plan(
        small_sources,
        "secure",
        layout={"dp": 1},
        checkpoint={"url": str(ckpt), "flush_seconds": 0.2},
    )
    plan_path = tmp_path / "plan.yaml"
    plan_path.write_text(yaml.safe_dump(plan.to_dict()))
    assert "OMNILOAD_TEST_TOKEN" not in os.environ  # resolved on the workers only
    ns = run_guide_trainer(tls_cluster, pki, plan_path)
    job, feeder = ns["job"], ns["feeder"]
    try:
        first = [next(feeder)["input_ids"].tolist() for _ in range(4)]
        assert all(first)
        targets = [(r["name"], r["target_now"]) for r in job.mixture()]
        # feeders get no credentials; nor does any view of the job
        assert_no_leak(json.dumps(job.info), "the info reply")
        assert_no_leak(json.dumps(job.stats()), "job.stats()")
        assert_no_leak(json.dumps(feeder.stats()), "feeder.stats()")
        # the guide's status command, as written
        proc = subprocess.run(
            localise(tls_cluster.status, pki, tls_cluster.port),
            capture_output=True,
            text=True,
            timeout=WAIT,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "omniload job secure" in proc.stdout
        assert_no_leak(proc.stdout + proc.stderr, "omniload status")

        monkeypatch.setattr(link, "SCHEDULER_CONNECT_TIMEOUT", CONNECT_TIMEOUT)
        other_plan = make_plan(small_sources, name="secure", layout={"dp": 1}).to_dict()
        other_plan["sources"][0]["weight"] = 50.0
        for who, (address, args, security) in strangers(pki, tls_cluster).items():
            replies = asyncio.run(stranger_calls(address, args, other_plan))
            for reply in replies:
                # refused at the connection (TLS handshake), before any message is read
                assert isinstance(reply, OSError), f"{who} got an answer: {reply!r}"
            if security is not None:
                with pytest.raises((OSError, TimeoutError)):
                    Feeder("secure", address=address, security=security, dp_rank=0)
        # nothing changed: the job runs, with its weights, and its feeder goes on
        again = ns["Job"].attach(
            "secure", address=tls_cluster.address, security=tls_cluster.security
        )
        assert [(r["name"], r["target_now"]) for r in again.mixture()] == targets
        again.close()
        assert next(feeder)["num_tokens"] > 0
        job.flush_checkpoint()
    finally:
        feeder.close()
        job.stop()
        job.close()
    assert_no_leak(checkpoint_text(ckpt), "the checkpoint written by the scheduler")
    logs = "".join(p.read_text() for p in tls_cluster.logs.iterdir())
    assert_no_leak(logs, "the scheduler's and workers' logs")


@pytest.mark.slow
def test_a_plan_whose_variable_is_unset_on_the_workers_fails_naming_it(tls_cluster, small_sources):
    data = make_plan(small_sources, name="unset", layout={"dp": 1}).to_dict()
    data["sources"][0]["storage_options"] = {"key": KEY, "token": "${env:OMNILOAD_TEST_UNSET}"}
    with pytest.raises(Exception, match="environment variable OMNILOAD_TEST_UNSET is not set") as e:
        Job.start(parse_plan(data), address=tls_cluster.address, security=tls_cluster.security)
    assert_no_leak(str(e.value), "the error")
    # the workers logged the failed task, with its arguments (the source's spec)
    deadline = time.monotonic() + WAIT
    logs = ""
    while "Compute Failed" not in logs and time.monotonic() < deadline:
        time.sleep(0.2)
        logs = "".join(p.read_text() for p in tls_cluster.logs.iterdir())
    assert "Compute Failed" in logs and "OMNILOAD_TEST_UNSET" in logs
    assert_no_leak(logs, "the scheduler's and workers' logs")


@pytest.mark.slow
def test_a_node_agent_connects_with_its_ranks_security(tls_cluster, small_sources, monkeypatch):
    monkeypatch.setenv("OMNILOAD_AGENT_LINGER", "1")  # the agent leaves soon after its ranks
    plan = make_plan(small_sources, name="tlsnode", layout={"dp": 1})
    job = Job.start(plan, address=tls_cluster.address, security=tls_cluster.security)
    try:
        feeder = Feeder(
            "tlsnode",
            address=tls_cluster.address,
            security=tls_cluster.security,
            fanout="node",
            rank=0,
            node_ranks=[0],
            max_steps=2,
            output="numpy",
        )
        with feeder:
            assert sum(mb["num_tokens"] for mb in feeder) > 0
            assert feeder._link is None  # the agent process fetched, over TLS
        assert job.stats()["agent_requests"] >= 1
    finally:
        job.stop()
        job.close()


@pytest.mark.slow
def test_the_data_plane_client_reconnects_with_the_scheduler_s_certificate(
    tls_cluster, small_sources
):
    """``dask scheduler --tls-cert`` gives the scheduler its own certificate only: the data
    plane's client, and the one replacing it after a lost connection, present that one."""
    from .test_scale import assert_same, reference

    plan = make_plan(small_sources, name="tlsreconnect", layout={"dp": 1})
    ref = reference(plan, steps=8)
    job = Job.start(plan, address=tls_cluster.address, security=tls_cluster.security)
    try:
        with job.feeder(dp_rank=0, output="numpy", max_steps=8) as feeder:
            got = [next(feeder) for _ in range(len(ref[0]) // 2)]

            def cut(dask_scheduler):
                from omniload_dask.internals import server as _server

                _server.break_connection(dask_scheduler.plugins["omniload"]._client.current)

            job.client.run_on_scheduler(cut)
            got += list(feeder)

        def replaced(dask_scheduler):
            return dask_scheduler.plugins["omniload"]._client.replaced

        deadline = time.monotonic() + WAIT
        while job.client.run_on_scheduler(replaced) < 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert job.client.run_on_scheduler(replaced) >= 1
        assert job.stats()["error"] is None
    finally:
        job.stop()
        job.close()
    assert_same(ref, {0: got})


# ---------------------------------------------------------------------- the embedded cluster
def test_security_true_needs_the_embedded_cluster(small_plan):
    with pytest.raises(Exception, match="security=True makes temporary certificates"):
        Job.start(small_plan, address="tls://127.0.0.1:1", security=True)


@pytest.mark.slow
def test_the_embedded_cluster_on_tls_serves_its_dashboard_on_loopback(small_sources, monkeypatch):
    from omniload_dask.trainer import link

    monkeypatch.setenv("OMNILOAD_TEST_TOKEN", ENV_TOKEN)  # the workers inherit it
    plan = secret_plan(small_sources, "embedded", layout={"dp": 1}, loader={"tls": True})
    with Job.start(plan, workers=1) as job:
        address = job.client.scheduler.address
        assert address.startswith("tls://127.0.0.1:")
        assert job.dashboard_link.startswith("http://127.0.0.1:")
        with job.feeder(dp_rank=0, max_steps=1, output="numpy") as feeder:
            assert sum(mb["num_tokens"] for mb in feeder) > 0
        # a dataset made elsewhere (pickled, as into a DataLoader worker) carries the security
        ds = Feeder.dataset(
            "embedded",
            address=address,
            security=job.client.security,
            dp_rank=0,
            max_steps=1,
            output="numpy",
        )
        copy = pickle.loads(pickle.dumps(ds))
        assert sum(mb["num_tokens"] for mb in copy) > 0
        copy.feeder.close()
        monkeypatch.setattr(link, "SCHEDULER_CONNECT_TIMEOUT", CONNECT_TIMEOUT)
        with pytest.raises((OSError, TimeoutError)):  # Dask's config here: no TLS
            Feeder("embedded", address=address.replace("tls://", "tcp://"), dp_rank=0)
        with Job.attach("embedded", client=job.client) as again:  # the client's security
            assert again.info["run_id"] == job.info["run_id"]
            shown = again.plan.to_dict()  # the plan as the job shows it: credentials ***
            assert_no_leak(json.dumps(shown), "Job.attach(...).plan")
            shown["sources"][0]["weight"] = 5.0
            again.update_plan(parse_plan(shown))  # keeps the credentials the job has

        def secret_now(dask_scheduler):
            run = dask_scheduler.plugins["omniload"].jobs["embedded"]
            return dict(run.coord.view.streams[0].spec.storage_options)["secret"]

        assert job.client.run_on_scheduler(secret_now) == SECRET
        with job.feeder(dp_rank=0, start_step=1, max_steps=3, output="numpy") as feeder:
            assert sum(mb["num_tokens"] for mb in feeder) > 0


@pytest.mark.slow
def test_a_secured_feeder_survives_a_scheduler_restart(pki, small_sources, tmp_path):
    from distributed import Security

    from .test_faults import reference, take

    key = {name: path[: -len(".pem")] + ".key" for name, path in pki.files.items()}
    cluster_sec = Security(
        tls_ca_file=pki.ca.ca_file,
        tls_scheduler_cert=pki.files["scheduler.pem"],
        tls_scheduler_key=key["scheduler.pem"],
        tls_worker_cert=pki.files["worker.pem"],
        tls_worker_key=key["worker.pem"],
        tls_client_cert=pki.files["scheduler.pem"],
        tls_client_key=key["scheduler.pem"],
        require_encryption=True,
    )
    plan = make_plan(
        small_sources,
        name="tlsloss",
        layout={"dp": 1},
        checkpoint={"url": str(tmp_path / "ckpt"), "flush_seconds": 0.2},
    )
    ref = reference(make_plan(small_sources, name="tlsloss", layout={"dp": 1}), 10)
    port = free_port()
    opts = dict(workers=2, scheduler_port=port, dashboard_address=None, security=cluster_sec)
    job = Job.start(plan, **opts)
    address = job.client.scheduler.address
    assert address.startswith("tls://")
    feeder = Feeder(
        "tlsloss",
        address=address,
        security=trainer_security(pki),
        dp_rank=0,
        output="numpy",
        reconnect_timeout=120,
    )
    got: dict = {}
    try:
        take([feeder], 4, got)
        job.flush_checkpoint()
        job.cluster.close()  # the scheduler and its workers are gone
        job.client.close()
        again = Job.start(plan, resume=True, **opts)
        try:
            assert again.info["resumed"] and again.info["run_id"] != job.info["run_id"]
            take([feeder], 6, got)  # more than it holds: it fetched from the new scheduler
        finally:
            again.close()
    finally:
        feeder.close()
    assert got == {t: ref[t] for t in range(10)}


def test_the_cli_names_a_missing_tls_option(pki, capsys):
    args = ["status", "--address", "tls://127.0.0.1:1", "--tls-ca-file", pki.ca.ca_file, "--once"]
    assert cli_main(args) == 2
    assert "give --tls-cert too" in capsys.readouterr().err
    assert cli_main([*args[:3], "--tls-ca-file", "missing.pem", "--tls-cert", "x.pem"]) == 2
    assert "--tls-ca-file: no such file 'missing.pem'" in capsys.readouterr().err


@pytest.mark.slow
def test_omniload_run_tls_runs_the_embedded_cluster_on_tls(small_sources, tmp_path, capsys):
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(make_plan(small_sources, name="clitls").to_dict()))
    assert cli_main(["run", str(path), "--tls", "--steps", "2", "--workers", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == 2


def test_error_texts_shown_by_a_job_lose_the_plan_s_credentials(small_sources, monkeypatch):
    from omniload_dask.cluster.stats import _scrubbed

    monkeypatch.setenv("OMNILOAD_TEST_TOKEN", ENV_TOKEN)
    plan = secret_plan(small_sources, "errors")
    secrets = plan.secrets()
    assert {KEY, SECRET, SECRET + "-nested", ENV_TOKEN} <= secrets
    out = _scrubbed(
        {
            "error": f"read failed: AccessDenied for key {KEY} (token {ENV_TOKEN})",
            "checkpoint_error": f"cannot write s3://me:{SECRET}@bucket/ckpt",
            "sources": [{"bad_examples": [f"record with {SECRET}-nested in it"]}],
        },
        secrets,
    )
    assert_no_leak(json.dumps(out), "a job's error texts")
    assert out["error"] == "read failed: AccessDenied for key *** (token ***)"


def test_the_guides_credentials_example_is_a_valid_source_with_references(monkeypatch):
    (block,) = guide_blocks("yaml")
    source = yaml.safe_load(block)["sources"][0]
    plan = parse_plan(plan_dict([source]))
    opts = plan.sources[0].storage_options
    assert opts["secret"] == "${env:S3_SECRET}"
    assert plan.redacted()["sources"][0]["storage_options"] == dict(opts)  # nothing to hide
    monkeypatch.setenv("S3_KEY", KEY)
    monkeypatch.setenv("S3_SECRET", SECRET)
    assert resolve(opts)["secret"] == SECRET and resolve(opts)["key"] == KEY

"""Per-source transforms and filters: counted, seeded, resumable, and bad input named."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from distributed import Client

from omniload_dask import Job, local_cluster
from omniload_dask.errors import JobError, PlanError
from omniload_dask.plan import parse_plan
from omniload_dask.preprocess.fim import FIM_MIDDLE, FIM_PREFIX, FIM_SUFFIX, fill_in_the_middle
from omniload_dask.preprocess.transforms import record_rng
from omniload_dask.testing import InlineDataPlane, batch_digest, check_resume_equivalence

from .datagen import plan_dict, texts, write_jsonl
from .tokendata import VOCAB, documents, write_megatron


def text_source(root: Path, **kw: object) -> dict:
    write_jsonl(root / "code" / "a.jsonl", texts(150, seed=21, prefix="c"))
    return {"name": "code", "format": "jsonl", "path": str(root / "code"), "unit_bytes": 4096,
            "epochs": 1, **kw}  # fmt: skip


def token_source(root: Path, **kw: object) -> dict:
    write_megatron(root / "m" / "c", documents(150, seed=22))
    return {"name": "meg", "format": "megatron", "path": str(root / "m" / "c"),
            "vocabulary": VOCAB, "unit_bytes": 2048, "epochs": 1, **kw}  # fmt: skip


def drain(run: InlineDataPlane, steps: int = 200) -> list:
    """Every step's digest until the plan's sources end."""
    out = []
    for t, batches in run.stream(steps):
        out.append({g: batch_digest(b) for g, b in batches.items()})
        if run.coord.view.end_step is not None and t + 1 >= run.coord.view.end_step:
            break
    return out


def test_a_filter_drops_records_and_counts_them_per_source(tmp_path):
    src = text_source(tmp_path, filter="tests.user_code:keep_long")
    run = InlineDataPlane(parse_plan(plan_dict([src])))
    drain(run)
    stats = run.coord.view.stats()["sources"][0]
    short = sum(len(t) < 140 for t in texts(150, seed=21, prefix="c"))
    assert short > 0
    assert stats["filtered"] == short and stats["documents"] == 150 - short


def test_the_stream_with_an_rng_transform_is_the_same_after_resume_at_every_step(tmp_path):
    src = token_source(tmp_path, transform="tests.user_code:shuffle_tokens", epochs=None)
    code = text_source(tmp_path, transform="omniload_dask.preprocess.fim:fill_in_the_middle",
                       epochs=None)  # fmt: skip
    plan = parse_plan(plan_dict([src, code], checkpoint={"url": str(tmp_path / "ckpt")}))
    assert check_resume_equivalence(plan, 12, list(range(12))) == sum(range(1, 13))
    # and the transform did change the stream (a run without it differs)
    plain = parse_plan(plan_dict([{**src, "transform": None}, {**code, "transform": None}]))
    with_code = parse_plan(plan_dict([src, code]))
    assert drain(InlineDataPlane(plain), 6)[:6] != drain(InlineDataPlane(with_code), 6)[:6]


def test_the_rng_is_a_function_of_seed_source_sample_and_epoch():
    a = record_rng(3, "code", 12345, 0).random(4)
    assert np.array_equal(a, record_rng(3, "code", 12345, 0).random(4))
    for other in (record_rng(4, "code", 12345, 0), record_rng(3, "web", 12345, 0),
                  record_rng(3, "code", 12346, 0), record_rng(3, "code", 12345, 1)):  # fmt: skip
        assert not np.array_equal(a, other.random(4))


def test_fill_in_the_middle_rearranges_and_keeps_every_character():
    text = "def add(a, b):\n    return a + b\n"
    moved = 0
    for sample in range(40):
        out = fill_in_the_middle({"text": text, "id": sample}, record_rng(1, "code", sample, 0))
        if out["text"] == text:
            continue
        moved += 1
        body = out["text"]
        assert body.startswith(FIM_PREFIX)
        prefix, rest = body[len(FIM_PREFIX) :].split(FIM_SUFFIX)
        suffix, middle = rest.split(FIM_MIDDLE)
        assert prefix + middle + suffix == text
    assert 5 < moved < 35  # about half


def test_an_exception_in_a_transform_is_a_bad_record_under_on_error(tmp_path):
    write_jsonl(tmp_path / "t" / "a.jsonl", ["fine text", "a boom here", "more fine text"])
    src = {"name": "t", "format": "jsonl", "path": str(tmp_path / "t"), "epochs": 1,
           "transform": "tests.user_code:explode_on_marker"}  # fmt: skip
    with pytest.raises(JobError, match=r"a\.jsonl'?: record at offset 30: tests\.user_code:"
                                       r"explode_on_marker raised ValueError: found a boom"):  # fmt: skip
        drain(InlineDataPlane(parse_plan(plan_dict([src]))))
    run = InlineDataPlane(parse_plan(plan_dict([src], on_error="skip")))
    drain(run)
    stats = run.coord.view.stats()["sources"][0]
    assert stats["skipped"] == 1 and stats["documents"] == 2


def test_wrong_return_types_and_ids_past_the_vocabulary_are_bad_records(tmp_path):
    write_jsonl(tmp_path / "t" / "a.jsonl", ["one", "two"])
    src = {"name": "t", "format": "jsonl", "path": str(tmp_path / "t"), "epochs": 1,
           "transform": "tests.user_code:wrong_type"}  # fmt: skip
    with pytest.raises(JobError, match=r"returned str; expected the record \(a dict with 'text'"):
        drain(InlineDataPlane(parse_plan(plan_dict([src]))))
    tok = token_source(tmp_path, transform="tests.user_code:past_the_vocabulary")
    with pytest.raises(JobError, match=r"returned token ids in \[\d+, 4000\], outside the vocab"):
        drain(InlineDataPlane(parse_plan(plan_dict([tok]))))


def test_a_transform_that_does_not_import_fails_discovery_naming_it(tmp_path):
    src = text_source(tmp_path, transform="tests.no_such_module:fn")
    with pytest.raises(PlanError, match=r"source 'code': transform: cannot import module "
                                        r"'tests\.no_such_module'"):  # fmt: skip
        InlineDataPlane(parse_plan(plan_dict([src])))
    src = text_source(tmp_path, filter="tests.user_code:no_such_function")
    with pytest.raises(PlanError, match=r"filter: module 'tests\.user_code' has no function"):
        InlineDataPlane(parse_plan(plan_dict([src])))


def test_transforms_on_a_token_source_and_a_text_source_on_a_real_cluster(tmp_path):
    plan = parse_plan(
        plan_dict(
            [
                token_source(tmp_path, transform="tests.user_code:shuffle_tokens", epochs=None),
                text_source(tmp_path, filter="tests.user_code:keep_long", epochs=None),
            ],
            name="user-code",
        )
    )
    ref = drain(InlineDataPlane(plan), 6)[:6]
    with local_cluster(2, dashboard_address=None) as cluster, Client(cluster) as client:
        job = Job.start(plan, client=client)
        got: list[dict] = [{} for _ in range(6)]
        for g in range(plan.layout.dp):
            with job.feeder(dp_rank=g, max_steps=6, output="numpy") as feeder:
                for t, micro in enumerate(feeder.steps()):
                    from omniload_dask.batching.formats import GroupBatch

                    got[t][g] = batch_digest(GroupBatch(t, g, list(micro)))
        stats = job.stats()["sources"]
        job.stop()
    assert got == ref  # workers in other processes draw the same numbers
    assert all(isinstance(s["filtered"], int) for s in stats)  # (counted as units pass)


def test_validate_lists_token_sources_and_imports_user_code(tmp_path):
    import subprocess
    import sys

    import yaml

    src = token_source(tmp_path, transform="omniload_dask.preprocess.fim:fill_in_the_middle")
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(plan_dict([src])))
    bad = tmp_path / "bad.yaml"
    other = {**src, "name": "other", "vocabulary": {"size": 50257}, "filter": "nope.x:y"}
    bad.write_text(yaml.safe_dump(plan_dict([src, other])))

    def validate(path: Path) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "omniload_dask.cli", "validate", str(path)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip

    ok = validate(good)
    assert ok.returncode == 0, ok.stderr
    assert "fill_in_the_middle imports" in ok.stderr
    tokens = sum(len(d) for d in documents(150, seed=22))
    assert (
        f'token source \'meg\': {{"vocabulary": {{"size": 258, "eos_id": 257}}, "dtype": '
        f'"uint16", "files": 1, "documents": 150, "tokens": {tokens}}}' in ok.stderr
    )
    no = validate(bad)
    assert no.returncode == 2
    assert "sources[1].filter: cannot import module 'nope.x'" in no.stderr
    assert "sources[1].vocabulary.size: 50257, but the plan's tokenizer has 258 ids" in no.stderr


@pytest.mark.slow
def test_a_worker_killed_and_a_job_resumed_keep_the_stream_of_rng_transforms(tmp_path):
    # Transforms that draw from their generators, on worker processes. With no standby
    # copies, the worker holding the most of the job's shards and blocks that no other holds
    # is killed -9: Dask reads and builds them again elsewhere, the transforms running again
    # there, and the later steps are built from them. Then a new job resumes from the
    # checkpoint. Every step of every rank, tokens included, is what the inline data plane
    # gives without a fault.
    from .test_faults import reference, take

    src = token_source(tmp_path, transform="tests.user_code:shuffle_tokens", epochs=None)
    code = text_source(tmp_path, transform="omniload_dask.preprocess.fim:fill_in_the_middle",
                       epochs=None)  # fmt: skip
    loader = {"standby": False, "prefetch": 2}
    ref = reference(parse_plan(plan_dict([src, code], name="rng-kill", loader=loader)), 100)
    ckpt = {"url": str(tmp_path / "ckpt")}
    plan = parse_plan(plan_dict([src, code], name="rng-kill", loader=loader, checkpoint=ckpt))
    got: dict = {}
    with Job.start(plan, workers=2, dashboard_address=None) as job:
        feeders = [job.feeder(dp_rank=g, output="numpy") for g in range(2)]
        take(feeders, 4, got)
        _kill_the_sole_holder(job)
        take(feeders, 76, got)  # (past the blocks built before the kill)
        job.flush_checkpoint()
    assert got == {t: ref[t] for t in range(80)}
    resumed: dict = {}
    with Job.start(plan, workers=2, resume=72, dashboard_address=None) as job:
        assert job.info["start_step"] == 72
        take([job.feeder(dp_rank=g, output="numpy") for g in range(2)], 28, resumed)
    assert resumed == {t: ref[t] for t in range(72, 100)}


@pytest.mark.slow
def test_a_transform_that_gives_other_tokens_when_a_read_is_made_again_stops_the_job(tmp_path):
    # A transform drawing from numpy's global generator, not its own: the first read of a
    # unit and the read made again after its worker is killed give other tokens (of the same
    # counts). The job stops naming the source and the read, instead of building batches
    # from a shard that no longer matches the steps dealt from the first.
    from .test_faults import take

    src = token_source(tmp_path, transform="tests.user_code:unseeded_shuffle", epochs=None)
    plan = parse_plan(plan_dict([src], name="unseeded", loader={"standby": False}))
    with Job.start(plan, workers=2, dashboard_address=None) as job:
        feeders = [job.feeder(dp_rank=g, output="numpy") for g in range(2)]
        take(feeders, 4, {})
        _kill_the_sole_holder(job, reads_only=True)
        with pytest.raises(JobError) as err:
            for _ in range(400):
                for f in feeders:
                    next(f.steps())
    text = str(err.value)
    assert "source 'meg': read omniload-read-" in text, text
    assert "was made again" in text and "other tokens" in text, text


def test_a_later_report_of_a_read_is_compared_with_its_first():
    from omniload_dask.core.rereads import FirstReports, reread_change, tokens_digest

    before = np.array([5, 7, 9])
    assert reread_change(before, np.array([5, 7, 9]), 1, 1) is None
    assert reread_change(before, np.array([5, 7, 9]), None, 1) is None  # (no digest: counts)
    assert "other tokens" in str(reread_change(before, np.array([5, 7, 9]), 1, 2))
    assert reread_change(before, np.array([5, 7]), 1, 1) == (
        "2 records of 12 tokens, against 3 records of 21 tokens the first time"
    )
    assert tokens_digest(np.arange(4, dtype=np.uint32)) != tokens_digest(np.arange(4) + 1)
    # each read (a unit's portions are reads of their own) against its own first report
    first, stream = FirstReports(), SimpleNamespace(units={}, spec=SimpleNamespace(name="s"))
    assert first.check("r-p0", stream, (0, 0), 0, np.array([3, 4]), 7) is None
    assert first.check("r-p1", stream, (0, 0), 1, np.array([8]), 9) is None
    assert first.check("r-p0", stream, (0, 0), 0, np.array([3, 4]), 7) is None
    assert first.check("r-p1", stream, (0, 0), 1, np.array([8]), 9) is None
    changed = first.check("r-p1", stream, (0, 0), 1, np.array([8]), 5)
    assert changed is not None and "source 's': read r-p1 (its unit)" in changed
    first.forget("r-p1")
    assert first.check("r-p1", stream, (0, 0), 1, np.array([2]), 5) is None


def _kill_the_sole_holder(job: Job, reads_only: bool = False) -> None:
    """Let the job settle, then kill -9 the worker holding the most of the shards and blocks
    (``reads_only``: shards) the job still holds and no other worker has; wait (bounded)
    until Dask made something of it again."""
    import os
    import signal
    import time

    from .test_faults import wait_settled

    wait_settled(job, standby=False)
    wanted = set(job.client.run_on_scheduler(_held_keys))  # (still to be used)
    if reads_only:
        wanted = {key for key in wanted if key.startswith("omniload-read-")}
    held = {w: set(keys) & wanted for w, keys in job.client.has_what().items()}
    only = {w: held[w].difference(*(k for v, k in held.items() if v != w)) for w in held}
    victim = max(sorted(only), key=lambda w: len(only[w]))
    assert only[victim], only
    os.kill(job.client.run(os.getpid)[victim], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while not _made_again(job.stats()):
        assert time.monotonic() < deadline, "what the killed worker held was not made again"
        time.sleep(0.05)


def _held_keys(dask_scheduler) -> list[str]:
    """The keys of the shards and blocks every job on the scheduler holds (to be used)."""
    return [
        key
        for run in dask_scheduler.plugins["omniload"].jobs.values()
        for key in run.executor.futures
    ]


def _made_again(stats: dict) -> int:
    """Shards and blocks the job had to make again (their worker died)."""
    return int(stats["reads_recomputed"] + stats["batches_recomputed"])

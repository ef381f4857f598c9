"""Differential checkpoints: exact resume at any step, elastic resume, bad checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omniload_dask import CheckpointError
from omniload_dask.checkpoint import Checkpoint
from omniload_dask.cli import main
from omniload_dask.core.blocks import steps_per_task
from omniload_dask.plan import SourceSpec
from omniload_dask.testing import InlineDataPlane, batch_digest, check_resume_equivalence

from .test_live_mixing import make, sources


def pieces(batches) -> list[tuple[int, int, int]]:
    """Which tokens of which documents a step delivered, whatever the split across ranks."""
    out = []
    for b in batches.values():
        for mb in b.micro_batches:
            lengths = (mb["cu_seqlens"][1:] - mb["cu_seqlens"][:-1]).tolist()
            for d, o, n in zip(
                mb["doc_id"].tolist(), mb["doc_offset"].tolist(), lengths, strict=True
            ):
                out += [(d, t) for t in range(o, o + n)]
    return sorted(out)


def ckpt(root: Path, **extra) -> dict:
    return {"checkpoint": {"url": str(root / "ckpt"), **extra}}


@pytest.mark.parametrize("together", [1, 6])
def test_restoring_at_every_step_gives_the_same_batches(corpus, tmp_path, together):
    # together: the checkpoint written while steps are drawn ahead and dealt side by side,
    # as the scheduler plugin's dealing thread does (each delta is its own draw's)
    plan = make(corpus, **ckpt(tmp_path, compact_every=7, keep_bases=50))
    compared = check_resume_equivalence(plan, 30, list(range(0, 30)), together=together)
    assert compared == sum(range(1, 31))


def test_resume_replays_live_changes_and_sources_that_joined(corpus, tmp_path):
    plan = make(corpus, **ckpt(tmp_path))
    run = InlineDataPlane(plan)
    ref = {t: {g: batch_digest(b) for g, b in bs.items()} for t, bs in run.stream(8)}
    run.coord.set_weights({"a": 0.1}, at_step=run.coord.view.next_step + 1)
    d = SourceSpec(name="d", format="jsonl", paths=(str(corpus / "d.jsonl"),), weight=0.4)
    joined = run.add_source(d, at_step=run.coord.view.next_step + 3)
    ref.update(
        {t: {g: batch_digest(b) for g, b in bs.items()} for t, bs in run.stream(20, start=8)}
    )
    run.checkpoint()
    for step in (5, joined - 1, joined + 4):
        again = InlineDataPlane(plan, resume=step)
        for t, bs in again.stream(28 - step, start=step):
            assert {g: batch_digest(b) for g, b in bs.items()} == ref[t], (step, t)
    summary = Checkpoint(str(tmp_path / "ckpt")).summary()
    assert [e["kind"] for e in summary["log"]] == ["weights", "add"]


def test_a_resume_inside_a_delta_file_keeps_the_steps_before_it_restorable(corpus, tmp_path):
    # Blocks of 8 steps: one flush writes the deltas of 8 steps at once, so a resume at step
    # 12 starts inside a delta file (steps 8-15). Its first steps must stay restorable.
    plan = make(corpus, loader={"steps_per_task": 8}, **ckpt(tmp_path))
    run = InlineDataPlane(plan)
    list(run.stream(20))
    run.checkpoint()
    before = Checkpoint(str(tmp_path / "ckpt"))
    assert any(s["first"] < 12 <= s["last"] for s in before.manifest.segments)
    states = {t: before.state_at(t) for t in range(12)}
    again = InlineDataPlane(plan, resume=12)
    list(again.stream(4, start=12))
    again.checkpoint()
    after = Checkpoint(str(tmp_path / "ckpt"))
    assert all(after.state_at(t) == states[t] for t in range(12))  # the old timeline's
    assert after.latest_step > 12


def test_elastic_resume_with_another_dp_size_continues_the_global_stream(corpus, tmp_path):
    plan = make(corpus, **ckpt(tmp_path))
    ref = {t: pieces(bs) for t, bs in InlineDataPlane(plan).stream(20)}
    wider = make(corpus, layout={"dp": 4}, **ckpt(tmp_path))
    again = InlineDataPlane(wider, resume=9)
    assert again.coord.view.next_step == 9
    for t, bs in again.stream(11, start=9):
        assert len(bs) == 4
        assert pieces(bs) == ref[t]


def test_changed_weights_and_sources_carry_the_saved_cursors_on(corpus, tmp_path):
    plan = make(corpus, **ckpt(tmp_path))
    first = InlineDataPlane(plan)
    list(first.stream(12))
    first.checkpoint()
    saved = {s.spec.name: s.state_dict() for s in first.coord.view.streams}
    srcs = [s for s in sources(corpus) if s["name"] != "b"]
    srcs[0]["weight"] = 0.9
    srcs.append({"name": "d", "format": "jsonl", "path": str(corpus / "d.jsonl"), "weight": 0.3})
    changed = make(corpus, sources=srcs, **ckpt(tmp_path))
    at = 6
    at_six = Checkpoint(str(tmp_path / "ckpt")).state_at(at)
    again = InlineDataPlane(changed, resume=at)
    restored = {s.spec.name: s.state_dict() for s in again.coord.view.streams}
    for src in at_six["sources"]:  # the saved cursors, as they were at step 6
        assert list(restored[src["spec"]["name"]].values()) == src["state"]
    assert restored["a"]["docs"] < saved["a"]["docs"]  # the cursor of step 6, not of step 12
    again.draw(10)
    names = again.coord.view.names
    assert names[:3] == ["a", "b", "c"] and names[3] == "d"
    assert again.coord.view.streams[1].retired
    assert again.coord.view.streams[3].docs > 0
    assert restored["b"]["docs"] <= saved["b"]["docs"]
    figs = [f for f in again.coord.view.history if f.step >= at]
    assert all(f.source_documents[1] == 0 for f in figs)  # b removed from the resumed step


def test_a_fresh_job_refuses_to_overwrite_an_existing_checkpoint(corpus, tmp_path):
    plan = make(corpus, **ckpt(tmp_path))
    list(InlineDataPlane(plan).stream(5))
    manifest = (tmp_path / "ckpt" / "MANIFEST.json").read_bytes()
    with pytest.raises(CheckpointError, match="already holds a checkpoint"):
        InlineDataPlane(plan)
    assert (tmp_path / "ckpt" / "MANIFEST.json").read_bytes() == manifest


def test_a_checkpoint_of_another_plan_is_refused_and_left_alone(corpus, tmp_path):
    plan = make(corpus, **ckpt(tmp_path))
    list(InlineDataPlane(plan).stream(5))
    before = {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()}
    other = make(corpus, seed=99, **ckpt(tmp_path))
    with pytest.raises(CheckpointError, match="belongs to another plan: seed: 3 in the checkpoint"):
        InlineDataPlane(other, resume=True)
    moved = [dict(s) for s in sources(corpus)]
    moved[0]["path"] = str(corpus / "d.jsonl")
    with pytest.raises(CheckpointError, match=r"sources.a: paths changed"):
        InlineDataPlane(make(corpus, sources=moved, **ckpt(tmp_path)), resume=True)
    assert {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()} == before


def test_corrupt_truncated_or_unknown_checkpoints_are_clear_errors(corpus, tmp_path):
    plan = make(corpus, **ckpt(tmp_path))
    list(InlineDataPlane(plan).stream(5))
    root = tmp_path / "ckpt"
    manifest = json.loads((root / "MANIFEST.json").read_text())
    base = root / manifest["bases"][0]["file"]
    good = base.read_bytes()
    base.write_bytes(good[: len(good) // 2])
    with pytest.raises(CheckpointError, match=r"file 'base-.*' is corrupt or truncated"):
        InlineDataPlane(plan, resume=True)
    base.write_bytes(good)
    (root / "MANIFEST.json").write_text(json.dumps({**manifest, "version": 99}))
    with pytest.raises(CheckpointError, match="format version 99"):
        Checkpoint(str(root))
    (root / "MANIFEST.json").write_text(json.dumps(manifest)[:40])
    with pytest.raises(CheckpointError, match="MANIFEST.json is corrupt or truncated"):
        Checkpoint(str(root))
    with pytest.raises(CheckpointError, match="no MANIFEST.json"):
        Checkpoint(str(tmp_path / "nowhere"))
    (root / "MANIFEST.json").write_text(json.dumps(manifest))
    seg = root / manifest["segments"][0]["file"]
    seg.unlink()
    with pytest.raises(CheckpointError, match="is missing"):
        Checkpoint(str(root)).state_at()


def test_compaction_keeps_a_bounded_number_of_files(corpus, tmp_path):
    plan = make(corpus, **ckpt(tmp_path, compact_every=5, keep_bases=2))
    run = InlineDataPlane(plan)
    list(run.stream(40))
    saved = Checkpoint(str(tmp_path / "ckpt"))
    assert len(saved.manifest.bases) == 2
    files = {p.name for p in (tmp_path / "ckpt").iterdir()}
    listed = {e["file"] for e in saved.manifest.bases + saved.manifest.segments}
    assert files == listed | {"MANIFEST.json"}
    first, last = saved.first_step, saved.latest_step
    # a base every 5 steps, taken where no step waits for the rest of its block
    assert last >= 40 and first >= last - (5 + steps_per_task(plan) - 1)
    with pytest.raises(CheckpointError, match=f"can restore steps {first} to {last}, not 0"):
        saved.state_at(0)


def test_deltas_are_small(corpus, tmp_path):
    plan = make(corpus, **ckpt(tmp_path, compact_every=100000))
    run = InlineDataPlane(plan, build=False)
    run.draw(200)
    stats = run.writer.stats()
    assert stats["steps_written"] >= 200
    segments = Checkpoint(str(tmp_path / "ckpt")).manifest.segments
    per_step = sum(s["bytes"] for s in segments) / stats["steps_written"]
    assert per_step < 1024, per_step


def test_cli_inspect_shows_the_cursors(corpus, tmp_path, capsys):
    plan = make(corpus, **ckpt(tmp_path))
    list(InlineDataPlane(plan).stream(6))
    assert main(["checkpoint", "inspect", str(tmp_path / "ckpt")]) == 0
    out = capsys.readouterr().out
    assert "restorable      steps 0 to" in out
    assert all(name in out for name in ("a ", "b ", "c "))
    assert main(["checkpoint", "inspect", str(tmp_path / "nope")]) == 2
    assert "no MANIFEST.json" in capsys.readouterr().err


def _edit(root: Path, change, digest: bool = False) -> None:
    """Rewrite MANIFEST.json with ``change`` applied (and a recomputed digest if asked)."""
    data = json.loads((root / "MANIFEST.json").read_text())
    change(data)
    if digest:
        from omniload_dask.checkpoint.manifest import manifest_digest

        data["manifest_sha256"] = manifest_digest(data)
    (root / "MANIFEST.json").write_text(json.dumps(data, indent=1))


def test_a_manifest_edited_into_other_valid_json_is_refused_not_resumed_elsewhere(
    corpus, tmp_path, capsys
):
    plan = make(corpus, **ckpt(tmp_path, compact_every=8, keep_bases=5))
    run = InlineDataPlane(plan)
    list(run.stream(30))
    run.checkpoint()
    root = tmp_path / "ckpt"
    good = (root / "MANIFEST.json").read_bytes()
    before = Checkpoint(str(root))
    target = before.latest_step - 2  # restored from a base and some deltas
    base = max(b["step"] for b in before.manifest.bases if b["step"] <= target)
    assert base < target - 1

    def later_rank(d):
        d["positions"]["0"] += 7

    def earlier_latest(d):
        d["latest_step"] -= 20

    def fewer_segments(d):  # the one that holds the step after that base
        d["segments"] = [g for g in d["segments"] if not g["first"] <= base + 1 <= g["last"]]

    for change in (later_rank, earlier_latest, fewer_segments):
        _edit(root, change)
        with pytest.raises(CheckpointError, match="MANIFEST.json was changed after it was written"):
            InlineDataPlane(plan, resume=True)
        assert main(["checkpoint", "inspect", str(root)]) == 2  # no claim of the old range
        assert "was changed after it was written" in capsys.readouterr().err
        (root / "MANIFEST.json").write_bytes(good)
    # even with a digest that matches (a tool rewrote it), a gap in the deltas is found
    _edit(root, fewer_segments, digest=True)
    saved = Checkpoint(str(root))
    with pytest.raises(CheckpointError, match=rf"restore step {target}: its delta files lack "):
        saved.state_at(target)
    (root / "MANIFEST.json").write_bytes(good)
    # a delta changed in place (same length) is called corrupt, not truncated
    held = [g for g in json.loads(good)["segments"] if g["first"] <= base + 1 <= g["last"]]
    seg = root / held[0]["file"]
    blob = bytearray(seg.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    seg.write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match=r"is corrupt: its bytes have changed since") as err:
        InlineDataPlane(plan, resume=target)
    assert "truncated" not in str(err.value)

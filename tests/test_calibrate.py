"""Cost calibration: the fit recovers known terms, a real CPU run writes a file a plan loads,
and bad calibration files or models are named in the error."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from omniload_dask import PlanError, load_plan, parse_plan
from omniload_dask.batching.balance import Bucket, balance
from omniload_dask.calibrate import (
    TERMS,
    CalibrationError,
    MicroBatch,
    calibrate,
    check_fit,
    features,
    fit_grid,
    fit_terms,
    held_back,
    nnls,
)
from omniload_dask.calibrate.batches import packed_arrays
from omniload_dask.calibrate.fit import rank_correlation
from omniload_dask.calibrate.runner import load_model
from omniload_dask.cli import main
from omniload_dask.plan.cost import CostModel

from .datagen import plan_dict

SRC = {"name": "web", "format": "jsonl", "path": "/data/*.jsonl"}
TINY = {"hidden": 16, "layers": 1, "heads": 2, "ffn": 32, "vocab": 32, "gated": True}


def tiny_factory(device):
    """A model factory as a user names it (``tests.test_calibrate:tiny_factory``)."""
    from omniload_dask.calibrate.transformer import build_transformer

    return build_transformer(TINY, device)


def broken_factory():
    raise RuntimeError("no weights here")


def not_a_model():
    return 42


# ------------------------------------------------------------------ the fit (numpy only)
def synthetic(batches: list[MicroBatch], truth: np.ndarray, noise: float, seed: int) -> np.ndarray:
    rows = features([b.pieces for b in batches], [b.images for b in batches])
    rng = np.random.default_rng(seed)
    return rows @ truth * (1 + noise * np.abs(rng.standard_normal(len(batches))))


def test_the_fit_recovers_known_terms_from_noisy_timings_with_disturbed_points():
    truth = np.array([1.5e-3, 2.0e-4, 1.6e-5, 8.0e-9, 0.0, 0.0])  # seconds, TERMS order
    grid = fit_grid(2048, seed=3)
    seconds = synthetic(grid, truth, noise=0.005, seed=1)
    seconds[[2, 9]] *= 1.6  # two timings disturbed by another process
    fit = fit_terms(features([b.pieces for b in grid]), seconds)
    assert fit.dropped >= 2
    for term, want in zip(TERMS[:4], truth[:4], strict=True):
        assert fit.coefficient(term) == pytest.approx(want, rel=0.05), term
    check = held_back(2048, 30, seed=3)
    verdict = check_fit(fit, features([b.pieces for b in check]), synthetic(check, truth, 0, 0))
    assert verdict.mean_abs_rel_error < 0.01 and verdict.rank_correlation > 0.99


def test_the_fit_recovers_encoder_terms_from_micro_batches_with_images():
    truth = np.array([1e-3, 1e-4, 1e-5, 5e-9, 3e-5, 2e-8])
    grid = fit_grid(1024, images=(64, 256, 576), seed=0)
    rows = features([b.pieces for b in grid], [b.images for b in grid])
    fit = fit_terms(rows, rows @ truth)
    for term, want in zip(TERMS, truth, strict=True):
        assert fit.coefficient(term) == pytest.approx(want, rel=1e-6), term


def test_terms_that_do_not_cost_stay_zero_never_negative():
    truth = np.array([2e-3, 0.0, 1e-5, 0.0, 0.0, 0.0])  # no per-piece, no attention cost
    grid = fit_grid(512, seed=1)
    fit = fit_terms(features([b.pieces for b in grid]), synthetic(grid, truth, 0.01, 2))
    assert fit.coefficient("piece") >= 0 and fit.coefficient("quadratic") >= 0
    assert fit.coefficient("linear") == pytest.approx(1e-5, rel=0.05)
    assert "encoder_linear" not in fit.terms  # no images, no column


def test_the_micro_batch_constant_may_be_negative_the_costs_may_not():
    rows = features([b.pieces for b in fit_grid(512, seed=2)])
    fit = fit_terms(rows, rows[:, 2] * 1e-5 - 1e-4)  # a negative intercept (all times > 0)
    assert fit.coefficient("micro_batch") == pytest.approx(-1e-4, rel=1e-6)


def test_nnls_meets_its_optimality_conditions():
    rng = np.random.default_rng(0)
    for _ in range(20):
        a, b = rng.standard_normal((30, 5)), rng.standard_normal(30)
        x = nnls(a, b)
        gradient = a.T @ (b - a @ x)
        assert np.all(x >= 0)
        assert np.all(gradient[x == 0] <= 1e-9) and np.allclose(gradient[x > 0], 0, atol=1e-9)


def test_rank_correlation_shares_ranks_between_ties():
    assert rank_correlation(np.array([1, 2, 3, 4]), np.array([10, 20, 30, 40])) == 1.0
    assert rank_correlation(np.array([1, 2, 3]), np.array([3, 2, 1])) == -1.0
    assert rank_correlation(np.array([1, 1, 2]), np.array([5, 5, 9])) == pytest.approx(1.0)


def test_fit_refuses_too_few_points_and_bad_times():
    rows = features([[64], [128]])
    with pytest.raises(ValueError, match="cannot fit"):
        fit_terms(rows, np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match="finite and > 0"):
        fit_terms(features([[1]] * 8), np.array([1.0] * 7 + [0.0]))


def test_grids_are_seeded_within_capacity_and_held_back_differs_from_the_fit_grid():
    grid = fit_grid(1024, images=(64,), seed=5)
    assert grid == fit_grid(1024, images=(64,), seed=5)
    assert all(0 < b.tokens <= 1024 for b in grid)
    assert MicroBatch((1024,)) in grid and MicroBatch((16,) * 64) in grid
    check = held_back(1024, 12, images=(64,), seed=5)
    assert len(check) == 12 and not set(check) & set(grid)
    assert sum(1 for b in check if b.images) == 3


def test_packed_arrays_follow_the_feeder_layout_with_images():
    mb = MicroBatch((6, 3), images=(8,), image_piece=(0,))
    out = packed_arrays(mb, 50, np.random.default_rng(0), patch_size=4, merge=2)
    assert out["cu_seqlens"].tolist() == [0, 6, 9]
    assert out["position_ids"].tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2]
    assert out["image_token_map"].tolist() == [-1, 0, 1, -1, -1, -1, -1, -1, -1]
    assert out["labels"][[1, 2, 5, 8]].tolist() == [-100] * 4  # image tokens, document ends
    assert out["pixel_patches"].shape == (8, 4, 4, 3)
    assert out["image_cu_patches"].tolist() == [0, 8] and out["image_cu_tokens"].tolist() == [0, 2]


# ------------------------------------------------------------------ the cost terms
def test_the_piece_term_is_paid_once_per_piece_and_defaults_to_nothing():
    model = CostModel(linear=1.0, quadratic=0.001, piece=40.0)
    assert model(np.array([1000, 600, 400])).tolist() == [2040.0, 1000.0, 600.0]
    assert CostModel(linear=2.0, quadratic=0.5)(np.array([2])).tolist() == [6.0]
    plan = parse_plan(plan_dict([SRC]))
    assert plan.cost.piece == 0 and "piece" not in plan.to_dict()["cost"]


def test_a_per_piece_cost_makes_the_balancer_even_out_piece_counts():
    lengths = np.array([512] * 2 + [16] * 32)  # one group could take both long pieces
    cost = CostModel(linear=1.0, quadratic=0.0, piece=200.0)
    plan = balance(lengths, np.zeros(len(lengths), np.int64), [Bucket(2048, 1)], 2, cost)
    assert plan.efficiency == 1.0
    assert np.bincount(plan.group).tolist() == [17, 17]


def test_a_plan_takes_piece_linear_quadratic_and_round_trips():
    plan = parse_plan(plan_dict([SRC], cost={"piece": 30.0, "linear": 2.0, "quadratic": 1e-3}))
    assert (plan.cost.piece, plan.cost.linear, plan.cost.quadratic) == (30.0, 2.0, 1e-3)
    assert CostModel.from_spec(plan.cost)(np.array([10])).tolist() == [50.1]
    assert parse_plan(plan.to_dict()) == plan


# ------------------------------------------------------------------ a real run on CPU
@pytest.fixture(scope="module")
def calibration_file(tmp_path_factory):
    """A tiny real calibration (CPU, a few seconds), written next to a plan that names it."""
    folder = tmp_path_factory.mktemp("calibration")
    result = calibrate(TINY, seq_len=1024, repeats=2, random=6, held_back_count=4)
    result.write(folder / "calibration.yaml")
    return folder, result


def test_a_real_cpu_calibration_writes_a_file_that_a_plan_loads(calibration_file):
    folder, result = calibration_file
    data = yaml.safe_load((folder / "calibration.yaml").read_text())
    assert set(data) == {"cost", "calibration"}
    assert data["calibration"]["version"] == 1 and data["calibration"]["device"] == "cpu"
    assert data["calibration"]["held_back"]["points"] == 4
    assert len(data["calibration"]["timings"]["fit"]) == result.fit.points
    plan_file = folder / "plan.yaml"
    plan_file.write_text(yaml.safe_dump(plan_dict([SRC], cost={"calibration": "calibration.yaml"})))
    plan = load_plan(plan_file)  # the name is relative to the plan's folder
    block = data["cost"]
    assert (plan.cost.piece, plan.cost.linear, plan.cost.quadratic) == (
        block["piece"],
        block["linear"],
        block["quadratic"],
    )
    assert plan.cost.linear > 0 or plan.cost.quadratic > 0
    resolved = plan.to_dict()["cost"]  # the coefficients travel, not the file's name
    assert "calibration" not in resolved and parse_plan(plan.to_dict()) == plan
    assert result.cost_model()(np.array([64])) == CostModel.from_spec(plan.cost)(np.array([64]))
    pasted = parse_plan(plan_dict([SRC], cost=block))  # or copy the block into a plan
    assert pasted.cost == plan.cost


def test_the_cli_calibrates_a_factory_named_model(tmp_path, capsys):
    out = tmp_path / "c.yaml"
    argv = ["calibrate", "tests.test_calibrate:tiny_factory", "--seq-len", "512", "--vocab",
            "32", "--quick", "--repeats", "2", "--quiet", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "per token" in printed and "held back: 8 micro-batches" in printed
    meta = yaml.safe_load(out.read_text())["calibration"]
    assert meta["model"] == {"factory": "tests.test_calibrate:tiny_factory"}


def test_the_cli_takes_model_and_seq_len_from_a_plan(tmp_path, capsys):
    plan = plan_dict([SRC], cost={"model": TINY}, batch={"seq_len": 512})
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(plan))
    out = tmp_path / "c.yaml"
    argv = ["calibrate", "--plan", str(tmp_path / "p.yaml"), "--quick", "--repeats", "2",
            "--quiet", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    meta = yaml.safe_load(out.read_text())["calibration"]
    assert meta["model"]["transformer"] == TINY and meta["seq_len"] == 512
    (tmp_path / "q.yaml").write_text(yaml.safe_dump(plan_dict([SRC])))
    assert main(["calibrate", "--plan", str(tmp_path / "q.yaml")]) == 2
    assert "MODEL: name the model" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("tests.test_calibrate:missing", "has no attribute 'missing'"),
        ("tests.test_calibrate:broken_factory", "the factory failed: RuntimeError: no weights"),
        ("tests.test_calibrate:not_a_model", "returned a int, not a callable"),
        ({"hidden": 16, "layers": 1, "heads": 3}, "model.heads: must divide hidden (16), got 3"),
    ],
)
def test_a_model_that_cannot_be_timed_is_named(model, message):
    with pytest.raises((CalibrationError, PlanError), match=re.escape(message)):
        load_model(model, "cpu")


def test_the_cli_names_a_bad_model_description(capsys):
    assert main(["calibrate", "{hidden: 16, layers: 1, head: 2}", "--seq-len", "64"]) == 2
    assert "model.head: unknown field" in capsys.readouterr().err


# ------------------------------------------------------------------ bad calibration files
GOOD = {"cost": {"piece": 10.0, "linear": 2.0, "quadratic": 0.001}, "calibration": {"version": 1}}


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cost.calibration: cannot read the calibration file (No such file"),
        ("cost: [1, 2", "cost.calibration: the calibration file is not valid YAML"),
        ("- 1\n- 2\n", "cost.calibration (FILE): must be a mapping"),
        ({"calibration": {"version": 1}}, "cost.calibration (FILE).cost: is required"),
        ({**GOOD, "calibration": {"version": 9}}, ".calibration.version: this omniload-dask reads version 1, got 9"),
        ({**GOOD, "cost": {"piece": 1, "linear": -2, "quadratic": 0}}, "(FILE).cost.linear: must be >= 0, got -2"),
        ({**GOOD, "cost": {"linear": 2, "quadratic": 0}}, "(FILE).cost.piece: is required"),
        ({**GOOD, "cost": {"model": {"hidden": 8, "layers": 1}}}, "(FILE).cost.model: a calibration gives coefficients"),
        ({**GOOD, "cost": {**GOOD["cost"], "encoder": {"model": {"hidden": 8, "layers": 1}}}}, "cost.encoder.model: a calibration gives coefficients"),
        ({**GOOD, "cost": {**GOOD["cost"], "quadratik": 1}}, "did you mean 'quadratic'"),
        ({**GOOD, "costs": {}}, "(FILE).costs: unknown field"),
    ],
)  # fmt: skip
def test_bad_calibration_files_are_named_with_the_field(tmp_path, content, message):
    path = tmp_path / "cal.yaml"
    if content is not None:
        path.write_text(content if isinstance(content, str) else yaml.safe_dump(content))
    with pytest.raises(PlanError) as err:
        parse_plan(plan_dict([SRC], cost={"calibration": str(path)}))
    assert message.replace("FILE", str(path)) in str(err.value)


def test_a_calibration_excludes_other_forms_and_a_second_encoder(tmp_path):
    path = tmp_path / "cal.yaml"
    path.write_text(yaml.safe_dump({**GOOD, "cost": {**GOOD["cost"], "encoder": {"linear": 1.0}}}))
    with pytest.raises(PlanError, match="cost.calibration: give one of"):
        parse_plan(plan_dict([SRC], cost={"linear": 1.0, "calibration": str(path)}))
    with pytest.raises(PlanError, match="cost.encoder: the calibration file gives the encoder"):
        parse_plan(plan_dict([SRC], cost={"calibration": str(path), "encoder": {"linear": 2}}))
    with pytest.raises(PlanError, match="cost.calibration: must be a local file"):
        parse_plan(plan_dict([SRC], cost={"calibration": "s3://bucket/cal.yaml"}))
    plan = parse_plan(plan_dict([SRC], cost={"calibration": str(path)}))
    assert (plan.cost.encoder_linear, plan.cost.encoder_quadratic) == (1.0, 0.0)


def test_importing_the_calibration_package_does_not_import_torch():
    code = "import sys, omniload_dask.calibrate, omniload_dask.plan; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parents[1], check=True)  # fmt: skip
    assert out.stdout.strip() == "False"

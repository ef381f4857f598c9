"""The cost model: coefficients, the transformer formula, plan-named functions."""

from __future__ import annotations

import numpy as np
import pytest

from omniload_dask import PlanError, parse_plan
from omniload_dask.plan.cost import CostModel, transformer_coefficients

from .datagen import plan_dict

SRC = {"name": "web", "format": "jsonl", "path": "/data/*.jsonl"}


def quadratic_cost(lengths: np.ndarray) -> np.ndarray:
    """A plan-named cost function for the tests below."""
    return 2.0 * lengths + lengths.astype(np.float64) ** 2


def wrong_shape(lengths: np.ndarray) -> np.ndarray:
    return np.zeros(1)


def test_transformer_formula_matches_the_worked_example():
    linear, quadratic = transformer_coefficients(
        hidden=64, layers=2, ffn=256, vocab=256, gated=True
    )
    assert (linear, quadratic) == (884736.0, 768.0)
    assert linear / quadratic == 1152  # attention equals the dense layers at 1152 tokens


def test_grouped_query_attention_and_full_attention_change_the_right_term():
    base = transformer_coefficients(hidden=64, layers=2, heads=8)
    gqa = transformer_coefficients(hidden=64, layers=2, heads=8, kv_heads=2)
    full = transformer_coefficients(hidden=64, layers=2, heads=8, causal=False)
    assert gqa[0] == base[0] - 6 * 2 * (2 * 64 * 64 - 2 * 64 * 16) and gqa[1] == base[1]
    assert full == (base[0], 2 * base[1])


def test_cost_model_is_vectorised_and_linear_plus_quadratic():
    model = CostModel(linear=2.0, quadratic=0.5)
    assert model(np.array([0, 2, 10])).tolist() == [0.0, 6.0, 70.0]
    assert CostModel(function=quadratic_cost)(np.array([3])).tolist() == [15.0]
    assert model.encoder(np.array([16])).tolist() == [0.0]  # no image terms declared


def test_plan_cost_from_a_model_description_round_trips():
    model = {"hidden": 64, "layers": 2, "ffn": 256, "vocab": 256, "gated": True}
    plan = parse_plan(plan_dict([SRC], cost={"model": model}))
    assert (plan.cost.linear, plan.cost.quadratic) == (884736.0, 768.0)
    assert plan.to_dict()["cost"] == {"model": model}
    assert parse_plan(plan.to_dict()) == plan


def test_plan_cost_from_a_named_function_is_imported_and_probed_at_load():
    plan = parse_plan(plan_dict([SRC], cost={"function": "tests.test_cost:quadratic_cost"}))
    assert CostModel.from_spec(plan.cost)(np.array([3])).tolist() == [15.0]
    assert parse_plan(plan.to_dict()) == plan


@pytest.mark.parametrize(
    ("cost", "message"),
    [
        ({"function": "no_such_pkg.mod:fn"}, "cost.function: cannot import module 'no_such_pkg"),
        (
            {"function": "tests.test_cost"},
            "cost.function: must look like 'package.module:function'",
        ),
        ({"function": "tests.test_cost:missing"}, "has no attribute 'missing'"),
        ({"function": "tests.test_cost:SRC"}, "is not callable"),
        ({"function": "tests.test_cost:wrong_shape"}, "must return one finite cost >= 0"),
        ({"model": {"hidden": 64}}, "cost.model.layers: is required"),
        ({"model": {"hidden": 64, "layers": 2, "kv_heads": 2}}, "cost.model.heads: is required"),
        (
            {"model": {"hidden": 64, "layers": 2, "heads": 8, "kv_heads": 3}},
            "cost.model.kv_heads: must divide heads (8), got 3",
        ),
        ({"model": {"hidden": 64, "layers": 2, "hiden": 1}}, "did you mean 'hidden'"),
        ({"model": {"hidden": 64, "layers": 2}, "linear": 1}, "cost.model: give one of"),
        ({"linear": -1}, "cost.linear: must be >= 0, got -1"),
    ],
)
def test_bad_cost_fields_are_named(cost, message):
    with pytest.raises(PlanError) as info:
        parse_plan(plan_dict([SRC], cost=cost))
    assert message in str(info.value)


def test_encoder_terms_from_the_plan_match_the_worked_example():
    src = {"name": "s", "format": "parquet", "path": "/x/*.parquet", "image": "img"}
    plan = parse_plan(
        plan_dict(
            [src],
            cost={"linear": 1.0, "quadratic": 1e-4, "encoder": {"linear": 2.0, "quadratic": 1e-3}},
        )
    )
    model = CostModel.from_spec(plan.cost)
    assert model.has_encoder
    # cost.py: 300 tokens with one image of 1024 patches -> 309 + 3096.6
    assert model(np.array([300]))[0] == pytest.approx(309.0)
    assert model.encoder_of(np.array([1024]), np.array([1024**2]))[0] == pytest.approx(3096.576)
    # Two images of 100 and 300 patches in one document: the sums of P and P^2.
    both = model.encoder_of(np.array([400]), np.array([100**2 + 300**2]))[0]
    assert both == pytest.approx(float(model.encoder(np.array([100, 300])).sum()))

"""Parser of the ``cost`` section: how much balancing weight one document piece carries.

A ``model`` (or ``encoder.model``) description is turned into the linear and quadratic
coefficients by :func:`omniload_dask.batching.cost.transformer_coefficients`; a ``function`` is
imported and tried once here, so a plan that loads can be balanced.
"""

from __future__ import annotations

from typing import Any

from omniload_dask.batching.cost import check_function, load_function, transformer_coefficients
from omniload_dask.plan.fields import Fields, fail
from omniload_dask.plan.limits import MAX_COST
from omniload_dask.plan.specs import CostSpec

__all__ = ["read_cost"]

# A transformer description's sizes: far beyond today's models, and their cost stays finite.
_MODEL_MAX = {
    "hidden": 2**20,
    "layers": 2**14,
    "heads": 2**16,
    "kv_heads": 2**16,
    "ffn": 2**24,
    "vocab": 2**32,
}


def read_cost(f: Fields) -> CostSpec:
    """The ``cost`` section: coefficients, a ``model`` or a ``function``, plus an ``encoder``."""
    forms = [k for k in ("model", "function") if f.has(k)]
    if f.has("linear") or f.has("quadratic"):
        forms.insert(0, "linear" if f.has("linear") else "quadratic")
    if len(forms) > 1:
        fail(
            f.at(forms[1]), f"give one of linear/quadratic, model or function (also got {forms[0]})"
        )
    encoder = _encoder(f.mapping("encoder")) if f.has("encoder") else {}
    f.raw("encoder")
    default = CostSpec()
    if f.has("model"):
        model = _model(f.mapping("model"))
        linear, quadratic = transformer_coefficients(**model)
        f.done()
        return CostSpec(linear=linear, quadratic=quadratic, model=model, **encoder)
    if f.has("function"):
        ref = f.text("function")
        try:
            check_function(load_function(ref))
        except ValueError as exc:
            fail(f.at("function"), str(exc), ref)
        f.done()
        return CostSpec(function=ref, **encoder)
    linear = f.number("linear", default.linear, min=0, max=MAX_COST)
    quadratic = f.number("quadratic", default.quadratic, min=0, max=MAX_COST)
    if linear == 0 and quadratic == 0:
        fail(f.at("linear"), "linear and quadratic cannot both be 0", 0)
    f.done()
    return CostSpec(linear=linear, quadratic=quadratic, **encoder)


def _encoder(f: Fields) -> dict[str, Any]:
    """``cost.encoder``: coefficients per patch and patch squared, or an encoder model."""
    if f.has("model"):
        for key in ("linear", "quadratic"):
            if f.has(key):
                fail(f.at(key), "give linear/quadratic or model, not both", f.raw(key))
        model = _model(f.mapping("model"))
        model.setdefault("causal", False)  # vision encoders attend both ways
        linear, quadratic = transformer_coefficients(**model)
        f.done()
        return {"encoder_linear": linear, "encoder_quadratic": quadratic, "encoder_model": model}
    linear = f.number("linear", 0.0, min=0, max=MAX_COST)
    quadratic = f.number("quadratic", 0.0, min=0, max=MAX_COST)
    f.done()
    return {"encoder_linear": linear, "encoder_quadratic": quadratic}


def _model(f: Fields) -> dict[str, Any]:
    """A transformer description for the cost formula; keeps only the keys given."""
    out: dict[str, Any] = {
        "hidden": f.integer("hidden", min=1, max=_MODEL_MAX["hidden"]),
        "layers": f.integer("layers", min=1, max=_MODEL_MAX["layers"]),
    }
    for key in ("heads", "kv_heads", "ffn"):
        value = f.optional_int(key, min=1, max=_MODEL_MAX[key])
        if value is not None:
            out[key] = value
    if f.has("vocab"):
        out["vocab"] = f.integer("vocab", min=0, max=_MODEL_MAX["vocab"])
    for key in ("gated", "causal"):
        if f.has(key):
            out[key] = f.flag(key, False)
    if "kv_heads" in out:
        heads = out.get("heads")
        if heads is None:
            fail(f.at("heads"), "is required with kv_heads")
        if heads % out["kv_heads"]:
            fail(f.at("kv_heads"), f"must divide heads ({heads})", out["kv_heads"])
    f.done()
    return out

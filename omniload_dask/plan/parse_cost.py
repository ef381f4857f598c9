"""Parser of the ``cost`` section: how much balancing weight one document piece carries.

A ``model`` (or ``encoder.model``) description is turned into the linear and quadratic
coefficients by :func:`omniload_dask.plan.cost.transformer_coefficients`; a ``function`` is
imported and tried once here, so a plan that loads can be balanced. A ``calibration`` names a
file written by ``omniload calibrate`` (:mod:`omniload_dask.calibrate`)::

    cost: {calibration: calibration.yaml}     # relative to the plan file's folder

    # calibration.yaml
    cost: {piece: 742.3, linear: 31.26, quadratic: 0.01942}  # its cost: block, as in a plan
    calibration: {version: 1, unit: microseconds, device: cpu, ...}   # how it was measured

The file's coefficients replace the reference in the resolved plan (:meth:`CostSpec.to_dict`),
so a plan sent to the scheduler, a feeder or a checkpoint does not need the file.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from omniload_dask.plan.cost import check_function, load_function, transformer_coefficients
from omniload_dask.plan.fields import Fields, fail, resolve_path
from omniload_dask.plan.limits import MAX_COST
from omniload_dask.plan.specs import CostSpec

__all__ = ["CALIBRATION_VERSION", "read_cost", "read_model"]

CALIBRATION_VERSION = 1  # of the calibration file's format

# A transformer description's sizes: far beyond today's models, and their cost stays finite.
_MODEL_MAX = {
    "hidden": 2**20,
    "layers": 2**14,
    "heads": 2**16,
    "kv_heads": 2**16,
    "ffn": 2**24,
    "vocab": 2**32,
}


def read_cost(f: Fields, base_dir: str | os.PathLike[str] | None = None) -> CostSpec:
    """The ``cost`` section: coefficients, a ``model``, a ``function`` or a ``calibration``
    file, plus an ``encoder``."""
    forms = [k for k in ("model", "function", "calibration") if f.has(k)]
    for key in ("linear", "quadratic", "piece"):
        if f.has(key):
            forms.insert(0, key)
            break
    if len(forms) > 1:
        fail(
            f.at(forms[1]),
            f"give one of linear/quadratic/piece, model, function or calibration "
            f"(also got {forms[0]})",
        )
    encoder = _encoder(f.mapping("encoder")) if f.has("encoder") else {}
    f.raw("encoder")
    if f.has("model"):
        model = read_model(f.mapping("model"))
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
    if f.has("calibration"):
        spec = _calibration(f, base_dir)
        if encoder and (spec.encoder_linear or spec.encoder_quadratic):
            fail(f.at("encoder"), "the calibration file gives the encoder terms already")
    else:
        spec = _coefficients(f)
    f.done()
    return replace(spec, **encoder) if encoder else spec


def _coefficients(f: Fields) -> CostSpec:
    """``linear``, ``quadratic`` and ``piece`` (the defaults for those not given)."""
    default = CostSpec()
    linear = f.number("linear", default.linear, min=0, max=MAX_COST)
    quadratic = f.number("quadratic", default.quadratic, min=0, max=MAX_COST)
    piece = f.number("piece", default.piece, min=0, max=MAX_COST)
    if linear == 0 and quadratic == 0:
        fail(f.at("linear"), "linear and quadratic cannot both be 0", 0)
    return CostSpec(linear=linear, quadratic=quadratic, piece=piece)


def _calibration(f: Fields, base_dir: str | os.PathLike[str] | None) -> CostSpec:
    """The coefficients of the calibration file that ``cost.calibration`` names."""
    field = f.at("calibration")
    path = resolve_path(f.text("calibration"), base_dir, field)
    if "://" in path:
        fail(field, "must be a local file (copy the calibration next to the plan)", path)
    where = f"{field} ({path})"
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        fail(field, f"cannot read the calibration file ({exc.strerror})", path)
    except yaml.YAMLError as exc:
        fail(field, f"the calibration file is not valid YAML ({exc})", path)
    top = Fields(data, where)
    meta = top.mapping("calibration")
    version = meta.integer("version", CALIBRATION_VERSION)
    if version != CALIBRATION_VERSION:
        fail(meta.at("version"), f"this omniload-dask reads version {CALIBRATION_VERSION}", version)
    if not top.has("cost"):
        fail(top.at("cost"), "is required: a calibration file holds the cost: block that "
             "`omniload calibrate` writes")  # fmt: skip
    cost = top.mapping("cost")
    for key in ("model", "function", "calibration"):
        if cost.has(key):
            fail(cost.at(key), "a calibration gives coefficients (piece, linear, quadratic)")
    for key in ("linear", "quadratic", "piece"):
        cost.required(key)
    spec = _coefficients(cost)
    encoder = _encoder(cost.mapping("encoder"), measured=True) if cost.has("encoder") else {}
    cost.raw("encoder")
    cost.done()
    top.done()
    return replace(spec, **encoder)


def _encoder(f: Fields, measured: bool = False) -> dict[str, Any]:
    """``cost.encoder``: coefficients per patch and patch squared, or an encoder model
    (not in a calibration file: ``measured``)."""
    if f.has("model"):
        if measured:
            fail(f.at("model"), "a calibration gives coefficients (linear, quadratic)")
        for key in ("linear", "quadratic"):
            if f.has(key):
                fail(f.at(key), "give linear/quadratic or model, not both", f.raw(key))
        model = read_model(f.mapping("model"))
        model.setdefault("causal", False)  # vision encoders attend both ways
        linear, quadratic = transformer_coefficients(**model)
        f.done()
        return {"encoder_linear": linear, "encoder_quadratic": quadratic, "encoder_model": model}
    linear = f.number("linear", 0.0, min=0, max=MAX_COST)
    quadratic = f.number("quadratic", 0.0, min=0, max=MAX_COST)
    f.done()
    return {"encoder_linear": linear, "encoder_quadratic": quadratic}


def read_model(f: Fields) -> dict[str, Any]:
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

"""What one packed document piece costs to train on, as the plan declares it.

A plan gives the cost in one of three forms (``cost:``)::

    cost: {linear: 1.0, quadratic: 4.0e-5}       # c(L) = linear * L + quadratic * L**2
    cost: {piece: 40.0, linear: 1.0, quadratic: 4.0e-5}   # + a constant per piece
    cost: {model: {hidden: 2048, layers: 24, heads: 16, ffn: 8192, vocab: 50304}}
    cost: {function: mypackage.costs:piece_cost} # any callable: lengths -> costs (numpy)

The model form counts the training FLOPs of a decoder-only transformer (forward + backward, the
backward taken as twice the forward) per piece of L tokens, with h = hidden, n = layers,
f = ffn, V = vocab, h_kv = h * kv_heads / heads and m = 3 for a gated FFN (SwiGLU) else 2::

    linear    = 6 * (n * (2*h*h + 2*h*h_kv + m*h*f) + h*V)   Q, O, K, V projections, FFN, LM head
    quadratic = 6 * n * h        causal attention: Q.K^T and A.V are 2*h*L*L each, half computed
                                 (12 * n * h with ``causal: false``)

Worked example, h=64, n=2, f=256 gated, V=256, no GQA::

    linear    = 6 * (2 * (8192 + 8192 + 49152) + 16384) = 884736
    quadratic = 6 * 2 * 64                               = 768
    attention costs as much as the dense layers at L = 884736 / 768 = 1152 tokens

Only ratios matter to the balancer (efficiency is mean/max of rank costs), so any unit will do.

``piece`` is a cost per piece whatever its length: one attention call (and its launch, masks,
bookkeeping) per document piece, measurable but outside any FLOP count, so the formula leaves it
0. :mod:`omniload_dask.calibrate` measures it, with the other terms, from timed forward and
backward passes (``cost: {calibration: FILE}``). A piece cut in two pays it twice::

    cost: {piece: 40, linear: 1, quadratic: 0.001}
    a piece of 1000 tokens: 40 + 1000 + 1000 = 2040; cut into 600 + 400 tokens: 1000 + 600 = 1600

Image documents add the vision encoder's cost of each of their images on top of the decoder cost
of the piece that holds their tokens: :meth:`CostModel.encoder` computes ``encoder_linear * P +
encoder_quadratic * P**2`` for an image of P patches (``cost.encoder`` in the plan; both 0
unless declared). For a document with images of P1, P2, ... patches that is
``encoder_linear * sum(P) + encoder_quadratic * sum(P**2)`` (:meth:`CostModel.encoder_of`)::

    cost: {linear: 1.0, quadratic: 1.0e-4, encoder: {linear: 2.0, quadratic: 1.0e-3}}
    a document of 300 tokens with one image of 1024 patches (256 tokens after a 2 x 2 merge):
    decoder 300 + 9 = 309, encoder 2048 + 1048.6 = 3096.6, together 3405.6
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["CostFunction", "CostModel", "load_function", "transformer_coefficients"]

CostFunction = Callable[[np.ndarray], np.ndarray]


def transformer_coefficients(
    *,
    hidden: int,
    layers: int,
    heads: int | None = None,
    kv_heads: int | None = None,
    ffn: int | None = None,
    vocab: int = 0,
    gated: bool = False,
    causal: bool = True,
) -> tuple[float, float]:
    """``(linear, quadratic)`` training FLOPs per token and per token squared (module docstring).

    ``ffn`` defaults to ``4 * hidden``; ``kv_heads`` (grouped-query attention) needs ``heads``;
    ``vocab=0`` leaves out the LM head.
    """
    h = float(hidden)
    f = float(ffn if ffn is not None else 4 * hidden)
    h_kv = h * (kv_heads / heads) if kv_heads is not None and heads else h
    per_layer = 2 * h * h + 2 * h * h_kv + (3 if gated else 2) * h * f
    linear = 6.0 * (layers * per_layer + h * vocab)
    quadratic = (6.0 if causal else 12.0) * layers * h
    return linear, quadratic


def load_function(reference: str) -> CostFunction:
    """Import ``package.module:function``; raises ValueError with the reason if it cannot."""
    module_name, sep, attr = reference.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError("must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import module {module_name!r} ({exc})") from None
    target: Any = module
    for part in attr.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise ValueError(f"module {module_name!r} has no attribute {attr!r}")
    if not callable(target):
        raise ValueError(f"{attr!r} in {module_name!r} is not callable")
    return target  # type: ignore[no-any-return,unused-ignore]


def check_function(fn: CostFunction) -> None:
    """Call ``fn`` on a probe; raises ValueError unless it returns one finite cost >= 0 each."""
    probe = np.array([1, 7, 64, 4096], dtype=np.int64)
    try:
        out = np.asarray(fn(probe), dtype=np.float64)
    except Exception as exc:
        raise ValueError(
            f"fails on lengths {probe.tolist()}: {type(exc).__name__}: {exc}"
        ) from None
    if out.shape != probe.shape or not np.all(np.isfinite(out)) or np.any(out < 0):
        raise ValueError(
            f"must return one finite cost >= 0 per length; for {probe.tolist()} it "
            f"returned {out.tolist()}"
        )


@dataclass(frozen=True)
class CostModel:
    """Cost per piece: ``piece + linear * L + quadratic * L**2``, or a plan-named function of L.

    Call it on a numpy array of piece lengths; it returns float64 costs of the same shape, the
    per-piece constant included: this call is the cost of pieces for the balancer (also of the
    chunks of a cut piece). :meth:`encoder_of` is the per-document image cost on top.
    """

    linear: float = 1.0
    quadratic: float = 0.0
    function: CostFunction | None = None
    encoder_linear: float = 0.0
    encoder_quadratic: float = 0.0
    piece: float = 0.0

    @classmethod
    def from_spec(cls, spec: Any) -> CostModel:
        """From a plan's :class:`~omniload_dask.plan.CostSpec` (imports its function, if any)."""
        function = load_function(spec.function) if spec.function else None
        return cls(
            linear=spec.linear,
            quadratic=spec.quadratic,
            function=function,
            encoder_linear=spec.encoder_linear,
            encoder_quadratic=spec.encoder_quadratic,
            piece=spec.piece,
        )

    def __call__(self, lengths: np.ndarray) -> np.ndarray:
        if self.function is not None:
            return np.asarray(self.function(np.asarray(lengths, np.int64)), dtype=np.float64)
        x = np.asarray(lengths, dtype=np.float64)
        # linear * x + quadratic * x * x, each operation as written (the same bits), in place
        # where a temporary would be made: the balancer calls this dozens of times a step.
        out = x * self.linear
        square = x * self.quadratic
        square *= x
        out += square
        return out + self.piece if self.piece else out

    @property
    def has_encoder(self) -> bool:
        """Whether images add an encoder cost (the plan declares ``cost.encoder``)."""
        return bool(self.encoder_linear or self.encoder_quadratic)

    def encoder(self, patches: np.ndarray) -> np.ndarray:
        """Encoder cost of images of ``patches`` patches each (0 unless the plan declares it)."""
        p = np.asarray(patches, dtype=np.float64)
        return self.encoder_linear * p + self.encoder_quadratic * p * p

    def encoder_of(self, patch_sum: np.ndarray, patch_sq: np.ndarray) -> np.ndarray:
        """Encoder cost of documents whose images have ``patch_sum`` patches in all and
        ``patch_sq`` as the sum of their squares."""
        return self.encoder_linear * np.asarray(
            patch_sum, np.float64
        ) + self.encoder_quadratic * np.asarray(patch_sq, np.float64)

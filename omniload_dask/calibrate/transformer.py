"""A transformer built from a description like the plan's ``cost.model``, to calibrate with.

Imports torch: only :mod:`omniload_dask.calibrate.runner` loads this module, when it is asked
for a described model. The model is Llama-shaped: RMSNorm, grouped-query attention, a gated
(SwiGLU) or plain GELU FFN and an LM head (no rotary embedding: a cost per token, which a fit
on the user's own model would absorb). It takes one packed micro-batch in the feeder's layout
(``input_ids``, ``labels``, ``cu_seqlens`` and, with images, ``pixel_patches``,
``image_cu_patches``, ``image_token_map``) and returns the loss.

Attention runs within each document piece, as varlen kernels do::

    cu_seqlens [0 3 5]   tokens 0-2 attend among themselves, tokens 3-4 among themselves

either as a loop of ``scaled_dot_product_attention`` calls, one per piece, on 4-D tensors (so
that CPU torch uses its flash kernel; ``attention="loop"``), or as one call on jagged nested
tensors (``"jagged"``, CUDA). ``"auto"`` takes the jagged call on CUDA when it runs there and
agrees with the loop. The CUDA path is written but has not run on a GPU in this project's tests.

An ``encoder`` description adds a vision encoder: a linear patch embedding, bidirectional
blocks within each image, each ``merge x merge`` window of patches merged into one decoder
token, scattered into the image placeholders' embeddings.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["ATTENTION_MODES", "Transformer", "build_transformer"]

ATTENTION_MODES = ("auto", "loop", "jagged")


def attend_loop(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: list[int], causal: bool
) -> torch.Tensor:
    """Attention within each piece ``[cu[i], cu[i+1])``, one SDPA call per piece.

    ``q``, ``k``, ``v``: (tokens, heads, head_dim), k and v at q's head count.
    """
    outs = []
    for a, b in itertools.pairwise(cu):
        qq, kk, vv = (t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)[0].transpose(0, 1))
    return torch.cat(outs)


def attend_jagged(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: list[int], causal: bool
) -> torch.Tensor:
    """The same attention as one SDPA call on jagged nested tensors."""
    offsets = torch.tensor(cu, device=q.device, dtype=torch.int64)
    qn, kn, vn = (
        torch.nested.nested_tensor_from_jagged(t, offsets=offsets).transpose(1, 2)
        for t in (q, k, v)
    )
    out = F.scaled_dot_product_attention(qn, kn, vn, is_causal=causal)
    return out.transpose(1, 2).values()


def jagged_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether jagged SDPA runs on ``device`` and agrees with the per-piece loop."""
    try:
        q, k, v = (torch.randn(300, 4, 32, device=device, dtype=dtype) for _ in range(3))
        cu = [0, 17, 150, 300]
        same = torch.allclose(
            attend_jagged(q, k, v, cu, True), attend_loop(q, k, v, cu, True), atol=2e-2, rtol=2e-2
        )
    except Exception:  # no kernel for this device or dtype, or an older torch: use the loop
        return False
    return bool(same)


def _norm(size: int) -> torch.nn.Module:
    rms = getattr(torch.nn, "RMSNorm", None)  # torch >= 2.4
    return rms(size) if rms is not None else torch.nn.LayerNorm(size)


class Block(torch.nn.Module):
    """One pre-norm block: attention within pieces, then the FFN."""

    def __init__(self, desc: Mapping[str, Any], causal: bool) -> None:
        super().__init__()
        h = desc["hidden"]
        self.heads = desc.get("heads", max(1, h // 64))
        self.kv = desc.get("kv_heads", self.heads)
        self.d = h // self.heads
        f = desc.get("ffn", 4 * h)
        self.causal = causal
        self.n1, self.n2 = _norm(h), _norm(h)
        self.qkv = torch.nn.Linear(h, (self.heads + 2 * self.kv) * self.d, bias=False)
        self.out = torch.nn.Linear(h, h, bias=False)
        self.w1 = torch.nn.Linear(h, f, bias=False)
        self.w3 = torch.nn.Linear(h, f, bias=False) if desc.get("gated", False) else None
        self.w2 = torch.nn.Linear(f, h, bias=False)

    def forward(self, x: torch.Tensor, cu: list[int], jagged: bool) -> torch.Tensor:
        """One pre-norm block over packed tokens; attention stays within each document (``cu``)."""
        heads, kv, d = self.heads, self.kv, self.d
        q, k, v = self.qkv(self.n1(x)).split([heads * d, kv * d, kv * d], dim=-1)
        q, k, v = q.view(-1, heads, d), k.view(-1, kv, d), v.view(-1, kv, d)
        if kv != heads:  # grouped-query attention: each KV head serves heads / kv query heads
            k = k.repeat_interleave(heads // kv, dim=1)
            v = v.repeat_interleave(heads // kv, dim=1)
        attend = attend_jagged if jagged else attend_loop
        x = x + self.out(attend(q, k, v, cu, self.causal).reshape(len(x), -1))
        y = self.n2(x)
        if self.w3 is not None:
            return x + self.w2(F.silu(self.w1(y)) * self.w3(y))
        return x + self.w2(F.gelu(self.w1(y)))


class Transformer(torch.nn.Module):
    """Decoder (and optional vision encoder) over one packed micro-batch; returns the loss."""

    def __init__(
        self,
        desc: Mapping[str, Any],
        encoder: Mapping[str, Any] | None = None,
        patch_size: int = 14,
        merge: int = 2,
    ) -> None:
        super().__init__()
        h = desc["hidden"]
        self.vocab = int(desc.get("vocab", 0))
        self.emb = torch.nn.Embedding(max(self.vocab, 256), h)
        causal = desc.get("causal", True)
        self.blocks = torch.nn.ModuleList([Block(desc, causal) for _ in range(desc["layers"])])
        self.norm = _norm(h)
        self.head = torch.nn.Linear(h, self.vocab, bias=False) if self.vocab else None
        self.jagged = False
        self.merge = merge
        self.encoder: torch.nn.ModuleList | None = None
        if encoder is not None:
            he = encoder["hidden"]
            self.patch_embed = torch.nn.Linear(3 * patch_size * patch_size, he, bias=False)
            bidirectional = encoder.get("causal", False)
            self.encoder = torch.nn.ModuleList(
                [Block(encoder, bidirectional) for _ in range(encoder["layers"])]
            )
            self.merger = torch.nn.Linear(merge * merge * he, h, bias=False)

    def forward(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Logits for a packed micro-batch in the feeder's layout (images scattered in, if any)."""
        x = self.emb(batch["input_ids"])
        if self.encoder is not None and "pixel_patches" in batch:
            patches = batch["pixel_patches"]
            e = self.patch_embed(patches.reshape(len(patches), -1).to(x.dtype) / 255.0)
            cu_patches = batch["image_cu_patches"].tolist()
            for block in self.encoder:
                e = block(e, cu_patches, self.jagged)
            merged = self.merger(e.reshape(-1, self.merge * self.merge * e.shape[-1]))
            where = batch["image_token_map"]
            at = torch.nonzero(where >= 0).flatten()
            x = x.index_put((at,), merged[where[at]])
        cu = batch["cu_seqlens"].tolist()
        for block in self.blocks:
            x = block(x, cu, self.jagged)
        x = self.norm(x)
        if self.head is None:  # no LM head described: a loss over the hidden states
            return x.float().pow(2).mean()
        return F.cross_entropy(self.head(x).float(), batch["labels"], ignore_index=-100)


def build_transformer(
    description: Mapping[str, Any],
    device: torch.device | str,
    *,
    dtype: torch.dtype | None = None,
    attention: str = "auto",
    encoder: Mapping[str, Any] | None = None,
    patch_size: int = 14,
    merge: int = 2,
    seed: int = 0,
) -> Transformer:
    """A :class:`Transformer` for a checked ``description`` on ``device``, in ``dtype`` (float32
    on CPU, bfloat16 on CUDA by default); ``attention`` is one of ``ATTENTION_MODES``."""
    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(seed)
    net = Transformer(description, encoder, patch_size, merge).to(device=device, dtype=dtype)
    if attention == "auto":
        net.jagged = device.type == "cuda" and jagged_works(device, dtype)
    else:
        net.jagged = attention == "jagged"
    return net

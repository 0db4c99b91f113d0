"""RMSNorm variants, torch reference: computed in float32, returned in x.dtype.

- ``rms_norm``: plain (``w``) or zero-centred (``1 + w``, Qwen3-Next's model norms).
- ``gated_rms_norm``: ``norm_before_gate=True`` is Qwen3-Next's GDN output norm,
  ``rmsnorm(x) * w * silu(z)``; ``False`` is Mamba2's (Granite, Nemotron-H, Bamba),
  ``rmsnorm(x * silu(z)) * w``, with the rms taken per group of ``group_size`` channels.

Every product is formed in float32 and rounded once at the end; transformers rounds to the
input dtype before multiplying by the weight, so bf16 results may differ by one ulp.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _normalize(x: Tensor, eps: float, group_size: int | None = None) -> Tensor:
    """fp32 x [..., D] scaled to unit rms over each group of ``group_size`` channels."""
    dim = x.shape[-1]
    size = dim if group_size is None else group_size
    if size <= 0 or dim % size != 0:
        raise ValueError(f"group_size {group_size} does not divide the last dim {dim}")
    grouped = x.reshape(*x.shape[:-1], dim // size, size)
    grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    return grouped.reshape(x.shape)


def rms_norm_torch(x: Tensor, weight: Tensor, eps: float, zero_centered: bool) -> Tensor:
    w = weight.float()
    if zero_centered:
        w = 1.0 + w
    return (_normalize(x.float(), eps) * w).to(x.dtype)


def gated_rms_norm_torch(
    x: Tensor, z: Tensor, weight: Tensor, eps: float, group_size: int | None, norm_before_gate: bool
) -> Tensor:
    gate = F.silu(z.float())
    if norm_before_gate:
        y = _normalize(x.float(), eps, group_size) * weight.float() * gate
    else:
        y = _normalize(x.float() * gate, eps, group_size) * weight.float()
    return y.to(x.dtype)

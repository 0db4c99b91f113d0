"""RMSNorm variants of the hybrid models, computed in float32, returned in x.dtype.

- ``rms_norm``: plain (``w``) or zero-centred (``1 + w``, Qwen3-Next's model norms).
- ``gated_rms_norm``: ``norm_before_gate=True`` is Qwen3-Next's GDN output norm,
  ``rmsnorm(x) * w * silu(z)``; ``False`` is Mamba2's (Granite, Nemotron-H, Bamba),
  ``rmsnorm(x * silu(z)) * w``, with the rms taken per group of ``group_size`` channels.

Files: ``reference`` (torch) and ``triton_norm`` (one fused kernel for every variant); an
eager CPU fp32 call takes the C++ kernels of ``kernels.fused_cpu``.
"""

from __future__ import annotations

from torch import Tensor

from kernels import backend, fused_cpu, graph_ops
from kernels.norm.reference import gated_rms_norm_torch, rms_norm_torch

__all__ = ["gated_rms_norm", "rms_norm"]


def rms_norm(x: Tensor, weight: Tensor, eps: float, zero_centered: bool = False) -> Tensor:
    """x [..., D], weight [D] -> [..., D] in x.dtype."""
    if backend.use_triton(x):
        return graph_ops.rms_norm(x, weight, eps, zero_centered)
    if fused_cpu.usable(x, weight):
        return fused_cpu.rms_norm(x, weight, eps, zero_centered)
    return rms_norm_torch(x, weight, eps, zero_centered)


def gated_rms_norm(
    x: Tensor, z: Tensor, weight: Tensor, eps: float, group_size: int | None = None, norm_before_gate: bool = True
) -> Tensor:
    """x, z [..., D], weight [D] -> [..., D] in x.dtype; rms over groups of ``group_size``
    channels (default: all D)."""
    if backend.use_triton(x):
        return graph_ops.gated_rms_norm(x, z, weight, eps, group_size, norm_before_gate)
    if fused_cpu.usable(x, z, weight):
        return fused_cpu.gated_rms_norm(x, z, weight, eps, group_size, norm_before_gate)
    return gated_rms_norm_torch(x, z, weight, eps, group_size, norm_before_gate)

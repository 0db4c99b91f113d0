"""The eager CPU forward's fused elementwise ops (``kernels/native_fused.cpp``): RMSNorm,
gated RMSNorm, SiLU(gate) * up, the GDN's scaled L2 norm of q / k and RoPE, each one pass
over the activations where the torch formulation makes 3-8 (memory-bound at a prefill's
size: each pass reads and writes the whole tensor).

``usable(*tensors)`` is the rule every caller applies: the ``auto`` backend on CPU, fp32,
nothing for autograd to record, not while torch.compile traces (a compiled step keeps the
torch formulation, which inductor fuses into its neighbours), and the native ops built.
Anything else takes the torch reference. Their bits are not the reference's (the sum of
squares in another order; SiLU by ``silu_of``); a row's bits depend on that row alone, so
batching and prefix caching stay exact (``tests/kernels/test_fused_cpu.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels import backend, native_ops


def usable(*tensors: Tensor) -> bool:
    """Whether the fused kernels may take these tensors (the rule in the module docstring)."""
    if torch.compiler.is_compiling() or not backend.use_native(tensors[0]):
        return False
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    return native_ops.loaded() or native_ops.load()


def rms_norm(x: Tensor, weight: Tensor, eps: float, zero_centered: bool) -> Tensor:
    return torch.ops.hybridserve_native.rms_norm(x, weight.contiguous(), eps, zero_centered)


def gated_rms_norm(
    x: Tensor, z: Tensor, weight: Tensor, eps: float, group_size: int | None, norm_before_gate: bool
) -> Tensor:
    size = x.shape[-1] if group_size is None else group_size
    if size <= 0 or x.shape[-1] % size:
        raise ValueError(f"group_size {group_size} does not divide the last dim {x.shape[-1]}")
    return torch.ops.hybridserve_native.gated_rms_norm(x, z, weight.contiguous(), eps, size, norm_before_gate)


def silu_and_mul(gate: Tensor, up: Tensor) -> Tensor:
    return torch.ops.hybridserve_native.silu_and_mul(gate, up)


def l2norm_scale(x: Tensor, eps: float, scale: float) -> Tensor:
    """x * rsqrt(sum(x^2) + eps) * scale over the last dim, contiguous."""
    return torch.ops.hybridserve_native.l2norm_scale(x, eps, scale)


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE of x [T, H, D] on its first ``cos.shape[-1]`` dims (``layers.apply_rotary``)."""
    return torch.ops.hybridserve_native.rope(x, cos, sin)

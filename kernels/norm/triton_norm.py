"""One fused Triton kernel for every RMSNorm variant of ``kernels.norm`` (fp32 math).

A program normalises BM rows x one channel group (``group_size`` channels, the whole row
for the plain and Qwen3-Next norms):

    plain:              x * rstd(x) * w'            (w' = 1 + w when zero-centred)
    norm_before_gate:   x * rstd(x) * w * silu(z)
    gate_before_norm:   (x silu(z)) * rstd(x silu(z)) * w

with rstd(a) = 1 / sqrt(mean(a^2) + eps) over the group.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.chunking import next_pow2
from kernels.launch_grid import row_block_grid


@triton.jit
def rms_norm_kernel(
    x, z, weight, out,                      # x, z, out [M, D] contiguous; weight [D]
    num_rows, eps,
    D: tl.constexpr, GROUP: tl.constexpr, BM: tl.constexpr, BG: tl.constexpr,
    HAS_GATE: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr, ZERO_CENTERED: tl.constexpr,
):
    i_m = tl.program_id(0)
    i_g = tl.program_id(1)
    o_m = i_m * BM + tl.arange(0, BM)
    o_c = i_g * GROUP + tl.arange(0, BG)
    m_c = tl.arange(0, BG) < GROUP
    mask = (o_m < num_rows)[:, None] & m_c[None, :]
    offs = o_m.to(tl.int64)[:, None] * D + o_c[None, :]
    b_x = tl.load(x + offs, mask=mask, other=0.0).to(tl.float32)
    b_w = tl.load(weight + o_c, mask=m_c, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        b_w = 1.0 + b_w
    if HAS_GATE:
        b_z = tl.load(z + offs, mask=mask, other=0.0).to(tl.float32)
        gate = b_z * tl.sigmoid(b_z)
        if not NORM_BEFORE_GATE:
            b_x = b_x * gate
    rstd = 1.0 / tl.sqrt(tl.sum(b_x * b_x, axis=1) / GROUP + eps)
    b_y = b_x * rstd[:, None] * b_w[None, :]
    if HAS_GATE:
        if NORM_BEFORE_GATE:
            b_y = b_y * gate
    tl.store(out + offs, b_y.to(out.dtype.element_ty), mask=mask)


def _launch(x: Tensor, z: Tensor | None, weight: Tensor, eps: float, group_size: int,
            norm_before_gate: bool, zero_centered: bool) -> Tensor:
    dim = x.shape[-1]
    if group_size <= 0 or dim % group_size != 0:
        raise ValueError(f"group_size {group_size} does not divide the last dim {dim}")
    rows = x.reshape(-1, dim).contiguous()
    gate = z.reshape(-1, dim).contiguous() if z is not None else rows
    out = torch.empty_like(rows)
    num_rows = rows.shape[0]
    if num_rows == 0:
        return out.view(x.shape)
    block_g = next_pow2(group_size)
    block_m = max(1, min(16, 4096 // block_g, next_pow2(num_rows)))
    grid = row_block_grid("rms_norm", num_rows, block_m, dim, group_size)
    rms_norm_kernel[grid](rows, gate, weight.contiguous(), out, num_rows, float(eps), D=dim,
                          GROUP=group_size, BM=block_m, BG=block_g, HAS_GATE=z is not None,
                          NORM_BEFORE_GATE=norm_before_gate, ZERO_CENTERED=zero_centered,
                          num_warps=4 if block_m * block_g <= 4096 else 8)
    return out.view(x.shape)


def rms_norm_triton(x: Tensor, weight: Tensor, eps: float, zero_centered: bool = False) -> Tensor:
    return _launch(x, None, weight, eps, x.shape[-1], True, zero_centered)


def gated_rms_norm_triton(x: Tensor, z: Tensor, weight: Tensor, eps: float,
                          group_size: int | None = None, norm_before_gate: bool = True) -> Tensor:
    if z.shape != x.shape:
        raise ValueError(f"x {tuple(x.shape)} and z {tuple(z.shape)} must have one shape")
    size = x.shape[-1] if group_size is None else group_size
    return _launch(x, z, weight, eps, size, norm_before_gate, False)

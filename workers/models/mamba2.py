"""The Mamba2 (SSD) mixer shared by Granite-4.0-H, Nemotron-H, Bamba and Falcon-H1.

in_proj splits as ``[z (d_inner) | xBC (conv_dim) | dt (H)]`` with
``d_inner = H * P`` and ``conv_dim = d_inner + 2 * G * N``; xBC goes through the causal conv,
then splits into ``x [T, H, P]``, ``B, C [T, G, N]``. The SSD scan (state ``[H, P, N]`` per
slot, fp32) adds ``D * x``; the gated RMSNorm over ``d_inner / G`` groups gates with
``silu(z)`` (Granite/Nemotron-H: gate before the norm), then ``out_proj``.

Family differences stay in ``Mamba2Dims`` (e.g. ``norm_before_gate`` for Falcon-H1); the
mixer holds the HF parameter names: ``in_proj``, ``conv1d``, ``dt_bias``, ``A_log``, ``D``,
``norm``, ``out_proj``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kernels.ssd import ssd_update, ssd_varlen
from workers.device_pools import DevicePools
from workers.forward_batch import ForwardBatch
from workers.models.layers import CausalConv1d, GatedRMSNorm, linear, param


@dataclass(frozen=True)
class Mamba2Dims:
    hidden_size: int
    num_heads: int                  # H
    head_dim: int                   # P
    state_size: int                 # N
    num_groups: int                 # G
    conv_kernel: int                # W
    conv_bias: bool
    proj_bias: bool
    chunk_size: int
    dt_limit: tuple[float, float]   # clamp of softplus(dt + dt_bias), same in prefill and decode
    eps: float
    norm_before_gate: bool = False

    @property
    def d_inner(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.num_groups * self.state_size

    @property
    def ssm_shape(self) -> tuple[int, int, int]:
        return (self.num_heads, self.head_dim, self.state_size)

    def validate(self) -> None:
        if self.num_heads % self.num_groups:
            raise ValueError(f"mamba num_heads={self.num_heads} is not a multiple of "
                             f"n_groups={self.num_groups}")
        lo, hi = self.dt_limit
        if not 0.0 <= lo < hi:
            raise ValueError(f"time_step_limit must satisfy 0 <= min < max, got {self.dt_limit}")


class Mamba2Mixer(nn.Module):
    def __init__(self, dims: Mamba2Dims, dtype: torch.dtype) -> None:
        super().__init__()
        dims.validate()
        self.dims = dims
        proj_width = dims.d_inner + dims.conv_dim + dims.num_heads
        self.in_proj = linear(dims.hidden_size, proj_width, dims.proj_bias, dtype)
        self.conv1d = CausalConv1d(dims.conv_dim, dims.conv_kernel, dims.conv_bias, dtype)
        self.dt_bias = param(dims.num_heads, dtype=dtype)
        self.A_log = param(dims.num_heads, dtype=dtype)
        self.D = param(dims.num_heads, dtype=dtype)
        self.norm = GatedRMSNorm(dims.d_inner, dims.eps, dtype,
                                 group_size=dims.d_inner // dims.num_groups,
                                 norm_before_gate=dims.norm_before_gate)
        self.out_proj = linear(dims.d_inner, dims.hidden_size, dims.proj_bias, dtype)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, pools: DevicePools,
                mamba_idx: int) -> torch.Tensor:
        d = self.dims
        num_tokens = hidden.shape[0]
        z, xbc, dt = self.in_proj(hidden).split([d.d_inner, d.conv_dim, d.num_heads], dim=-1)
        xbc = self.conv1d(xbc, pools.mamba.conv[mamba_idx], batch)
        x, b, c = xbc.split([d.d_inner, d.num_groups * d.state_size,
                             d.num_groups * d.state_size], dim=-1)
        x = x.reshape(num_tokens, d.num_heads, d.head_dim)
        b = b.reshape(num_tokens, d.num_groups, d.state_size)
        c = c.reshape(num_tokens, d.num_groups, d.state_size)
        a = -torch.exp(self.A_log.float())
        if batch.decode_only:
            y = ssd_update(x, dt, a, b, c, self.D, self.dt_bias, pools.mamba.ssm[mamba_idx],
                           batch.mamba_slot_ids, dt_softplus=True, dt_limit=d.dt_limit)
        else:
            y = ssd_varlen(x, dt, a, b, c, self.D, self.dt_bias, pools.mamba.ssm[mamba_idx],
                           batch.cu_seqlens, batch.mamba_slot_ids, batch.has_initial_state,
                           dt_softplus=True, dt_limit=d.dt_limit, chunk_size=d.chunk_size,
                           state_dst_slots=batch.state_dst_slots)
        y = self.norm(y.reshape(num_tokens, d.d_inner), z)
        return self.out_proj(y.to(hidden.dtype))

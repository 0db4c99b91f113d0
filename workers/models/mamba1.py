"""The Mamba1 (selective scan) mixer of Jamba, Mamba and FalconMamba.

Per token: ``in_proj`` splits as ``[x (d_inner) | z (d_inner)]``; x goes through the causal
conv + SiLU; ``x_proj`` (no bias) gives ``[dt (dt_rank) | B (N) | C (N)]``, each through its
own RMSNorm in Jamba (``dt_layernorm``, ``b_layernorm``, ``c_layernorm``: ``inner_norm_eps``;
weightless in FalconMamba, ``inner_norm_weighted=False``; none in plain Mamba); ``dt_proj``'s
weight lifts dt to d_inner channels and its bias is the scan's ``dt_bias`` (added before the
softplus, as transformers does); the selective scan (``kernels.selective_scan``:
A = -exp(A_log) [d_inner, N], state [d_inner, N] per slot, fp32) adds ``D * x``; the result
is gated by ``silu(z)`` and goes through ``out_proj``.

The mixer holds the HF parameter names: ``in_proj``, ``conv1d``, ``x_proj``, ``dt_proj``,
``A_log``, ``D``, the three norms, ``out_proj``. Under TP (``workers/tp/shard_layers.py``)
the d_inner channels are split; ``x_proj`` then reads only this rank's channels, so its
output is summed over ranks (an all-reduce hook on ``x_proj``) before dt, B and C are used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels import dense
from kernels.selective_scan import mamba_selective_scan
from workers.models.layers import CausalConv1d, LayerContext, RMSNorm, linear, param
from workers.state_spec import StateKind, StateRef, mamba1_kind


@dataclass(frozen=True)
class Mamba1Dims:
    hidden_size: int
    d_inner: int  # H channels of the scan
    state_size: int  # N
    dt_rank: int  # R
    conv_kernel: int  # W
    conv_bias: bool
    proj_bias: bool  # in_proj / out_proj (x_proj has none, dt_proj always one)
    inner_norm_eps: float | None  # RMSNorms on dt, B, C (Jamba, FalconMamba); None: no norms
    inner_norm_weighted: bool = True  # False: the norms have no weight (FalconMamba)
    chunk_size: int = 64  # the torch path's chunk (results do not depend on it)
    ssm_dtype: str = "float32"  # the scan state's dtype in the pool

    def validate(self) -> None:
        for name, value in (
            ("mamba_d_state", self.state_size),
            ("mamba_dt_rank", self.dt_rank),
            ("mamba_d_conv", self.conv_kernel),
            ("d_inner", self.d_inner),
        ):
            if value < 1:
                raise ValueError(f"{name}={value} must be positive")


class WeightlessRMSNorm(nn.Module):
    """``x / rms(x)`` in fp32, back in x's dtype (FalconMamba's dt / B / C norms)."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def inner_norm(dim: int, dims: Mamba1Dims, dtype: torch.dtype) -> nn.Module:
    assert dims.inner_norm_eps is not None
    if dims.inner_norm_weighted:
        return RMSNorm(dim, dims.inner_norm_eps, dtype)
    return WeightlessRMSNorm(dims.inner_norm_eps)


class Mamba1Mixer(nn.Module):
    def __init__(self, dims: Mamba1Dims, dtype: torch.dtype) -> None:
        super().__init__()
        dims.validate()
        self.dims = dims
        di, n, r = dims.d_inner, dims.state_size, dims.dt_rank
        self.in_proj = linear(dims.hidden_size, 2 * di, dims.proj_bias, dtype)
        self.conv1d = CausalConv1d(di, dims.conv_kernel, dims.conv_bias, dtype)
        self.x_proj = linear(di, r + 2 * n, False, dtype)
        self.dt_proj = linear(r, di, True, dtype)
        self.A_log = param(di, n, dtype=dtype)
        self.D = param(di, dtype=dtype)
        self.out_proj = linear(di, dims.hidden_size, dims.proj_bias, dtype)
        self.dt_layernorm = self.b_layernorm = self.c_layernorm = None
        if dims.inner_norm_eps is not None:
            self.dt_layernorm = inner_norm(r, dims, dtype)
            self.b_layernorm = inner_norm(n, dims, dtype)
            self.c_layernorm = inner_norm(n, dims, dtype)

    def state_kind(self) -> StateKind:
        d = self.dims
        return mamba1_kind(d.d_inner, d.conv_kernel, d.state_size, d.ssm_dtype)

    def forward(self, hidden: torch.Tensor, ctx: LayerContext, ref: StateRef) -> torch.Tensor:
        d = self.dims
        batch, state = ctx.batch, ctx.pools.mamba.layer(ref)
        x, z = self.in_proj(hidden).split([d.d_inner, d.d_inner], dim=-1)
        x = self.conv1d(x, state["conv"], batch)
        dt, b, c = self.x_proj(x).split([d.dt_rank, d.state_size, d.state_size], dim=-1)
        if self.dt_layernorm is not None:
            assert self.b_layernorm is not None and self.c_layernorm is not None
            dt, b, c = self.dt_layernorm(dt), self.b_layernorm(b), self.c_layernorm(c)
        dt = dense.plain_linear(dt, self.dt_proj.weight)  # dt_proj.bias is the scan's dt_bias
        a = -torch.exp(self.A_log.float())
        y = mamba_selective_scan(
            x, dt, a, b, c, self.D, self.dt_proj.bias, state["ssm"], batch.recurrent, chunk_size=d.chunk_size
        )
        return self.out_proj((y * F.silu(z)).to(hidden.dtype))

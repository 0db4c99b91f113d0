"""The Mamba2 (SSD) mixer of Mamba2, Granite-4.0-H, Nemotron-H, Bamba, Falcon-H1 and Zamba2.

in_proj splits as ``[z (d_inner) | xBC (conv_dim) | dt (H)]`` with
``d_inner = H * P`` and ``conv_dim = d_inner + 2 * G * N``; xBC goes through the causal conv,
then splits into ``x [T, H, P]``, ``B, C [T, G, N]``. The SSD scan (state ``[H, P, N]`` per
slot, fp32 unless ``ssm_dtype`` says otherwise) adds ``D * x``; the gated RMSNorm over
``d_inner / G`` groups gates with ``silu(z)``, then ``out_proj``.

Family differences stay in ``Mamba2Dims``: where the gate goes (``norm_before_gate``: norm
then gate, Falcon-H1's default; else gate then norm), no norm at all (``rms_norm=False``:
``y * silu(z)``, Falcon-H1's ``mamba_rms_norm=False``), separate in/out projection biases,
Falcon-H1's ``ssm_in_multiplier`` (on the input) and ``ssm_multipliers`` (one per in_proj
segment z, x, B, C, dt; the scale vector is rebuilt from the dims, so it follows a TP
shard). The mixer holds the HF parameter names: ``in_proj``, ``conv1d``, ``dt_bias``,
``A_log``, ``D``, ``norm``, ``out_proj``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels.ssd import ssd_scan
from workers.models.layers import CausalConv1d, GatedRMSNorm, LayerContext, linear, param
from workers.state_spec import StateKind, StateRef, conv_ssm_kind

MAMBA2 = "mamba2"


@dataclass(frozen=True)
class Mamba2Dims:
    hidden_size: int
    num_heads: int  # H
    head_dim: int  # P
    state_size: int  # N
    num_groups: int  # G
    conv_kernel: int  # W
    conv_bias: bool
    proj_bias: bool
    chunk_size: int
    dt_limit: tuple[float, float]  # clamp of softplus(dt + dt_bias), same in prefill and decode
    eps: float
    norm_before_gate: bool = False
    rms_norm: bool = True  # False: y * silu(z), no norm (Falcon-H1 option)
    out_proj_bias: bool | None = None  # None: as proj_bias (Falcon-H1: projectors_bias)
    input_multiplier: float = 1.0  # Falcon-H1 ssm_in_multiplier
    proj_multipliers: tuple[float, ...] | None = None  # Falcon-H1 ssm_multipliers (z, x, B, C, dt)
    ssm_dtype: str = "float32"  # the scan state's dtype in the pool

    @property
    def d_inner(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.num_groups * self.state_size

    @property
    def ssm_shape(self) -> tuple[int, int, int]:
        return (self.num_heads, self.head_dim, self.state_size)

    @property
    def proj_segments(self) -> tuple[int, ...]:
        """in_proj's output split z, x, B, C, dt (the ``proj_multipliers`` segments)."""
        gn = self.num_groups * self.state_size
        return (self.d_inner, self.d_inner, gn, gn, self.num_heads)

    def validate(self) -> None:
        if self.num_heads % self.num_groups:
            raise ValueError(f"mamba num_heads={self.num_heads} is not a multiple of n_groups={self.num_groups}")
        lo, hi = self.dt_limit
        if not 0.0 <= lo < hi:
            raise ValueError(f"time_step_limit must satisfy 0 <= min < max, got {self.dt_limit}")
        if self.proj_multipliers is not None and len(self.proj_multipliers) != 5:
            raise ValueError(f"ssm_multipliers must have 5 entries (z, x, B, C, dt), got {list(self.proj_multipliers)}")


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
        self.norm: nn.Module | None = None
        if dims.rms_norm:
            self.norm = GatedRMSNorm(
                dims.d_inner,
                dims.eps,
                dtype,
                group_size=dims.d_inner // dims.num_groups,
                norm_before_gate=dims.norm_before_gate,
            )
        out_bias = dims.proj_bias if dims.out_proj_bias is None else dims.out_proj_bias
        self.out_proj = linear(dims.d_inner, dims.hidden_size, out_bias, dtype)
        self._scale: tuple[object, torch.Tensor] | None = None

    def state_kind(self) -> StateKind:
        d = self.dims
        return conv_ssm_kind(MAMBA2, d.conv_dim, d.conv_kernel, d.ssm_shape, d.ssm_dtype)

    def _proj_scale(self, like: torch.Tensor) -> torch.Tensor:
        """[proj_width] per-channel ``proj_multipliers``, cached per (dims, device, dtype)."""
        key = (self.dims, like.device, like.dtype)
        if self._scale is None or self._scale[0] != key:
            assert self.dims.proj_multipliers is not None
            # built from host lists (no tensor-valued repeats): a compiled step may build it
            per_channel = [m for m, n in zip(self.dims.proj_multipliers, self.dims.proj_segments) for _ in range(n)]
            scale = torch.tensor(per_channel, dtype=torch.float32)
            self._scale = (key, scale.to(device=like.device, dtype=like.dtype))
        return self._scale[1]

    def forward(self, hidden: torch.Tensor, ctx: LayerContext, ref: StateRef) -> torch.Tensor:
        d = self.dims
        batch, state = ctx.batch, ctx.pools.mamba.layer(ref)
        num_tokens = hidden.shape[0]
        x_in = hidden if d.input_multiplier == 1.0 else hidden * d.input_multiplier
        proj = self.in_proj(x_in)
        if d.proj_multipliers is not None:
            proj = proj * self._proj_scale(proj)
        z, xbc, dt = proj.split([d.d_inner, d.conv_dim, d.num_heads], dim=-1)
        xbc = self.conv1d(xbc, state["conv"], batch)
        x, b, c = xbc.split([d.d_inner, d.num_groups * d.state_size, d.num_groups * d.state_size], dim=-1)
        x = x.reshape(num_tokens, d.num_heads, d.head_dim)
        b = b.reshape(num_tokens, d.num_groups, d.state_size)
        c = c.reshape(num_tokens, d.num_groups, d.state_size)
        a = -torch.exp(self.A_log.float())
        y = ssd_scan(
            x,
            dt,
            a,
            b,
            c,
            self.D,
            self.dt_bias,
            state["ssm"],
            batch.recurrent,
            dt_softplus=True,
            dt_limit=d.dt_limit,
            chunk_size=d.chunk_size,
        )
        y = y.reshape(num_tokens, d.d_inner)
        y = self.norm(y, z) if self.norm is not None else y * F.silu(z)
        return self.out_proj(y.to(hidden.dtype))

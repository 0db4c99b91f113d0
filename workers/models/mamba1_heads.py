"""Zamba's Mamba1 mixer: ``n_mamba_heads`` independent Mamba1 heads behind one conv.

As ``workers/models/mamba1.py`` (conv + SiLU on x, the selective scan, the ``silu(z)`` gate,
``out_proj``), except that the d_inner channels form ``heads`` heads of P = d_inner / heads
channels, each with its own selective projections (transformers' ``ZambaMambaMixer``):
``x_proj_weight`` [heads, R + 2N, P] gives a head's ``[dt | B | C]`` from its own channels,
``dt_proj_weight`` [heads, P, R] lifts its dt, ``dt_proj_bias`` [heads, P] is the scan's dt
bias; ``A_log`` [heads, P, N], ``D`` [heads, P]. The scan takes B and C grouped per head
(``kernels.selective_scan``'s G = heads). The state is Mamba1's: ``mamba1_kind(d_inner, ..)``.

``in_proj`` rows hold x and z interleaved in the checkpoint (transformers views the
projection as [d_inner, 2]: row 2c is channel c of x, row 2c + 1 channel c of z);
``deinterleave_in_proj`` turns them into ``[x | z]`` at load. Under TP each rank keeps whole
heads (``tp_shard``), so nothing is summed inside the mixer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from kernels import dense
from kernels.selective_scan import mamba_selective_scan
from workers.models.layers import CausalConv1d, LayerContext, linear, param
from workers.state_spec import StateKind, StateRef, mamba1_kind


@dataclass(frozen=True)
class Mamba1HeadsDims:
    hidden_size: int
    d_inner: int  # all heads' channels
    num_heads: int
    state_size: int  # N
    dt_rank: int  # R
    conv_kernel: int  # W
    conv_bias: bool
    proj_bias: bool  # in_proj / out_proj
    chunk_size: int = 64  # the torch path's chunk (results do not depend on it)

    @property
    def head_dim(self) -> int:
        return self.d_inner // self.num_heads

    def validate(self) -> None:
        for name, value in (
            ("mamba_d_state", self.state_size),
            ("mamba_dt_rank", self.dt_rank),
            ("mamba_d_conv", self.conv_kernel),
            ("n_mamba_heads", self.num_heads),
        ):
            if value < 1:
                raise ValueError(f"{name}={value} must be positive")
        if self.d_inner % self.num_heads:
            raise ValueError(
                f"mamba_expand * hidden_size={self.d_inner} is not divisible by n_mamba_heads={self.num_heads}"
            )


def deinterleave_in_proj(t: torch.Tensor) -> torch.Tensor:
    """Checkpoint rows [x_0, z_0, x_1, z_1, ...] -> [x | z] (weight [2D, H] or bias [2D])."""
    return t.reshape(t.shape[0] // 2, 2, *t.shape[1:]).transpose(0, 1).reshape(t.shape).contiguous()


class Mamba1HeadsMixer(nn.Module):
    def __init__(self, dims: Mamba1HeadsDims, dtype: torch.dtype) -> None:
        super().__init__()
        dims.validate()
        self.dims = dims
        di, h, p, n, r = dims.d_inner, dims.num_heads, dims.head_dim, dims.state_size, dims.dt_rank
        self.in_proj = linear(dims.hidden_size, 2 * di, dims.proj_bias, dtype)
        self.conv1d = CausalConv1d(di, dims.conv_kernel, dims.conv_bias, dtype)
        self.x_proj_weight = param(h, r + 2 * n, p, dtype=dtype)
        self.dt_proj_weight = param(h, p, r, dtype=dtype)
        self.dt_proj_bias = param(h, p, dtype=dtype)
        self.A_log = param(h, p, n, dtype=dtype)
        self.D = param(h, p, dtype=dtype)
        self.out_proj = linear(di, dims.hidden_size, dims.proj_bias, dtype)

    def state_kind(self) -> StateKind:
        d = self.dims
        return mamba1_kind(d.d_inner, d.conv_kernel, d.state_size)

    def forward(self, hidden: torch.Tensor, ctx: LayerContext, ref: StateRef) -> torch.Tensor:
        d = self.dims
        batch, state = ctx.batch, ctx.pools.mamba.layer(ref)
        x, z = self.in_proj(hidden).split([d.d_inner, d.d_inner], dim=-1)
        x = self.conv1d(x, state["conv"], batch)
        t = x.shape[0]
        params = dense.head_products(x.reshape(t, d.num_heads, d.head_dim), self.x_proj_weight)
        dt, b, c = params.split([d.dt_rank, d.state_size, d.state_size], dim=-1)  # [T, heads, *]
        dt = dense.head_products(dt, self.dt_proj_weight).reshape(t, d.d_inner)
        a = -torch.exp(self.A_log.float()).reshape(d.d_inner, d.state_size)
        y = mamba_selective_scan(
            x,
            dt,
            a,
            b,
            c,
            self.D.reshape(d.d_inner),
            self.dt_proj_bias.reshape(d.d_inner),
            state["ssm"],
            batch.recurrent,
            chunk_size=d.chunk_size,
        )
        return self.out_proj((y * F.silu(z)).to(hidden.dtype))

    # --- tensor parallelism (``workers/tp/shard.py`` calls these) -------------------------
    def tp_checks(self) -> list[tuple[int, str]]:
        return [(self.dims.num_heads, "n_mamba_heads")]

    def tp_shard(self, rank: int, world: int, comm: object) -> None:
        from workers.tp.shard_layers import _set, _take, column, part, row

        d = self.dims
        heads = part(d.num_heads, rank, world, "Mamba heads (n_mamba_heads)")
        channels = heads.scaled(d.head_dim)
        column(self.in_proj, [channels, heads.scaled(d.head_dim, d.d_inner)])  # [x | z]
        _set(self.conv1d, "weight", _take(self.conv1d.weight, 0, [channels]))
        if self.conv1d.bias is not None:
            _set(self.conv1d, "bias", _take(self.conv1d.bias, 0, [channels]))
        for name in ("x_proj_weight", "dt_proj_weight", "dt_proj_bias", "A_log", "D"):
            _set(self, name, _take(getattr(self, name), 0, [heads]))
        row(self.out_proj, [channels], rank)
        self.dims = replace(d, d_inner=heads.size * d.head_dim, num_heads=heads.size)

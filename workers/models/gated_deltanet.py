"""The Gated DeltaNet mixer of Qwen3-Next and Qwen3.5 / 3.6 (``linear_attn``).

Checkpoint layout (kept as is in the parameters): ``in_proj_qkvz`` rows are grouped per key
head g = 0..Hk-1 as ``[q_g (Dk) | k_g (Dk) | v_g (r*Dv) | z_g (r*Dv)]`` and ``in_proj_ba``
as ``[b_g (r) | a_g (r)]``, with r = Hv / Hk value heads per key head. Value head
``g*r + j`` belongs to key head g (HF's ``fix_query_key_value_ordering``). Grouping by key
head is also the natural tensor-parallel shard.

Per token: conv+SiLU over ``cat(q, k, v)``; ``beta = sigmoid(b)``;
``g = -exp(A_log) * softplus(a + dt_bias)`` (log decay); q, k keep their Hk heads (every
kernel of ``kernels.gdn`` reads key head h // r for value head h, as HF's repeat_interleave),
L2-normalised and q scaled by 1/sqrt(Dk) inside the kernel; the recurrent state per slot is
``[Hv, Dk, Dv]`` fp32. Output: per-head RMSNorm (plain weight) times ``silu(z)``, then
``out_proj``.

Qwen3.5 / 3.6 (``SplitGatedDeltaNet``) computes the same thing from four unfused
projections with flat head order: ``in_proj_qkv`` = ``[q (Hk*Dk) | k (Hk*Dk) | v (Hv*Dv)]``
(the conv's channel order as is), ``in_proj_z`` [Hv*Dv], ``in_proj_b`` / ``in_proj_a`` [Hv];
value head ``g*r + j`` still belongs to key head g.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels import dense
from kernels.gdn import gated_delta_rule
from workers.models.layers import CausalConv1d, GatedRMSNorm, LayerContext, linear, param
from workers.state_spec import StateKind, StateRef, conv_ssm_kind

GDN = "gdn"


@dataclass(frozen=True)
class GdnDims:
    hidden_size: int
    num_k_heads: int  # Hk
    num_v_heads: int  # Hv
    k_head_dim: int  # Dk
    v_head_dim: int  # Dv
    conv_kernel: int  # W
    eps: float
    beta_scale: float = 1.0  # beta = beta_scale * sigmoid(b) (OlmoHybrid's allow_neg_eigval: 2)

    @property
    def heads_per_group(self) -> int:
        return self.num_v_heads // self.num_k_heads

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.k_head_dim + self.num_v_heads * self.v_head_dim

    @property
    def ssm_shape(self) -> tuple[int, int, int]:
        return (self.num_v_heads, self.k_head_dim, self.v_head_dim)

    def validate(self) -> None:
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(
                f"linear_num_value_heads={self.num_v_heads} is not a multiple of "
                f"linear_num_key_heads={self.num_k_heads}"
            )


class GatedDeltaNet(nn.Module):
    def __init__(self, dims: GdnDims, dtype: torch.dtype) -> None:
        super().__init__()
        dims.validate()
        self.dims = dims
        value_dim = dims.num_v_heads * dims.v_head_dim
        self._build_projections(dims, dtype)
        self.conv1d = CausalConv1d(dims.conv_dim, dims.conv_kernel, False, dtype)
        self.dt_bias = param(dims.num_v_heads, dtype=dtype)
        self.A_log = param(dims.num_v_heads, dtype=dtype)
        self.norm = GatedRMSNorm(dims.v_head_dim, dims.eps, dtype, group_size=None, norm_before_gate=True)
        self.out_proj = linear(value_dim, dims.hidden_size, False, dtype)

    def _build_projections(self, dims: GdnDims, dtype: torch.dtype) -> None:
        key_dim, value_dim = dims.num_k_heads * dims.k_head_dim, dims.num_v_heads * dims.v_head_dim
        self.in_proj_qkvz = linear(dims.hidden_size, 2 * key_dim + 2 * value_dim, False, dtype)
        self.in_proj_ba = linear(dims.hidden_size, 2 * dims.num_v_heads, False, dtype)

    def state_kind(self) -> StateKind:
        d = self.dims
        return conv_ssm_kind(GDN, d.conv_dim, d.conv_kernel, d.ssm_shape)

    def split_projections(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """-> mixed_qkv [T, conv_dim], z [T, Hv, Dv], b [T, Hv], a [T, Hv] (see module doc)."""
        d = self.dims
        num_tokens, r = hidden.shape[0], d.heads_per_group
        qkvz = self.in_proj_qkvz(hidden).view(num_tokens, d.num_k_heads, -1)
        q, k, v, z = qkvz.split([d.k_head_dim, d.k_head_dim, r * d.v_head_dim, r * d.v_head_dim], dim=-1)
        ba = self.in_proj_ba(hidden).view(num_tokens, d.num_k_heads, 2 * r)
        b, a = ba.split([r, r], dim=-1)
        mixed_qkv = torch.cat([q.reshape(num_tokens, -1), k.reshape(num_tokens, -1), v.reshape(num_tokens, -1)], dim=-1)
        return (
            mixed_qkv,
            z.reshape(num_tokens, d.num_v_heads, d.v_head_dim),
            b.reshape(num_tokens, d.num_v_heads),
            a.reshape(num_tokens, d.num_v_heads),
        )

    def forward(self, hidden: torch.Tensor, ctx: LayerContext, ref: StateRef) -> torch.Tensor:
        d = self.dims
        batch, state = ctx.batch, ctx.pools.mamba.layer(ref)
        num_tokens = hidden.shape[0]
        mixed_qkv, z, b, a = self.split_projections(hidden)
        mixed_qkv = self.conv1d(mixed_qkv, state["conv"], batch)
        key_dim = d.num_k_heads * d.k_head_dim
        q, k, v = mixed_qkv.split([key_dim, key_dim, d.num_v_heads * d.v_head_dim], dim=-1)
        q = q.reshape(num_tokens, d.num_k_heads, d.k_head_dim)
        k = k.reshape(num_tokens, d.num_k_heads, d.k_head_dim)
        v = v.reshape(num_tokens, d.num_v_heads, d.v_head_dim)
        g = -torch.exp(self.A_log.float()) * dense.pointwise(F.softplus, a.float() + self.dt_bias.float())
        beta = dense.pointwise(torch.sigmoid, b)
        beta = beta if d.beta_scale == 1.0 else beta * d.beta_scale
        # The kernels take strided column slices of the projection as they are.
        o = gated_delta_rule(q, k, v, g, beta, state["ssm"], batch.recurrent, use_qk_l2norm=True)
        o = self.norm(o.reshape(-1, d.v_head_dim), z.reshape(-1, d.v_head_dim))
        return self.out_proj(o.reshape(num_tokens, -1).to(hidden.dtype))


class SplitGatedDeltaNet(GatedDeltaNet):
    """Qwen3.5's projection layout (see the module docstring); the rest is Qwen3-Next's."""

    def _build_projections(self, dims: GdnDims, dtype: torch.dtype) -> None:
        value_dim = dims.num_v_heads * dims.v_head_dim
        self.in_proj_qkv = linear(dims.hidden_size, dims.conv_dim, False, dtype)
        self.in_proj_z = linear(dims.hidden_size, value_dim, False, dtype)
        self.in_proj_b = linear(dims.hidden_size, dims.num_v_heads, False, dtype)
        self.in_proj_a = linear(dims.hidden_size, dims.num_v_heads, False, dtype)

    def split_projections(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        d = self.dims
        z = self.in_proj_z(hidden).view(hidden.shape[0], d.num_v_heads, d.v_head_dim)
        return self.in_proj_qkv(hidden), z, self.in_proj_b(hidden), self.in_proj_a(hidden)

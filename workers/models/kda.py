"""The Kimi Delta Attention mixer of Kimi-Linear and BailingHybrid (``self_attn`` of their
``linear_attention`` layers).

Per token: ``q, k, v = q_proj(x), k_proj(x), v_proj(x)`` (H heads of D each), one causal
conv + SiLU over ``cat(q, k, v)`` (the checkpoint stores it as ``q_conv1d``, ``k_conv1d``,
``v_conv1d``, [H D, 1, W] each, no bias; the model's loader merges them);
``beta = sigmoid(b_proj(x))``; a log decay per key channel ``g`` [H, D] (below); the KDA
scan (``kernels.kda``: q, k l2-normalised, q scaled by D^-0.5, state [H, D, D] fp32 per
slot); the output ``rmsnorm(o) * w * sigmoid(gate)`` per head (fp32, weight [D] shared by
the heads), then ``o_proj`` (Bailing: ``dense``).

The two families differ only in the gates (``KdaDims.gate``):

- ``kimi``: ``g = -exp(A_log_h) * softplus(f_b(f_a(x)) + dt_bias)``, gate ``g_b(g_a(x))``
  (low-rank, rank D); ``A_log`` is stored [1, 1, H, 1].
- ``bailing`` (``kda_safe_gate``): ``g = lower_bound * sigmoid(exp(A_log_h) * (f_proj(x) +
  dt_bias))``; ``bailing_softplus``: ``-exp(A_log_h) * softplus(f_proj(x) + dt_bias)``;
  gate ``g_proj(x)``; ``A_log`` [H].
- ``glm`` (GLM-5.3-Flash, ``linear_lower_bound`` set): Kimi's low-rank projections with the
  lower-bounded sigmoid decay; ``glm_softplus`` (no bound): Kimi's decay; ``A_log`` [H].

``dt_bias`` [H D] and ``A_log`` are kept in fp32 (as transformers keeps them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels import dense
from kernels.kda import kimi_delta_attention
from workers.models.layers import CausalConv1d, LayerContext, linear, param
from workers.models.weights import WeightTarget, whole
from workers.state_spec import StateKind, StateRef, kda_kind

GATES = ("kimi", "bailing", "bailing_softplus", "glm", "glm_softplus")
LOW_RANK_GATES = ("kimi", "glm", "glm_softplus")  # f_a / f_b and g_a / g_b projections
BOUNDED_GATES = ("bailing", "glm")  # lower_bound * sigmoid(...)


@dataclass(frozen=True)
class KdaDims:
    hidden_size: int
    num_heads: int  # H (linear_num_heads)
    head_dim: int  # D (linear_head_dim): keys and values alike
    conv_kernel: int  # W
    eps: float  # the output norm's
    gate: str  # one of GATES
    gate_lower_bound: float = -5.0  # bailing: kda_lower_bound; glm: linear_lower_bound

    @property
    def qkv_dim(self) -> int:
        return self.num_heads * self.head_dim

    def validate(self) -> None:
        if self.gate not in GATES:
            raise ValueError(f"unknown KDA gate {self.gate!r}; expected one of {GATES}")


class KimiDeltaAttention(nn.Module):
    def __init__(self, dims: KdaDims, dtype: torch.dtype) -> None:
        super().__init__()
        dims.validate()
        self.dims = dims
        h, d, hidden = dims.num_heads, dims.head_dim, dims.hidden_size
        self.q_proj = linear(hidden, h * d, False, dtype)
        self.k_proj = linear(hidden, h * d, False, dtype)
        self.v_proj = linear(hidden, h * d, False, dtype)
        self.conv1d = CausalConv1d(3 * h * d, dims.conv_kernel, False, dtype)
        self.b_proj = linear(hidden, h, False, dtype)
        self.dt_bias = param(h * d, dtype=torch.float32)
        self.A_log = param(h, dtype=torch.float32)
        if dims.gate in LOW_RANK_GATES:
            self.f_a_proj, self.f_b_proj = linear(hidden, d, False, dtype), linear(d, h * d, False, dtype)
            self.g_a_proj, self.g_b_proj = linear(hidden, d, False, dtype), linear(d, h * d, False, dtype)
        else:
            self.f_proj = linear(hidden, h * d, False, dtype)
            self.g_proj = linear(hidden, h * d, False, dtype)
        self.o_norm_weight = param(d, dtype=dtype)
        self.o_proj = linear(h * d, hidden, False, dtype)

    def state_kind(self) -> StateKind:
        d = self.dims
        return kda_kind(d.num_heads, d.head_dim, d.head_dim, d.conv_kernel)

    def decay(self, x: torch.Tensor) -> torch.Tensor:
        """The per-channel log decay g [T, H, D] fp32 (see the module docstring)."""
        d = self.dims
        raw = self.f_b_proj(self.f_a_proj(x)) if d.gate in LOW_RANK_GATES else self.f_proj(x)
        raw = (raw.float() + self.dt_bias.float()).view(x.shape[0], d.num_heads, d.head_dim)
        rate = self.A_log.float().exp()[:, None]  # [H, 1]
        if d.gate in BOUNDED_GATES:
            return d.gate_lower_bound * dense.pointwise(torch.sigmoid, rate * raw)
        return -rate * dense.pointwise(F.softplus, raw)

    def output_gate(self, x: torch.Tensor) -> torch.Tensor:
        return self.g_b_proj(self.g_a_proj(x)) if self.dims.gate in LOW_RANK_GATES else self.g_proj(x)

    def forward(self, x: torch.Tensor, ctx: LayerContext, ref: StateRef) -> torch.Tensor:
        d = self.dims
        batch, state = ctx.batch, ctx.pools.mamba.layer(ref)
        num_tokens, shape = x.shape[0], (x.shape[0], d.num_heads, d.head_dim)
        mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        mixed = self.conv1d(mixed, state["conv"], batch)
        q, k, v = (t.reshape(shape) for t in mixed.split(d.qkv_dim, dim=-1))
        g, beta = self.decay(x), dense.pointwise(torch.sigmoid, self.b_proj(x).float())
        o = kimi_delta_attention(q, k, v, g, beta, state["ssm"], batch.recurrent)
        o = o.float()
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + d.eps) * self.o_norm_weight.float()
        o = o * dense.pointwise(torch.sigmoid, self.output_gate(x).float().view(shape))
        return self.o_proj(o.reshape(num_tokens, -1).to(x.dtype))

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        """The checkpoint's names (``conv1d.weight`` = q, k, v convs merged by the model's
        loader: ``weights.merge_split_tensors``), ``o_norm.weight``, A_log [1, 1, H, 1] for Kimi."""
        targets = {prefix + n: whole(p) for n, p in self.named_parameters() if n not in ("o_norm_weight", "A_log")}
        targets[f"{prefix}o_norm.weight"] = whole(self.o_norm_weight)
        a_log = self.A_log.view(1, 1, -1, 1) if self.dims.gate == "kimi" else self.A_log
        targets[f"{prefix}A_log"] = whole(a_log)
        return targets

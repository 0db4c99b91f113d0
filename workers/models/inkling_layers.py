"""Inkling's layer pieces: the residual short conv, the attention with convolved k / v and a
relative-position bias, the MoE with shared experts in the router's softmax, the scaled MLP.

- ``ResidualConv`` (``*_sconv``): ``x + conv(x)``, a depthwise causal conv without bias or
  activation, computed in fp32 with fp32 weights (transformers keeps these modules fp32) and
  cast back; its window lives in the layer's ``conv_windows`` slot state (fp32).
- ``InklingAttention``: ``q = q_norm(q_proj x)``, ``k = k_norm(k_sconv(k_proj x))``,
  ``v = v_sconv(v_proj x)`` per head (no RoPE), scores ``q.k / head_dim`` plus the bias
  ``r_proj(x)[h] @ rel_logits_proj.proj[:, distance]`` for distances below ``rel_extent``
  (``kernels.attention.relative``); full layers with ``log_scaling_n_floor`` scale q and the
  bias by ``1 + alpha * log(max((pos + 1) / n_floor, 1))``. Sliding layers read the last
  ``sliding_window`` positions (every token's KV stays in the pool).
- ``InklingMoE``: fp32 sigmoid router over routed + shared experts; top-k of the routed scores
  plus ``e_score_correction_bias``; the chosen routed and all shared experts' sigmoid scores
  normalised together, times ``route_scale * gate.global_scale``; shared experts weighted
  by theirs.

TP: attention by heads (q / r rows, k / v rows and their conv channels by KV heads,
``o_proj`` columns); the MoE's routed and shared experts by their intermediate dim; the
hidden-size convs are replicated (they run after the all-reduce).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kernels import dense
from kernels.attention.relative import paged_attention_relative
from workers.device_pools import LayerState
from workers.forward_batch import ForwardBatch
from workers.models.layers import CausalConv1d, DenseMLP, LayerContext, RMSNorm, linear, param
from workers.models.moe import MoeDims, SparseMoE
from workers.models.weights import WeightTarget, whole
from workers.state_spec import ATTENTION, StateKind, StateRef, attention_kind

if TYPE_CHECKING:
    from workers.tp.shard_layers import Part


class ResidualConv(nn.Module):
    """``(x + conv(x)) * scale`` in fp32 (``conv1d.weight`` [D, 1, W] fp32; Inkling2 scales by
    1 / sqrt(W + 1)); state [S, D, W-1] fp32."""

    def __init__(self, dim: int, width: int, scale: float = 1.0) -> None:
        super().__init__()
        self.conv1d = CausalConv1d(dim, width, False, torch.float32, activation=None)
        self.scale = scale

    def forward(self, x: torch.Tensor, state: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        xf = x.float()
        out = self.conv1d(xf, state, batch) + xf
        return (out if self.scale == 1.0 else out * self.scale).to(x.dtype)


def log_scale(positions: torch.Tensor, n_floor: int, alpha: float) -> torch.Tensor:
    """The full layers' ``1 + alpha * log(max((pos + 1) / n_floor, 1))`` -> [T, 1, 1] fp32."""
    pos = positions.float() + 1.0
    return (1.0 + alpha * dense.pointwise(torch.log, (pos / n_floor).clamp(min=1.0)))[:, None, None]


class RelativeLogits(nn.Module):
    def __init__(self, d_rel: int, extent: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.proj = param(d_rel, extent, dtype=dtype)


@dataclass(frozen=True)
class InklingAttentionDims:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    d_rel: int
    rel_extent: int
    conv_width: int
    eps: float
    window: int | None  # sliding layers
    log_floor: int | None  # full layers' log scaling (log_scaling_n_floor)
    log_alpha: float
    kind: str = ATTENTION  # the KV's state kind name (sliding layers keep their own)
    heads_field: str = "num_attention_heads"


def relative_attention(
    ctx: LayerContext,
    ref: StateRef,
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    scale: float,
    rel: torch.Tensor,
    proj: torch.Tensor,
    window: int | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``kernels.attention.relative`` over the layer's KV ``ref`` for the step's batch."""
    batch, kv = ctx.batch, ctx.pools.kv.layer(ref)
    q, k, v = (t.contiguous() for t in qkv)
    return paged_attention_relative(
        q,
        k,
        v,
        kv["k"],
        kv["v"],
        batch.out_loc,
        batch.page_table,
        batch.cu_seqlens,
        batch.seq_lens,
        batch.page_size,
        scale,
        rel,
        proj,
        window,
        sinks,
    )


def head_checks(d: InklingAttentionDims) -> list[tuple[int, str]]:
    """The head counts a TP split must divide, by their config names (full or ``swa_*``)."""
    kv_field = d.heads_field.replace("num_attention_heads", "num_key_value_heads")
    return [(d.num_heads, d.heads_field), (d.num_kv_heads, kv_field)]


def head_parts(d: InklingAttentionDims, rank: int, world: int) -> tuple[Part, Part]:
    """This rank's (query heads, KV heads)."""
    from workers.tp.shard_layers import part

    (heads, heads_field), (kv, kv_field) = head_checks(d)
    return part(heads, rank, world, heads_field), part(kv, rank, world, kv_field)


class InklingAttention(nn.Module):
    def __init__(self, dims: InklingAttentionDims, dtype: torch.dtype) -> None:
        super().__init__()
        d = self.dims = dims
        kv_width = d.num_kv_heads * d.head_dim
        self.q_proj = linear(d.hidden_size, d.num_heads * d.head_dim, False, dtype)
        self.k_proj = linear(d.hidden_size, kv_width, False, dtype)
        self.v_proj = linear(d.hidden_size, kv_width, False, dtype)
        self.r_proj = linear(d.hidden_size, d.num_heads * d.d_rel, False, dtype)
        self.o_proj = linear(d.num_heads * d.head_dim, d.hidden_size, False, dtype)
        self.k_sconv = ResidualConv(kv_width, d.conv_width)
        self.v_sconv = ResidualConv(kv_width, d.conv_width)
        self.q_norm = RMSNorm(d.head_dim, d.eps, dtype)
        self.k_norm = RMSNorm(d.head_dim, d.eps, dtype)
        self.rel_logits_proj = RelativeLogits(d.d_rel, d.rel_extent, dtype)

    @property
    def kv_width(self) -> int:
        return self.dims.num_kv_heads * self.dims.head_dim

    def state_kind(self) -> StateKind:
        return attention_kind(self.dims.num_kv_heads, self.dims.head_dim, name=self.dims.kind)

    def forward(self, x: torch.Tensor, ctx: LayerContext, ref: StateRef, convs: LayerState) -> torch.Tensor:
        d, batch, n = self.dims, ctx.batch, x.shape[0]
        q = self.q_norm(self.q_proj(x).view(n, d.num_heads, d.head_dim))
        k = self.k_norm(self.k_sconv(self.k_proj(x), convs["k"], batch).view(n, d.num_kv_heads, d.head_dim))
        v = self.v_sconv(self.v_proj(x), convs["v"], batch).view(n, d.num_kv_heads, d.head_dim)
        r = self.r_proj(x).view(n, d.num_heads, d.d_rel)
        if d.window is None and d.log_floor is not None:
            tau = log_scale(batch.positions, d.log_floor, d.log_alpha)
            q, r = (q.float() * tau).to(q.dtype), r.float() * tau
        o = relative_attention(ctx, ref, (q, k, v), 1.0 / d.head_dim, r, self.rel_logits_proj.proj, d.window)
        return self.o_proj(o.reshape(n, d.num_heads * d.head_dim))

    def tp_checks(self) -> list[tuple[int, str]]:
        return head_checks(self.dims)

    def tp_shard(self, rank: int, world: int, comm: object) -> None:
        from workers.tp.shard_layers import _set, _take, column, row

        d = self.dims
        heads, kv = head_parts(d, rank, world)
        column(self.q_proj, [heads.scaled(d.head_dim)])
        column(self.r_proj, [heads.scaled(d.d_rel)])
        for proj, conv in ((self.k_proj, self.k_sconv), (self.v_proj, self.v_sconv)):
            column(proj, [kv.scaled(d.head_dim)])
            _set(conv.conv1d, "weight", _take(conv.conv1d.weight, 0, [kv.scaled(d.head_dim)]))
        row(self.o_proj, [heads.scaled(d.head_dim)], rank)
        self.dims = replace(d, num_heads=heads.size, num_kv_heads=kv.size)


class ScaledMLP(DenseMLP):
    """SwiGLU times a learned scalar ``global_scale``."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype) -> None:
        super().__init__(hidden_size, intermediate_size, dtype)
        self.global_scale = param(1, dtype=dtype)

    def forward(self, x: torch.Tensor, adapter: int | None = None) -> torch.Tensor:
        return super().forward(x) * self.global_scale

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        return {**super().weight_targets(prefix), f"{prefix}global_scale": whole(self.global_scale)}


class InklingMoE(SparseMoE):
    def __init__(self, dims: MoeDims, num_shared: int, dtype: torch.dtype) -> None:
        super().__init__(dims, dtype)
        e, i, h = dims.num_experts, dims.intermediate_size, dims.hidden_size
        self.num_shared = num_shared
        self.router_weight = param(e + num_shared, h, dtype=torch.float32)
        self.global_scale = param(1, dtype=torch.float32)
        self.shared_gate = param(num_shared, i, h, dtype=dtype)
        self.shared_up = param(num_shared, i, h, dtype=dtype)
        self.shared_down = param(num_shared, h, i, dtype=dtype)

    def forward(self, x: torch.Tensor, expert_input: torch.Tensor | None = None) -> torch.Tensor:
        d = self.dims
        logits = dense.plain_linear(x.float(), self.router_weight.float())  # [T, E + S]
        routed = logits[:, : d.num_experts]
        assert self.score_bias is not None
        ids = (dense.pointwise(torch.sigmoid, routed) + self.score_bias).topk(d.top_k, dim=-1, sorted=False)[1]
        picked = dense.pointwise(F.logsigmoid, torch.cat([routed.gather(1, ids), logits[:, d.num_experts :]], dim=-1))
        weights = dense.pointwise(torch.exp, picked - torch.logsumexp(picked, dim=-1, keepdim=True))
        weights = (weights * d.routed_scaling_factor * self.global_scale.float()).to(x.dtype)
        out = self._routed(x, weights[:, : d.top_k].contiguous(), ids)
        shared = torch.zeros(x.shape[0], d.hidden_size, dtype=torch.float32, device=x.device)
        for s in range(self.num_shared):
            gate, up = dense.linear(x, self.shared_gate[s]), dense.linear(x, self.shared_up[s])
            inner = dense.pointwise(self.act, gate) * up * weights[:, d.top_k + s, None]
            shared += dense.linear(inner, self.shared_down[s]).float()
        return out + shared.to(x.dtype)

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        targets = super().weight_targets(prefix)
        targets[f"{prefix}gate.global_scale"] = whole(self.global_scale)
        for name, t in (("gate_proj", self.shared_gate), ("up_proj", self.shared_up), ("down_proj", self.shared_down)):
            targets[f"{prefix}shared_experts.{name}"] = whole(t)
        return targets

    def tp_checks(self) -> list[tuple[int, str]]:
        return [(self.dims.intermediate_size, "moe_intermediate_size")]

    def tp_shard(self, rank: int, world: int, comm: object) -> None:
        from workers.tp.shard_layers import _set, _take, part, shard_moe

        i = part(self.dims.intermediate_size, rank, world, "moe_intermediate_size")
        shard_moe(self, rank, world)
        _set(self, "shared_gate", _take(self.shared_gate, 1, [i]))
        _set(self, "shared_up", _take(self.shared_up, 1, [i]))
        _set(self, "shared_down", _take(self.shared_down, 2, [i]))

"""ZAYA's compressed convolutional attention (CCA): ``self_attn`` of ``ZayaForCausalLM``.

Per token x (``qkv_proj``): ``q = q_proj(x)`` [H, D], ``k = k_proj(x)`` [KV, D]; the residual
paths ``q_res = (q + k of its KV head) / 2`` and ``k_res`` = the mean of its group's ``q_res``;
``[q | k]`` goes through a depthwise causal conv of ``cca_time0`` taps, then a grouped causal
conv of ``cca_time1`` taps (one group per head, mixing the head's D channels), and the
result plus the residual paths are q and k. The value is ``[v_proj_current(x) |
v_proj_delayed(x of the previous token)]`` viewed as [KV, D] (the delayed half of a new
sequence is ``v_proj_delayed(0)``, its bias). Then (``ZayaAttention``) q and k are
L2-normalised to ``sqrt(D)`` (k times a learned ``qk_norm.temp`` per KV head), partial RoPE,
GQA over the paged KV (a sliding window on ``hybrid_sliding`` layers), ``o_proj``.

The state (``state_spec.cca_kind``, beside the layer's ``attention`` KV) is advanced by
``kernels.conv1d`` alone: the depthwise conv runs on ``[q | k]`` without its bias (window
``conv``); the grouped conv is ``sum_i W_i d(t - (T1-1) + i)``, computed as per-head products
``z_i = W_i d(t)`` and a chain of one-token shifts ``a_i = z_i + a_{i-1}(t - 1)`` (``mix{i}``
carries ``a_i`` of the previous token), the depthwise bias folded through ``W`` into the
output bias; the delayed value is a one-token shift of ``x W_delayed`` (``delayed_v``), its
bias added after. Zero states are the zero padding transformers starts a sequence with, so
chunked prefill, decode and snapshots need nothing of their own.

TP (``tp_shard``): q / k heads, their conv channels and groups, ``temp`` and ``o_proj``
(row) split by heads; the value projections are replicated (the current half of the value
is the first KV/2 heads, the delayed half the others, so no head split gives every rank the
same share) and each rank keeps the whole ``delayed_v`` and takes its heads' value channels.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from kernels import dense
from kernels.attention import paged_attention
from workers.models import layers
from workers.models.layers import CausalConv1d, LayerContext, apply_rotary, linear, param
from workers.state_spec import StateKind, StateRef, attention_kind, cca_kind


@dataclass(frozen=True)
class CcaDims:
    hidden_size: int
    num_heads: int  # this rank's query heads
    num_kv_heads: int  # this rank's KV heads
    head_dim: int
    depthwise_width: int  # cca_time0
    grouped_width: int  # cca_time1
    bias: bool  # attention_bias
    sliding_window: int | None = None
    kv_start: int = 0  # first KV head of this rank (TP)
    total_kv_heads: int = 0  # KV heads of the whole model (the value projections' width)

    @property
    def groups(self) -> int:
        return self.num_heads + self.num_kv_heads

    @property
    def qk_dim(self) -> int:
        return self.groups * self.head_dim

    @property
    def v_half(self) -> int:
        return self.total_kv_heads * self.head_dim // 2


def _shift_weight(dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[dim, 2] taps (oldest first) of a conv that outputs the previous token's input (two tiny
    ops per call, traced as such in a compiled step)."""
    w = torch.zeros(dim, 2, dtype=dtype, device=device)
    w[:, 0] = 1
    return w


class BiaslessConv(CausalConv1d):
    """The depthwise conv over [q | k], run without its bias (``_grouped_bias`` carries it)."""

    def forward(self, x: torch.Tensor, conv_state: torch.Tensor, batch) -> torch.Tensor:
        return layers.causal_conv1d(x, self.weight[:, 0, :], None, conv_state, batch.recurrent, activation=None)


class ShiftConv(CausalConv1d):
    """The previous token's input (zeros before a sequence): a conv of taps [1, 0], no weights."""

    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.bias, self.activation = None, None

    def forward(self, x: torch.Tensor, conv_state: torch.Tensor, batch) -> torch.Tensor:
        shift = _shift_weight(x.shape[1], x.dtype, x.device)
        return layers.causal_conv1d(x, shift, None, conv_state, batch.recurrent, activation=None)


class CcaProjection(nn.Module):
    """``qkv_proj``: x [T, hidden] -> q [T, H, D], k [T, KV, D], v [T, KV, D]; its state is the
    ``cca`` kind (see the module docstring)."""

    def __init__(self, dims: CcaDims, dtype: torch.dtype) -> None:
        super().__init__()
        d = dims
        self.dims = d
        self.q_proj = linear(d.hidden_size, d.num_heads * d.head_dim, d.bias, dtype)
        self.k_proj = linear(d.hidden_size, d.num_kv_heads * d.head_dim, d.bias, dtype)
        self.v_proj_current = linear(d.hidden_size, d.v_half, d.bias, dtype)
        self.v_proj_delayed = linear(d.hidden_size, d.v_half, d.bias, dtype)
        self.conv_qk_depthwise = BiaslessConv(d.qk_dim, d.depthwise_width, True, dtype, activation=None)
        self.conv_qk_grouped = nn.Module()
        self.conv_qk_grouped.weight = param(d.qk_dim, d.head_dim, d.grouped_width, dtype=dtype)
        self.conv_qk_grouped.bias = param(d.qk_dim, dtype=dtype)
        self.mix_shifts = nn.ModuleList(ShiftConv() for _ in range(d.grouped_width - 1))
        self.delayed_shift = ShiftConv()

    def state_kind(self) -> StateKind:
        d = self.dims
        return cca_kind(d.qk_dim, d.depthwise_width, d.grouped_width, d.v_half)

    def forward(self, x: torch.Tensor, ctx: LayerContext, ref: StateRef) -> tuple[torch.Tensor, ...]:
        d, n = self.dims, x.shape[0]
        state, batch = ctx.pools.mamba.layer(ref), ctx.batch
        q, k = self.q_proj(x), self.k_proj(x)
        rep = d.num_heads // d.num_kv_heads
        q_res = (q.view(n, d.num_kv_heads, rep, d.head_dim) + k.view(n, d.num_kv_heads, 1, d.head_dim)) * 0.5
        k_res = q_res.mean(dim=2)
        conv = self._conv(torch.cat([q, k], dim=-1), state, batch)
        split = d.num_heads * d.head_dim
        query = conv[:, :split].reshape(n, d.num_heads, d.head_dim) + q_res.reshape(n, d.num_heads, d.head_dim)
        key = conv[:, split:].reshape(n, d.num_kv_heads, d.head_dim) + k_res
        return query, key, self._value(x, state["delayed_v"], batch)

    def _conv(self, qk: torch.Tensor, state: dict[str, torch.Tensor], batch) -> torch.Tensor:
        """Both causal convs over [q | k] [T, C] (see the module docstring)."""
        d, n = self.dims, qk.shape[0]
        g, hd, width = d.groups, d.head_dim, d.grouped_width
        pre = self.conv_qk_depthwise(qk, state["conv"], batch)
        # W[g, o, c, i] -> per head rows (i, o) over columns c: z[t, g, i, o] = sum_c W d[t, g, c]
        w = self.conv_qk_grouped.weight.view(g, hd, hd, width).permute(0, 3, 1, 2).reshape(g, width * hd, hd)
        z = dense.head_products(pre.view(n, g, hd), w).view(n, g, width, hd)
        acc = z[:, :, 0].reshape(n, d.qk_dim)
        for i, shift in enumerate(self.mix_shifts):
            acc = z[:, :, i + 1].reshape(n, d.qk_dim) + shift(acc, state[f"mix{i}"], batch)
        return acc + self._grouped_bias()

    def _grouped_bias(self) -> torch.Tensor:
        """The grouped conv's bias plus the depthwise bias carried through its taps: [C]."""
        d = self.dims
        g, hd, width = d.groups, d.head_dim, d.grouped_width
        w = self.conv_qk_grouped.weight.view(g, hd, hd, width).sum(dim=-1)  # [g, o, c]
        carried = torch.einsum("goc,gc->go", w, self.conv_qk_depthwise.bias.view(g, hd))
        return self.conv_qk_grouped.bias + carried.reshape(-1)

    def _value(self, x: torch.Tensor, delayed_state: torch.Tensor, batch) -> torch.Tensor:
        d, n = self.dims, x.shape[0]
        delayed = self.delayed_shift(dense.linear(x, self.v_proj_delayed.weight), delayed_state, batch)
        if self.v_proj_delayed.bias is not None:
            delayed = delayed + self.v_proj_delayed.bias
        v = torch.cat([self.v_proj_current(x), delayed], dim=-1).view(n, d.total_kv_heads, d.head_dim)
        return v[:, d.kv_start : d.kv_start + d.num_kv_heads]


class ZayaQKNorm(nn.Module):
    """q and k L2-normalised to sqrt(D) per head; k then times ``temp`` [KV]."""

    def __init__(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.temp = param(num_kv_heads, dtype=dtype)
        self.scale = head_dim**0.5

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        eps = torch.finfo(q.dtype).eps
        q = q * (self.scale / q.norm(p=2, dim=-1, keepdim=True).clamp_min(eps))
        k = k * (self.scale / k.norm(p=2, dim=-1, keepdim=True).clamp_min(eps))
        return q, k * self.temp[None, :, None]


class ZayaAttention(nn.Module):
    """``self_attn``: the CCA projection (its ``cca`` state: ``cca_ref``), the q / k norm, RoPE
    (``ctx.rope``), paged GQA (its ``attention`` KV: the ``ref`` passed in) and ``o_proj``."""

    def __init__(self, dims: CcaDims, dtype: torch.dtype) -> None:
        super().__init__()
        if dims.num_heads % dims.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={dims.num_heads} is not a multiple of num_key_value_heads={dims.num_kv_heads}"
            )
        self.dims = dims
        self.qkv_proj = CcaProjection(dims, dtype)
        self.qk_norm = ZayaQKNorm(dims.num_kv_heads, dims.head_dim, dtype)
        self.o_proj = linear(dims.num_heads * dims.head_dim, dims.hidden_size, dims.bias, dtype)
        self.cca_ref: StateRef | None = None  # set by the layer that registers qkv_proj

    def state_kind(self) -> StateKind:
        return attention_kind(self.dims.num_kv_heads, self.dims.head_dim)

    def forward(self, x: torch.Tensor, ctx: LayerContext, ref: StateRef) -> torch.Tensor:
        assert self.cca_ref is not None
        d, batch = self.dims, ctx.batch
        q, k, v = self.qkv_proj(x, ctx, self.cca_ref)
        q, k = self.qk_norm(q, k)
        if ctx.rope is not None:
            q, k = apply_rotary(q, ctx.rope).to(q.dtype), apply_rotary(k, ctx.rope).to(k.dtype)
        kv = ctx.pools.kv.layer(ref)
        o = paged_attention(
            q.contiguous(),
            k.contiguous(),
            v.contiguous(),
            kv["k"],
            kv["v"],
            batch.out_loc,
            batch.page_table,
            batch.cu_seqlens,
            batch.seq_lens,
            batch.page_size,
            d.head_dim**-0.5,
            d.sliding_window,
        )
        return self.o_proj(o.reshape(x.shape[0], d.num_heads * d.head_dim))

    def tp_checks(self) -> list[tuple[int, str]]:
        return [(self.dims.num_heads, "num_attention_heads"), (self.dims.num_kv_heads, "num_key_value_heads")]

    def tp_shard(self, rank: int, world: int, comm: object) -> None:
        from workers.tp.shard_layers import _set, _take, column, part, row

        d, p = self.dims, self.qkv_proj
        heads = part(d.num_heads, rank, world, "attention heads (num_attention_heads)")
        kv = part(d.num_kv_heads, rank, world, "attention KV heads (num_key_value_heads)")
        column(p.q_proj, [heads.scaled(d.head_dim)])
        column(p.k_proj, [kv.scaled(d.head_dim)])
        channels = [heads.scaled(d.head_dim), kv.scaled(d.head_dim, d.num_heads * d.head_dim)]
        for conv in (p.conv_qk_depthwise, p.conv_qk_grouped):
            _set(conv, "weight", _take(conv.weight, 0, channels))
            _set(conv, "bias", _take(conv.bias, 0, channels))
        _set(self.qk_norm, "temp", _take(self.qk_norm.temp, 0, [kv]))
        row(self.o_proj, [heads.scaled(d.head_dim)], rank)
        self.dims = p.dims = replace(d, num_heads=heads.size, num_kv_heads=kv.size, kv_start=d.kv_start + kv.start)

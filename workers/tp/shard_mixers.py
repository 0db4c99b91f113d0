"""Sharding the mixers of Kimi-Linear, BailingHybrid, MiniMax and OLMo Hybrid's attention (see
``shard_layers`` for the conventions: contiguous head ranges, column / row parallel
projections, the caller's all-reduce after the layer).

- KDA: by heads (q/k/v, their conv channels, the forget and output gates' last projections,
  ``dt_bias``, ``A_log``, ``b_proj``; ``o_proj`` row); the low-rank first projections and the
  per-head output norm are replicated.
- MLA: by heads (``q_proj`` / ``q_b_proj``, ``kv_b_proj``, ``g_proj``; ``o_proj`` row); the
  latent path (``q_a``, ``kv_a_proj_with_mqa``, their norms) is replicated, so each rank's
  pool holds the whole latent of every token (as MLA under TP does). GLM-5.3-Flash's indexed
  MLA the same, its indexer replicated.
- Lightning attention: by heads (``qkv_proj`` per head [q|k|v], ``output_gate``, the slopes;
  ``out_proj`` row); its norm spans all heads, so it becomes a ``CrossRankRMSNorm``.
- OLMo's attention: as attention, with its whole-width q/k norms made ``CrossRankRMSNorm``s
  (OLMo's Gated DeltaNet is Qwen3.5's layer and shards as ``shard_gdn`` does).

``SHARDERS`` / ``CHECKS`` map each of these classes (exactly: some subclass a shared kind)
to its shard function and to the counts a split must divide (config names).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from workers.models.dsa import IndexedLatentAttention
from workers.models.kda import LOW_RANK_GATES, KimiDeltaAttention
from workers.models.lightning import LightningAttention
from workers.models.mla import LatentAttention
from workers.models.olmo_hybrid import OlmoAttention
from workers.tp.comm import Comm
from workers.tp.shard_layers import Part, _set, _take, column, part, row, shard_attention


class CrossRankRMSNorm(nn.Module):
    """RMSNorm over ``full_width`` channels of which this rank holds a slice (``weight``): the
    per-token sum of squares is all-reduced, then each rank scales its own channels (fp32)."""

    def __init__(self, weight: torch.Tensor, eps: float, full_width: int, comm: Comm) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps, self.full_width, self.comm = eps, full_width, comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = x.float()
        sums = self.comm.all_reduce(v.pow(2).sum(-1, keepdim=True).contiguous())
        return (v * torch.rsqrt(sums / self.full_width + self.eps) * self.weight.float()).to(x.dtype)


def split_norm(norm: nn.Module, channels: Part, comm: Comm) -> CrossRankRMSNorm:
    full = norm.weight.shape[0]
    return CrossRankRMSNorm(_take(norm.weight, 0, [channels]), norm.eps, full, comm)


def shard_kda(m: KimiDeltaAttention, rank: int, world: int, comm: Comm) -> None:
    d = m.dims
    h = part(d.num_heads, rank, world, "KDA heads (linear_num_heads)")
    per_head = [h.scaled(d.head_dim)]
    for proj in (m.q_proj, m.k_proj, m.v_proj):
        column(proj, per_head)
    _set(m.conv1d, "weight", _take(m.conv1d.weight, 0, [h.scaled(d.head_dim, i * d.qkv_dim) for i in range(3)]))
    low_rank = d.gate in LOW_RANK_GATES
    column(m.f_b_proj if low_rank else m.f_proj, per_head)
    column(m.g_b_proj if low_rank else m.g_proj, per_head)
    column(m.b_proj, [h])
    _set(m, "dt_bias", _take(m.dt_bias, 0, per_head))
    _set(m, "A_log", _take(m.A_log, 0, [h]))
    row(m.o_proj, per_head, rank)
    m.dims = replace(d, num_heads=h.size)


def shard_mla(m: LatentAttention, rank: int, world: int, comm: Comm) -> None:
    d = m.dims
    h = part(d.num_heads, rank, world, "MLA heads (num_attention_heads)")
    column(m.q_proj if d.q_lora_rank is None else m.q_b_proj, [h.scaled(d.qk_head_dim)])
    column(m.kv_b_proj, [h.scaled(d.qk_nope_head_dim + d.v_head_dim)])
    if d.head_gate:
        column(m.g_proj, [h])
    row(m.o_proj, [h.scaled(d.v_head_dim)], rank)
    m.dims = replace(d, num_heads=h.size)


def shard_lightning(m: LightningAttention, rank: int, world: int, comm: Comm) -> None:
    d = m.dims
    h = part(d.num_heads, rank, world, "lightning attention heads (num_attention_heads)")
    column(m.qkv_proj, [h.scaled(3 * d.head_dim)])
    column(m.output_gate, [h.scaled(d.head_dim)])
    row(m.out_proj, [h.scaled(d.head_dim)], rank)
    m.slope = m.slope[h.start : h.stop].contiguous()
    m.norm = split_norm(m.norm, Part(*h.scaled(d.head_dim)), comm)
    m.dims = replace(d, num_heads=h.size)


def shard_olmo_attention(m: OlmoAttention, rank: int, world: int, comm: Comm) -> None:
    d = m.dims
    heads = part(d.num_heads, rank, world, "attention heads (num_attention_heads)")
    kv = part(d.num_kv_heads, rank, world, "attention KV heads (num_key_value_heads)")
    shard_attention(m, rank, world)
    m.q_norm = split_norm(m.q_norm, Part(*heads.scaled(d.head_dim)), comm)
    m.k_norm = split_norm(m.k_norm, Part(*kv.scaled(d.head_dim)), comm)


Sharder = Callable[[Any, int, int, Comm], None]
SHARDERS: dict[type, Sharder] = {
    KimiDeltaAttention: shard_kda,
    LatentAttention: shard_mla,
    IndexedLatentAttention: shard_mla,  # its indexer stays whole: every rank selects alike
    LightningAttention: shard_lightning,
    OlmoAttention: shard_olmo_attention,
}
CHECKS: dict[type, Callable[[Any], list[tuple[int, str]]]] = {
    KimiDeltaAttention: lambda m: [(m.dims.num_heads, "linear_num_heads")],
    LatentAttention: lambda m: [(m.dims.num_heads, "num_attention_heads")],
    IndexedLatentAttention: lambda m: [(m.dims.num_heads, "num_attention_heads")],
    LightningAttention: lambda m: [(m.dims.num_heads, "num_attention_heads")],
    OlmoAttention: lambda m: [(m.dims.num_heads, "num_attention_heads"), (m.dims.num_kv_heads, "num_key_value_heads")],
}

"""Qwen4-Exp's layer pieces: the hyper-connection streams and the indexed (QSA) attention (the
per-layer n-gram embedding is ``qwen4_exp_ple.py``; the model ``qwen4_exp.py``).

- ``GatedResidual`` (``*_hyper_connection``, ``hyper_connection_mixer``): the residual is
  ``hc`` streams [T, hc * H]; a block reads ``mean_s(sigmoid(up(silu(down(n) / hc)))_s * n_s)``
  with ``n`` the per-stream zero-centred RMSNorm of the streams, and its output ``y`` is added
  to stream s times ``2 * sigmoid(inject(n) / hc)_s``. The final mixer has no ``inject``.
- ``IndexedAttention`` (``self_attn``): Qwen3.5's gated attention over the positions its
  ``QsaIndexer`` picks (``kernels.indexer``: blocks of C tokens, the best
  ``budget / C`` complete blocks per query plus its partial block); the indexer keeps its
  raw per-token keys in a paged ``indexer`` pool. The selection depends on the prefix only.

TP: the hyper-connections run on the replicated streams (weights whole on every rank); the
attention's heads split as any ``Attention``'s, the indexer runs whole on every rank (its
keys ``replicated``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels import dense
from kernels.attention import write_kv
from kernels.indexer import gather_block_rows, qwen4_block_keys, select_positions, sparse_attention
from kernels.static import scatter_rows_
from workers.models.layers import (
    Attention,
    AttentionDims,
    LayerContext,
    RMSNorm,
    RotaryEmbedding,
    apply_rotary,
    linear,
    param,
)
from workers.state_spec import StateKind, StateRef, indexer_kind


class GroupRMSNorm(nn.Module):
    """Zero-centred RMSNorm over each group of ``group`` channels of the last dim (fp32 math)."""

    def __init__(self, dim: int, group: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = param(dim, dtype=dtype)
        self.group, self.eps = group, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float().unflatten(-1, (-1, self.group))
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class GatedResidual(nn.Module):
    def __init__(self, hidden: int, streams: int, rank: int, eps: float, dtype: torch.dtype, inject: bool) -> None:
        super().__init__()
        self.hidden, self.streams = hidden, streams
        width = hidden * streams
        self.hc_norm = GroupRMSNorm(width, hidden, eps, dtype)
        self.input_mix_weight_down = linear(width, rank, False, dtype)
        self.input_mix_weight_up = linear(rank, width, False, dtype)
        self.block_inject_weight = linear(width, streams, False, dtype) if inject else None

    def mix(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """streams [T, hc * H] -> (the block's input [T, H], the normed streams)."""
        normed = self.hc_norm(streams)
        mix = dense.pointwise(F.silu, self.input_mix_weight_down(normed) / self.streams)
        mix = dense.pointwise(torch.sigmoid, self.input_mix_weight_up(mix))
        shape = (self.streams, self.hidden)
        return (mix.unflatten(-1, shape) * normed.unflatten(-1, shape)).mean(dim=-2), normed

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        return self.mix(streams)[0]

    def around(self, streams: torch.Tensor, block: nn.Module, *args: object) -> torch.Tensor:
        """``streams + inject * block(mixed input, *args)``, per stream."""
        assert self.block_inject_weight is not None
        x, normed = self.mix(streams)
        inject = 2.0 * dense.pointwise(torch.sigmoid, self.block_inject_weight(normed) / self.streams)
        y = block(x, *args)
        return streams + (y[:, None, :] * inject[:, :, None]).flatten(1)


@dataclass(frozen=True)
class IndexerDims:
    hidden_size: int
    num_heads: int  # indexer_n_heads (one key head)
    head_dim: int  # indexer_head_dim
    block_size: int  # indexer_compress_ratio
    top_blocks: int  # indexer_budget // indexer_compress_ratio
    eps: float


class QsaIndexer(nn.Module):
    """``self_attn.indexer``: picks each query's positions; keeps the raw per-token keys
    (``index_qk_proj``'s key half, before ``k_layernorm``) in the paged ``indexer`` pool."""

    def __init__(self, d: IndexerDims, rotary: RotaryEmbedding, dtype: torch.dtype) -> None:
        super().__init__()
        self.dims, self.rotary = d, rotary
        self.index_qk_proj = linear(d.hidden_size, (d.num_heads + 1) * d.head_dim, False, dtype)
        self.q_layernorm = RMSNorm(d.head_dim, d.eps, dtype, zero_centered=True)
        self.k_layernorm = RMSNorm(d.head_dim, d.eps, dtype, zero_centered=True)

    def state_kind(self) -> StateKind:
        return indexer_kind(self.dims.head_dim)

    def forward(self, x: torch.Tensor, ctx: LayerContext, ref: StateRef) -> torch.Tensor:
        """x [T, hidden] -> positions int32 [T, W] (``kernels.indexer.select_positions``)."""
        d, batch = self.dims, ctx.batch
        assert ctx.rope is not None, "the indexer ropes its queries and block keys"
        q, keys = self.index_qk_proj(x).split([d.num_heads * d.head_dim, d.head_dim], dim=-1)
        q = apply_rotary(self.q_layernorm(q.view(-1, d.num_heads, d.head_dim)), ctx.rope).to(x.dtype)
        pool = ctx.pools.kv.layer(ref)["keys"]  # [L_total, 1, D]
        scatter_rows_(pool, batch.out_loc, keys[:, None, :].to(pool.dtype))
        rows = gather_block_rows(pool[:, 0], batch.page_table, batch.page_size, d.block_size)  # [B, N, C, D]
        starts = torch.arange(rows.shape[1], device=x.device) * d.block_size
        cos, sin = self.rotary.tables(starts, rows.dtype)
        block_keys = qwen4_block_keys(rows, self.k_layernorm.weight, d.eps, cos, sin)
        return select_positions(
            q.contiguous(),
            None,
            block_keys,
            batch.cu_seqlens,
            batch.seq_lens,
            d.block_size,
            d.top_blocks,
            post_scale=d.head_dim**-0.5,
        )


class IndexedAttention(Attention):
    """Qwen3.5's gated attention over the positions its ``indexer`` selects."""

    def __init__(self, dims: AttentionDims, indexer: QsaIndexer, dtype: torch.dtype) -> None:
        super().__init__(dims, dtype)
        self.indexer = indexer
        self.indexer_ref: StateRef | None = None  # set when the model registers the indexer

    def forward(self, x: torch.Tensor, ctx: LayerContext, ref: StateRef, adapter: int | None = None) -> torch.Tensor:
        assert self.indexer_ref is not None
        batch = ctx.batch
        positions = self.indexer(x, ctx, self.indexer_ref)
        q, k, v, gate = self.heads(self.q_proj(x), self.k_proj(x), self.v_proj(x), ctx, None)
        kv = ctx.pools.kv.layer(ref)
        write_kv(k.contiguous(), v.contiguous(), kv["k"], kv["v"], batch.out_loc)
        o = sparse_attention(
            q.contiguous(),
            kv["k"],
            kv["v"],
            positions,
            batch.page_table,
            batch.cu_seqlens,
            batch.seq_lens,
            batch.page_size,
            self.dims.scale,
        )
        return self.output(o, gate)

"""GLM-5.3-Flash's ``indexed_attention``: MLA (``workers/models/mla.py``, no positions) over the
positions a DSA k-pool indexer selects (``kernels.indexer``).

The indexer (checkpoint ``self_attn.indexer.*``) of a ``full`` layer, per token x (the layer's
normed input) and ``q_resid = q_a_layernorm(q_a_proj(x))`` (MLA's own):

- query ``wq_b(q_resid)`` [H_i, D] (``index_n_heads``, ``index_head_dim``), no positions;
- per-token row ``[k | gate]`` [2 D] into the paged ``indexer`` pool: ``k =
  LayerNorm(wk(x))`` (weight and bias, eps 1e-6), ``gate = index_kpool_compress_gate @ x``;
- block keys over blocks of C = ``index_kpool`` positions: ``sum_c softmax_c(gate +
  index_kpool_compress_ape)[c] k[c]`` (``glm5_block_keys``);
- score of a block ``sum_h w_h relu(q_h . K / sqrt(D))`` with ``w = weights_proj(x) /
  sqrt(H_i)``; the ``index_topk // C`` best complete blocks plus, with
  ``index_kpool_always_select_tail``, the partial block up to the query.

A ``shared`` layer (``indexer_types``) has no indexer and attends to the positions the
``full`` layer just before it selected (transformers passes them from layer to layer). The
attention is MLA's absorbed form over the selected latent rows (the latent pool as keys, its
first R channels as values), softmax scale ``qk_head_dim^-1/2``.

TP (``workers/tp/shard_mixers.py``): the MLA heads as Kimi-Linear's; the indexer is replicated,
so every rank selects the same positions (its pool rows are ``replicated``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels.indexer import gather_block_rows, glm5_block_keys, select_positions, sparse_attention
from kernels.mla import write_latent
from workers.models.layers import LayerContext, linear, param
from workers.models.mla import LatentAttention, MlaDims
from workers.state_spec import StateKind, StateRef, indexer_kind

INDEXER_NORM_EPS = 1e-6  # transformers builds k_norm without the config's eps


@dataclass(frozen=True)
class IndexerDims:
    hidden_size: int
    q_lora_rank: int
    num_heads: int  # index_n_heads
    head_dim: int  # index_head_dim (D)
    block_size: int  # index_kpool (C)
    top_blocks: int  # index_topk // index_kpool
    tail: bool  # index_kpool_always_select_tail


class KPoolIndexer(nn.Module):
    def __init__(self, dims: IndexerDims, dtype: torch.dtype) -> None:
        super().__init__()
        self.dims = dims
        d, h = dims.head_dim, dims.hidden_size
        self.wq_b = linear(dims.q_lora_rank, dims.num_heads * d, False, dtype)
        self.wk = linear(h, d, False, dtype)
        self.k_norm = nn.LayerNorm(d, eps=INDEXER_NORM_EPS, dtype=dtype)
        self.weights_proj = linear(h, dims.num_heads, False, dtype)
        self.index_kpool_compress_ape = param(dims.block_size, d, dtype=dtype)
        self.index_kpool_compress_gate = param(d, h, dtype=dtype)

    def state_kind(self) -> StateKind:
        return indexer_kind(2 * self.dims.head_dim)

    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, ctx: LayerContext, ref: StateRef) -> torch.Tensor:
        """-> the selected positions int32 [T, W] (``kernels.indexer.select_positions``)."""
        d, batch = self.dims, ctx.batch
        q = self.wq_b(q_resid).view(x.shape[0], d.num_heads, d.head_dim)
        rows = torch.cat([self.k_norm(self.wk(x)), F.linear(x, self.index_kpool_compress_gate)], dim=-1)
        pool = ctx.pools.kv.layer(ref)["keys"]  # [L_total, 1, 2 D]
        write_latent(rows, pool, batch.out_loc)
        blocks = gather_block_rows(pool[:, 0], batch.page_table, batch.page_size, d.block_size)
        keys = glm5_block_keys(blocks, self.index_kpool_compress_ape)  # [B, N, D]
        weights = self.weights_proj(x).float() * d.num_heads**-0.5
        return select_positions(
            q,
            weights,
            keys,
            batch.cu_seqlens,
            batch.seq_lens,
            d.block_size,
            d.top_blocks,
            pre_scale=d.head_dim**-0.5,
            tail=d.tail,
        )


class IndexedLatentAttention(LatentAttention):
    """MLA over the indexer's positions; ``indexer`` is None on a ``shared`` layer."""

    def __init__(self, dims: MlaDims, indexer: IndexerDims | None, dtype: torch.dtype) -> None:
        super().__init__(dims, dtype)
        self.indexer = None if indexer is None else KPoolIndexer(indexer, dtype)

    def forward(
        self, x: torch.Tensor, ctx: LayerContext, ref: StateRef, positions: torch.Tensor, q_resid: torch.Tensor
    ) -> torch.Tensor:
        batch = ctx.batch
        query, latent = self.absorbed(x, ctx, q_resid)
        pool = ctx.pools.kv.layer(ref)["latent"]
        write_latent(latent, pool, batch.out_loc)
        o = sparse_attention(
            query,
            pool,
            pool[..., : self.dims.kv_lora_rank],
            positions,
            batch.page_table,
            batch.cu_seqlens,
            batch.seq_lens,
            batch.page_size,
            self.dims.scale,
        )
        return self.project_out(o, x)

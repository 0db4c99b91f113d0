"""Indexed (block-sparse) attention: Qwen4-Exp's QSA and GLM-5.3-Flash's DSA k-pool indexer.

A lightweight indexer picks, for every query, a few blocks of the cached context; attention
then runs over the picked positions only. Both models group positions into blocks of C
consecutive positions (block j = positions ``j*C .. j*C + C - 1``; Qwen4 ``indexer_compress_ratio``,
GLM ``index_kpool``) and, for the query at absolute position p:

1. candidates: the complete blocks it sees, j < n = (p + 1) // C (the block's last position <= p);
2. score of block j: ``post_scale * sum_h w[h] * relu(pre_scale * q_h . K_j)`` over the
   indexer heads, with q the row's indexer query [H, D] and K_j the block key (``pooling``);
   Qwen4: pre 1, no weights, post 1/sqrt(D); GLM: pre 1/sqrt(D), w = weights_proj(x) / sqrt(H);
3. keep the ``min(top_blocks, n)`` best blocks (Qwen4 ``budget // C``, GLM ``index_topk // C``),
   ties to the lower block index (transformers' ``topk`` leaves ties unspecified);
4. positions: the kept blocks' positions plus, with ``tail`` (Qwen4 always, GLM
   ``index_kpool_always_select_tail``), the partial block ``n*C .. p``; int32 [T, W] with
   W = top_blocks*C (+ C - 1 with tail), ascending, padded with -1;
5. attention: softmax over the selected positions of the paged KV pool (GQA as
   ``kernels.attention``; MLA passes its latent pool as k_pool and a channel view of it as
   v_pool). A row that selects nothing (only without tail) gets zeros.

The selection of a row is a function of the prefix only (its query, its position, the blocks
before it): the same prompt in any chunk split, or after a prefix-cache hit, selects the same
positions, which keeps prefix-cache hits exact. Batch layout as ``kernels.attention``: packed
rows with ``cu_seqlens`` [B + 1], ``seq_lens`` [B] context lengths after the step (query i of
sequence b sits at ``seq_lens[b] - q_len_b + i``), ``page_table`` [B, max_pages].

Block keys are recomputed each step from the per-token pool (``gather_block_rows`` reads every
block the page table addresses, O(context) per sequence and layer); caching a block's key when
it completes is left for later. The Triton selection keeps a [T, N] fp32 score scratch.

Files: ``pooling`` (block keys from the per-token paged indexer pool, per model, torch),
``reference`` (selection and sparse attention in torch: the CPU path and the oracle),
``triton_select`` (scoring + top-k: radix threshold search, no host sync) and ``triton_sparse``
(the sparse attention). Both Triton entries are ``graph_ops`` custom ops while dynamo traces.
"""

from __future__ import annotations

from torch import Tensor

from kernels import backend, graph_ops
from kernels.indexer.pooling import gather_block_rows, glm5_block_keys, qwen4_block_keys
from kernels.indexer.reference import out_width, select_positions_torch, sparse_attention_torch

__all__ = [
    "gather_block_rows",
    "glm5_block_keys",
    "out_width",
    "qwen4_block_keys",
    "select_positions",
    "sparse_attention",
]


def select_positions(
    q: Tensor,
    weights: Tensor | None,
    block_keys: Tensor,
    cu_seqlens: Tensor,
    seq_lens: Tensor,
    block_size: int,
    top_blocks: int,
    pre_scale: float = 1.0,
    post_scale: float = 1.0,
    tail: bool = True,
) -> Tensor:
    """q [T, H, D] indexer queries (normed, roped by the model); weights [T, H] or None (all 1);
    block_keys [B, N, D] (N >= seq_lens[b] // C for every b, ``gather_block_rows``' N);
    cu_seqlens int32 [B + 1]; seq_lens int32 [B] -> int32 [T, out_width(C, top_blocks, tail)]."""
    args = (q, weights, block_keys, cu_seqlens, seq_lens, block_size, top_blocks, pre_scale, post_scale, tail)
    if backend.attention_impl(q) is backend.AttentionImpl.TORCH:
        return select_positions_torch(*args)
    return graph_ops.indexer_select(*args)


def sparse_attention(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    positions: Tensor,
    page_table: Tensor,
    cu_seqlens: Tensor,
    seq_lens: Tensor,
    page_size: int,
    scale: float,
) -> Tensor:
    """q [T, Hq, D]; k_pool [L_total, Hkv, D]; v_pool [L_total, Hkv, Dv] (pools already hold the
    new tokens; any row/head strides); positions int32 [T, W] (``select_positions``) -> [T, Hq, Dv]."""
    args = (q, k_pool, v_pool, positions, page_table, cu_seqlens, seq_lens, page_size, scale)
    if backend.attention_impl(q) is backend.AttentionImpl.TORCH:
        return sparse_attention_torch(*args)
    return graph_ops.indexer_sparse(*args)

"""Multi-head latent attention (MLA: Kimi-Linear, BailingHybrid) over a paged latent pool.

The pool keeps, per token, what MLA caches: the normed latent c [R] (``kv_lora_rank``) and
the shared rope key k_r [P] (``qk_rope_head_dim``), one row [1, R + P] per location
(``page * page_size + offset``; page 0 a dummy), so a token costs R + P values per layer,
not H x (D_k + D_v). The model absorbs ``kv_b_proj`` into the query and the output
(``workers/models/mla.py``): with W_uk, W_uv the key and value halves of head h,

    q_h . k_h,j = (W_uk^T q_nope_h) . c_j + q_rope_h . k_r,j,    o_h = W_uv (sum_j p_hj c_j),

so the op is a one-KV-head attention whose key is the whole row [c | k_r] and whose value is
its first R channels: q [T, H, R + P] -> o [T, H, R] (the latent output, before W_uv).

Causal rule and batch layout as ``kernels.attention`` (query i of sequence b sits at position
``seq_lens[b] - q_len_b + i`` and sees context positions 0 .. that position). Files:
``reference`` (torch SDPA over the gathered rows: the CPU path and the oracle) and
``triton_paged`` (one kernel for prefill, verify and decode; no host sync).
"""

from __future__ import annotations

from torch import Tensor

from kernels import backend, graph_ops
from kernels.mla.reference import mla_attention_torch, write_latent

__all__ = ["mla_attention", "write_latent"]


def mla_attention(
    q: Tensor,
    latent: Tensor,
    pool: Tensor,
    out_loc: Tensor,
    page_table: Tensor,
    cu_seqlens: Tensor,
    seq_lens: Tensor,
    page_size: int,
    scale: float,
    latent_dim: int,
) -> Tensor:
    """q [T, H, R + P]; latent [T, R + P] (the new tokens' [c | k_r]); pool [L_total, 1, R + P];
    out_loc int64 [T]; page_table int32 [B, max_pages]; cu_seqlens int32 [B + 1]; seq_lens
    int32 [B]; ``latent_dim`` = R -> o [T, H, R].

    Writes ``latent`` into the pool at ``out_loc`` first, then attends.
    """
    if backend.attention_impl(q) is not backend.AttentionImpl.TORCH:  # no FlashInfer MLA
        return graph_ops.mla_attention(
            q, latent, pool, out_loc, page_table, cu_seqlens, seq_lens, page_size, scale, latent_dim
        )
    return mla_attention_torch(q, latent, pool, out_loc, page_table, cu_seqlens, seq_lens, page_size, scale, latent_dim)

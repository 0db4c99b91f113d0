"""Causal attention over the paged KV pool.

Pool layout (``workers/device_pools.py``): ``k_pool`` / ``v_pool`` [L_total, Hkv, D] with
flat location ``page * page_size + offset``. Context position ``pos`` of sequence b lives at
``page_table[b, pos // page_size] * page_size + pos % page_size``.

Sequence b brings ``q_len = cu[b+1] - cu[b]`` new tokens (0 is allowed: it owns no query
rows) and has ``seq_lens[b]`` context tokens after this step, so its query i sits at absolute
position ``seq_lens[b] - q_len + i`` and attends to context positions ``0 ..`` that position
(the new tokens included); a sliding ``window`` W keeps only the last W of them, positions
``p - W + 1 .. p`` for the query at p (Lfm3's ``sliding_attention`` layers). The pool keeps
every token's KV either way: a windowed layer's old pages are simply not read.

Files: ``reference`` (torch SDPA over gathered pages: the CPU path and the oracle),
``triton_paged`` (one Triton kernel for prefill, verify and decode: any head dim, fp32 and
bf16, no host sync) and ``flashinfer_backend`` (FlashInfer's paged prefill/decode wrappers
over the same pool, viewed as NHD pages; imported only on CUDA, for the head dims it is built
for, and never with a window). ``kernels.backend.attention_impl`` picks one.
"""

from __future__ import annotations

from torch import Tensor

from kernels import backend, graph_ops
from kernels.attention.reference import check_window, paged_attention_torch, write_kv

__all__ = ["paged_attention", "write_kv"]


def paged_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    out_loc: Tensor,
    page_table: Tensor,
    cu_seqlens: Tensor,
    seq_lens: Tensor,
    page_size: int,
    scale: float,
    window: int | None = None,
) -> Tensor:
    """q [T, Hq, D]; k, v [T, Hkv, D]; pools [L_total, Hkv, D]; out_loc int64 [T];
    page_table int32 [B, max_pages]; cu_seqlens int32 [B+1]; seq_lens int32 [B] -> [T, Hq, D].

    Writes k, v into the pools at ``out_loc`` first, then attends (GQA: Hkv divides Hq), to
    the last ``window`` context positions of each query when ``window`` is given (>= 1).
    """
    check_window(window)
    impl = backend.attention_impl(q, windowed=window is not None)
    if impl is backend.AttentionImpl.FLASHINFER:
        from kernels.attention.flashinfer_backend import paged_attention_flashinfer

        return paged_attention_flashinfer(
            q, k, v, k_pool, v_pool, out_loc, page_table, cu_seqlens, seq_lens, page_size, scale
        )
    if impl is backend.AttentionImpl.TRITON:
        return graph_ops.paged_attention(
            q, k, v, k_pool, v_pool, out_loc, page_table, cu_seqlens, seq_lens, page_size, scale, window
        )
    return paged_attention_torch(
        q, k, v, k_pool, v_pool, out_loc, page_table, cu_seqlens, seq_lens, page_size, scale, window
    )

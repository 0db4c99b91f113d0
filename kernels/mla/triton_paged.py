"""MLA over the paged latent pool in Triton: prefill, chunked prefill, verify and decode.

Contract of ``kernels.mla.mla_attention``. The layout of ``kernels.attention.triton_paged``
with one KV head whose G = H query heads share every key: a program owns BQ query tokens
times the H heads (padded to GP), BM = BQ * GP rows, and walks its sequence's pool rows in
blocks of BN, gathered through the page table. A row is [c (R) | k_r (P)]: the scores are
``q_c . c + q_r . k_r`` (two dots) and the value is the c tile already loaded for the
scores, so each latent is read once per block for keys and values together. Online softmax
in fp32 (exp2, scale folded into ``scale_log2``), fp32 accumulation; under the CPU
interpreter every operand is widened to fp32 first (its bf16 ``tl.dot`` is wrong, triton
3.9). No host sync: the grid comes from shapes and each program finds its sequence by a
binary search over ``cu_seqlens`` (``find_tile_seq``).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.attention.triton_paged import find_tile_seq
from kernels.backend import interpreting
from kernels.chunking import next_pow2
from kernels.launch_grid import attention_grid
from kernels.mla.reference import check_shapes, write_latent
from kernels.triton_state import dot

LOG2E = 1.0 / math.log(2.0)


@triton.jit
def mla_paged_kernel(
    q, pool, o,                             # q [T, H, R + P]; pool [L, 1, R + P]; o [T, H, R]
    page_table, cu_seqlens, seq_lens,       # int32 [B, stride_pt] / [B + 1] / [B]
    num_seqs, stride_pt, page_size, scale_log2,
    H: tl.constexpr, R: tl.constexpr, P: tl.constexpr,
    BQ: tl.constexpr, GP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    BR: tl.constexpr, BP: tl.constexpr, F32_DOTS: tl.constexpr,
):
    i_tile = tl.program_id(0)
    seq = find_tile_seq(cu_seqlens, num_seqs, i_tile, BQ)
    bos = tl.load(cu_seqlens + seq)
    q_len = tl.load(cu_seqlens + seq + 1) - bos
    q0 = (i_tile - bos // BQ - seq) * BQ            # the tile's first query, in the sequence
    if q0 < q_len:
        prefix = tl.load(seq_lens + seq) - q_len     # cached context before the new tokens
        o_m = tl.arange(0, BM)
        tok = q0 + o_m // GP                         # [BM] query index in the sequence
        m_row = (tok < q_len) & (o_m % GP < H)
        rows = (bos + tok).to(tl.int64) * H + o_m % GP                 # rows of [T * H, .]
        o_r = tl.arange(0, BR)
        o_p = tl.arange(0, BP)
        m_r = o_r < R
        m_p = o_p < P
        b_qc = tl.load(q + rows[:, None] * (R + P) + o_r[None, :],
                       mask=m_row[:, None] & m_r[None, :], other=0.0)
        b_qr = tl.load(q + rows[:, None] * (R + P) + R + o_p[None, :],
                       mask=m_row[:, None] & m_p[None, :], other=0.0)
        if F32_DOTS:
            b_qc = b_qc.to(tl.float32)
            b_qr = b_qr.to(tl.float32)
        q_pos = prefix + tok                         # [BM] absolute positions
        kv_end = prefix + tl.minimum(q0 + BQ, q_len)
        m_i = tl.full([BM], -1.0e30, dtype=tl.float32)   # finite: no inf - inf below
        l_i = tl.zeros([BM], dtype=tl.float32)
        acc = tl.zeros([BM, BR], dtype=tl.float32)
        table_row = page_table + seq.to(tl.int64) * stride_pt
        for n0 in range(0, kv_end, BN):
            pos = n0 + tl.arange(0, BN)
            m_pos = pos < kv_end
            page = tl.load(table_row + pos // page_size, mask=m_pos, other=0).to(tl.int64)
            base = (page * page_size + pos % page_size) * (R + P)      # [BN]
            b_c = tl.load(pool + base[:, None] + o_r[None, :], mask=m_pos[:, None] & m_r[None, :],
                          other=0.0).to(b_qc.dtype)
            b_kr = tl.load(pool + base[:, None] + R + o_p[None, :],
                           mask=m_pos[:, None] & m_p[None, :], other=0.0).to(b_qr.dtype)
            b_s = dot(b_qc, tl.trans(b_c), F32_DOTS) + dot(b_qr, tl.trans(b_kr), F32_DOTS)
            visible = m_pos[None, :] & (pos[None, :] <= q_pos[:, None])
            b_s = tl.where(visible, b_s * scale_log2, float("-inf"))   # [BM, BN], log2 units
            m_new = tl.maximum(m_i, tl.max(b_s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            b_p = tl.exp2(b_s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(b_p, axis=1)
            acc = acc * alpha[:, None] + dot(b_p.to(b_c.dtype), b_c, F32_DOTS)
            m_i = m_new
        acc = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(o + rows[:, None] * R + o_r[None, :], acc.to(o.dtype.element_ty),
                 mask=m_row[:, None] & m_r[None, :])


def mla_attention_triton(q: Tensor, latent: Tensor, pool: Tensor, out_loc: Tensor,
                         page_table: Tensor, cu_seqlens: Tensor, seq_lens: Tensor,
                         page_size: int, scale: float, latent_dim: int) -> Tensor:
    """Contract of ``kernels.mla.mla_attention``, run by the Triton kernel."""
    check_shapes(q, latent, pool, latent_dim)
    if not pool.is_contiguous():
        raise ValueError("the latent pool must be a contiguous [L_total, 1, R + P] tensor")
    write_latent(latent, pool, out_loc)
    num_tokens, num_heads, width = q.shape
    num_seqs = seq_lens.shape[0]
    out = torch.empty(num_tokens, num_heads, latent_dim, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    group_pad = next_pow2(num_heads)
    block_r = max(16, next_pow2(latent_dim))
    rows = 16 if num_tokens <= 2 * num_seqs else 32          # decode-like batches: 16 rows
    block_q = max(1, rows // group_pad)
    grid = attention_grid("mla_paged_attention", num_tokens, num_seqs, block_q, 1)
    i32 = dict(device=q.device, dtype=torch.int32)
    table = page_table.to(**i32)
    if table.stride(1) != 1:
        table = table.contiguous()
    mla_paged_kernel[grid](
        q.contiguous(), pool, out, table, cu_seqlens.to(**i32), seq_lens.to(**i32), num_seqs,
        table.stride(0), page_size, float(scale) * LOG2E, H=num_heads, R=latent_dim,
        P=width - latent_dim, BQ=block_q, GP=group_pad, BM=block_q * group_pad,
        BN=64 if block_r <= 64 else 32, BR=block_r, BP=max(16, next_pow2(width - latent_dim)),
        F32_DOTS=q.dtype == torch.float32 or interpreting(), num_warps=4 if block_r <= 128 else 8)
    return out

"""Sparse attention over selected positions of the paged KV pool in Triton: contract of
``kernels.indexer.sparse_attention``.

A program owns one query row and one KV head (grid: ``attention_grid`` with one-row tiles,
the row's sequence found by ``find_tile_seq``, no host sync), the G query heads of that KV
head padded to BG rows of one tile. It walks the row's selected positions in tiles of BN:
each position goes through the page table to a pool row (any row / head stride, so MLA can
pass its latent pool and a channel view of it), ``-1`` entries are masked. Online softmax in
fp32 (exp2, scale folded into ``scale_log2``), fp32 accumulation; a row with no selected
position writes zeros. Under the CPU interpreter operands are widened to fp32.
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
from kernels.triton_state import dot

LOG2E = 1.0 / math.log(2.0)


@triton.jit
def sparse_kernel(
    q, k_pool, v_pool, o, positions,        # q [T, H, D]; pools [L, Hkv, D / DV]; o [T, H, DV]; positions [T, W]
    page_table, cu_seqlens,                 # int32 [B, stride_pt] / [B + 1]
    num_seqs, stride_pt, page_size, width, scale_log2,
    stride_kl, stride_kh, stride_vl, stride_vh,
    H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    BG: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, F32_DOTS: tl.constexpr,
):
    i_tile = tl.program_id(0)
    i_kv = tl.program_id(1)
    seq = find_tile_seq(cu_seqlens, num_seqs, i_tile, 1)
    bos = tl.load(cu_seqlens + seq)
    i = i_tile - bos - seq
    if i < tl.load(cu_seqlens + seq + 1) - bos:
        row = (bos + i).to(tl.int64)
        o_g = tl.arange(0, BG)
        o_d = tl.arange(0, BD)
        o_v = tl.arange(0, BDV)
        m_g = o_g < G
        m_d = o_d < D
        m_v = o_v < DV
        heads = row * H + i_kv * G + o_g
        b_q = tl.load(q + heads[:, None] * D + o_d[None, :], mask=m_g[:, None] & m_d[None, :], other=0.0)
        if F32_DOTS:
            b_q = b_q.to(tl.float32)
        table_row = page_table + seq.to(tl.int64) * stride_pt
        m_i = tl.full([BG], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BG], dtype=tl.float32)
        acc = tl.zeros([BG, BDV], dtype=tl.float32)
        for n0 in range(0, width, BN):
            o_n = n0 + tl.arange(0, BN)
            pos = tl.load(positions + row * width + o_n, mask=o_n < width, other=-1)
            m_n = pos >= 0
            pos = tl.where(m_n, pos, 0)
            page = tl.load(table_row + pos // page_size, mask=m_n, other=0).to(tl.int64)
            loc = page * page_size + pos % page_size
            b_k = tl.load(k_pool + loc[:, None] * stride_kl + i_kv * stride_kh + o_d[None, :],
                          mask=m_n[:, None] & m_d[None, :], other=0.0).to(b_q.dtype)
            b_v = tl.load(v_pool + loc[:, None] * stride_vl + i_kv * stride_vh + o_v[None, :],
                          mask=m_n[:, None] & m_v[None, :], other=0.0).to(b_q.dtype)
            b_s = tl.where(m_n[None, :], dot(b_q, tl.trans(b_k), F32_DOTS) * scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(b_s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            b_p = tl.exp2(b_s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(b_p, axis=1)
            acc = acc * alpha[:, None] + dot(b_p.to(b_v.dtype), b_v, F32_DOTS)
            m_i = m_new
        acc = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(o + heads[:, None] * DV + o_v[None, :], acc.to(o.dtype.element_ty),
                 mask=m_g[:, None] & m_v[None, :])


def sparse_attention_triton(
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
    """Contract of ``kernels.indexer.sparse_attention``, run by the Triton kernel."""
    num_rows, num_heads, head_dim = q.shape
    kv_heads, value_dim = k_pool.shape[1], v_pool.shape[-1]
    if num_heads % kv_heads != 0 or head_dim != k_pool.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} and k_pool {tuple(k_pool.shape)} disagree (GQA, head dim)")
    if k_pool.stride(-1) != 1 or v_pool.stride(-1) != 1:
        raise ValueError("the pools' last dim must be contiguous")
    num_seqs = seq_lens.shape[0]
    out = torch.zeros(num_rows, num_heads, value_dim, dtype=q.dtype, device=q.device)
    if num_rows == 0 or num_seqs == 0 or positions.shape[1] == 0:
        return out
    group = num_heads // kv_heads
    i32 = dict(device=q.device, dtype=torch.int32)
    table = page_table.to(**i32)
    if table.stride(1) != 1:
        table = table.contiguous()
    grid = attention_grid("indexer_sparse_attention", num_rows, num_seqs, 1, kv_heads)
    sparse_kernel[grid](
        q.contiguous(), k_pool, v_pool, out, positions.to(**i32).contiguous(), table, cu_seqlens.to(**i32),
        num_seqs, table.stride(0), page_size, positions.shape[1], float(scale) * LOG2E,
        k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        H=num_heads, G=group, D=head_dim, DV=value_dim, BG=max(16, next_pow2(group)), BN=32,
        BD=max(16, next_pow2(head_dim)), BDV=max(16, next_pow2(value_dim)),
        F32_DOTS=q.dtype == torch.float32 or interpreting())
    return out

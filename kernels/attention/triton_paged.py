"""Paged attention in Triton: prefill, chunked prefill, verify and decode in one kernel.

Contract of ``kernels.attention.paged_attention`` (pool layout and causal rule in the package
docstring): query i of sequence b sits at position ``seq_lens[b] - q_len_b + i`` and attends
to context positions 0 .. that position, read from the pool through ``page_table``.

A program owns one tile of one sequence's queries and one KV head: BQ query tokens times the
G = Hq / Hkv query heads sharing that KV head (padded to GP, a power of two), laid out as the
BM = BQ * GP rows of one matrix (row r: token r // GP, group head r % GP). So a decode reads
each key block once for the whole group (GQA), and ``tl.dot`` gets its 16 rows from the group
even for one token. The program walks its sequence's keys in blocks of BN, gathering each
block's rows from the pool through the page table (any page size), with an online softmax in
fp32 (exp2, the scale folded into ``scale_log2``) and fp32 accumulation. bf16 / fp16 operands
go into ``tl.dot`` as they are; fp32 ones in IEEE precision (no tf32), so fp32 results match
the torch reference to rounding. Under the CPU interpreter bf16 operands are widened to fp32
first (``F32_DOTS``): its bf16 ``tl.dot`` returns garbage (triton 3.9).

No host sync, so a decode step can be captured in a CUDA graph: the grid comes from shapes
(``kernels.launch_grid.attention_grid``) and each program finds its sequence by a binary
search over ``cu_seqlens`` (sequence b's tiles start at ``cu_seqlens[b] // BQ + b``);
programs past a sequence's queries (and those of sequences with no new tokens) do nothing.
The price: ``seq_lens[b] >= q_len_b`` is not checked here (the torch path checks it).

Head dims that are not powers of two are padded to one and masked (D = 80 runs as 128
columns). A sliding ``window`` W (``HAS_WINDOW``) masks keys at or before ``q_pos - W`` and
starts the key walk at the first position the tile's earliest query still sees, so a
windowed layer reads O(W) keys per query however long the context. No logit softcap.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.attention.reference import check_heads, check_window, write_kv
from kernels.backend import interpreting
from kernels.chunking import next_pow2
from kernels.launch_grid import attention_grid
from kernels.triton_state import dot

LOG2E = 1.0 / math.log(2.0)
DECODE_ROWS = 16            # tl.dot's smallest M
PREFILL_ROWS = 64


@triton.jit
def find_tile_seq(cu_seqlens, num_seqs, i_tile, BQ: tl.constexpr):
    """The sequence owning query tile ``i_tile``: the last b with cu[b] // BQ + b <= i_tile
    (those starts strictly increase with b, so the search is exact)."""
    lo = i_tile * 0
    hi = lo + num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        fits = tl.load(cu_seqlens + mid) // BQ + mid <= i_tile
        lo = tl.where(fits, mid, lo)
        hi = tl.where(fits, hi, mid - 1)
    return lo


@triton.jit
def first_visible_key(first_q_pos, window, HAS_WINDOW: tl.constexpr):
    """The first key position a tile whose earliest query sits at ``first_q_pos`` reads."""
    if HAS_WINDOW:
        return tl.maximum(first_q_pos - window + 1, 0)
    return first_q_pos * 0


@triton.jit
def visible_keys(pos, m_pos, q_pos, window, HAS_WINDOW: tl.constexpr):
    """[BM, BN]: key ``pos`` (in the context where ``m_pos``) is visible to query row
    ``q_pos``: causal, and within the last ``window`` positions when windowed."""
    visible = m_pos[None, :] & (pos[None, :] <= q_pos[:, None])
    if HAS_WINDOW:
        visible = visible & (pos[None, :] > q_pos[:, None] - window)
    return visible


@triton.jit
def paged_attention_kernel(
    q, k_pool, v_pool, o,                   # q, o [T, HQ, D]; pools [L, HKV, D]; contiguous
    page_table, cu_seqlens, seq_lens,       # int32 [B, stride_pt] / [B + 1] / [B]
    num_seqs, stride_pt, page_size, scale_log2, window,
    HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
    BQ: tl.constexpr, GP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
    F32_DOTS: tl.constexpr, HAS_WINDOW: tl.constexpr,
):
    """G = HQ // HKV query heads per KV head, padded to GP; BM = BQ * GP rows per tile."""
    i_tile = tl.program_id(0)
    i_kv = tl.program_id(1)
    seq = find_tile_seq(cu_seqlens, num_seqs, i_tile, BQ)
    bos = tl.load(cu_seqlens + seq)
    q_len = tl.load(cu_seqlens + seq + 1) - bos
    q0 = (i_tile - bos // BQ - seq) * BQ            # the tile's first query, in the sequence
    if q0 < q_len:
        prefix = tl.load(seq_lens + seq) - q_len     # cached context before the new tokens
        o_m = tl.arange(0, BM)
        tok = q0 + o_m // GP                         # [BM] query index in the sequence
        m_row = (tok < q_len) & (o_m % GP < G)
        o_d = tl.arange(0, BD)
        m_d = o_d < D
        rows = (bos + tok).to(tl.int64) * HQ + i_kv * G + o_m % GP   # rows of [T * HQ, D]
        m_qd = m_row[:, None] & m_d[None, :]
        b_q = tl.load(q + rows[:, None] * D + o_d[None, :], mask=m_qd, other=0.0)
        if F32_DOTS:
            b_q = b_q.to(tl.float32)                 # k, v follow b_q's dtype
        q_pos = prefix + tok                         # [BM] absolute positions
        kv_end = prefix + tl.minimum(q0 + BQ, q_len)  # keys 0 .. kv_end - 1 are visible to some row
        kv_start = first_visible_key(prefix + q0, window, HAS_WINDOW)
        m_i = tl.full([BM], -1.0e30, dtype=tl.float32)   # finite: no inf - inf below
        l_i = tl.zeros([BM], dtype=tl.float32)
        acc = tl.zeros([BM, BD], dtype=tl.float32)
        table_row = page_table + seq.to(tl.int64) * stride_pt
        for n0 in range(kv_start, kv_end, BN):
            pos = n0 + tl.arange(0, BN)
            m_pos = pos < kv_end
            page = tl.load(table_row + pos // page_size, mask=m_pos, other=0).to(tl.int64)
            loc = page * page_size + pos % page_size
            kv_off = (loc * HKV + i_kv)[:, None] * D + o_d[None, :]     # [BN, BD]
            m_kv = m_pos[:, None] & m_d[None, :]
            b_k = tl.load(k_pool + kv_off, mask=m_kv, other=0.0).to(b_q.dtype)
            b_s = dot(b_q, tl.trans(b_k), F32_DOTS)
            b_s = tl.where(visible_keys(pos, m_pos, q_pos, window, HAS_WINDOW),
                           b_s * scale_log2, float("-inf"))             # [BM, BN], log2 units
            m_new = tl.maximum(m_i, tl.max(b_s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            b_p = tl.exp2(b_s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(b_p, axis=1)
            b_v = tl.load(v_pool + kv_off, mask=m_kv, other=0.0).to(b_q.dtype)
            acc = acc * alpha[:, None] + dot(b_p.to(b_v.dtype), b_v, F32_DOTS)
            m_i = m_new
        acc = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(o + rows[:, None] * D + o_d[None, :], acc.to(o.dtype.element_ty), mask=m_qd)


class TileConfig(NamedTuple):
    """Compile-time tile shape of one launch (a function of shapes only)."""

    block_q: int        # BQ query tokens per tile
    group_pad: int      # GP: the query heads of a KV head, padded to a power of two
    block_n: int        # BN keys per step
    block_d: int        # BD: the head dim padded to a power of two (>= 16)
    num_warps: int


def tile_config(num_tokens: int, num_seqs: int, group: int, head_dim: int) -> TileConfig:
    """Decode-like batches (about one token per sequence) take 16-row tiles, others 64 rows
    (32 at head dims above 128, to bound the fp32 accumulator's registers)."""
    group_pad = next_pow2(group)
    block_d = max(16, next_pow2(head_dim))
    decode_like = num_tokens <= 2 * num_seqs
    rows = DECODE_ROWS if decode_like else (PREFILL_ROWS if block_d <= 128 else PREFILL_ROWS // 2)
    block_q = max(1, rows // group_pad)
    block_n = 64 if block_d <= 64 else 32
    return TileConfig(block_q, group_pad, block_n, block_d, 4 if block_d <= 128 else 8)


def paged_attention_triton(q: Tensor, k: Tensor, v: Tensor, k_pool: Tensor, v_pool: Tensor,
                           out_loc: Tensor, page_table: Tensor, cu_seqlens: Tensor,
                           seq_lens: Tensor, page_size: int, scale: float,
                           window: int | None = None) -> Tensor:
    """Contract of ``kernels.attention.paged_attention``, run by the Triton kernel."""
    check_heads(q, k)
    check_window(window)
    if not (k_pool.is_contiguous() and v_pool.is_contiguous()):
        raise ValueError("the KV pools must be contiguous [L_total, Hkv, D] tensors")
    write_kv(k, v, k_pool, v_pool, out_loc)
    num_tokens, num_q_heads, head_dim = q.shape
    num_seqs, num_kv_heads = seq_lens.shape[0], k.shape[1]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)     # row-major, as the kernel writes
    if num_tokens == 0 or num_seqs == 0:
        return out
    cfg = tile_config(num_tokens, num_seqs, num_q_heads // num_kv_heads, head_dim)
    grid = attention_grid("paged_attention", num_tokens, num_seqs, cfg.block_q, num_kv_heads)
    i32 = dict(device=q.device, dtype=torch.int32)
    table = page_table.to(**i32)
    if table.stride(1) != 1:
        table = table.contiguous()
    paged_attention_kernel[grid](
        q.contiguous(), k_pool, v_pool, out, table, cu_seqlens.to(**i32), seq_lens.to(**i32),
        num_seqs, table.stride(0), page_size, float(scale) * LOG2E, window or 0,
        HQ=num_q_heads, HKV=num_kv_heads, G=num_q_heads // num_kv_heads, D=head_dim,
        BQ=cfg.block_q, GP=cfg.group_pad, BM=cfg.block_q * cfg.group_pad, BN=cfg.block_n,
        BD=cfg.block_d, F32_DOTS=q.dtype == torch.float32 or interpreting(),
        HAS_WINDOW=window is not None, num_warps=cfg.num_warps)
    return out

"""Indexer scoring and top-k block selection in Triton: contract of
``kernels.indexer.select_positions``.

A program owns one query row (grid: ``attention_grid`` with one-row tiles; the row finds its
sequence by ``find_tile_seq``, no host sync) and makes four passes over its n visible blocks,
in tiles of BJ:

1. scores: ``[BJ, BH] = K_tile @ q^T`` (one dot, heads padded to BH with zero queries and
   weights), relu, weighted sum over heads -> fp32 scratch [T, N]; -0.0 becomes +0.0;
2. threshold: the k-th largest score, found exactly by an 8-pass radix-16 search over the
   scores' order-preserving integer keys (sign-folded float bits; each pass counts the keys
   at or above 16 candidate bounds);
3. ``gt``: how many scores lie strictly above it, so ``k - gt`` ties at the threshold are
   kept, the lowest block indices first;
4. output: a block is kept when above the threshold, or tied and among the first ``k - gt``
   ties (a running exclusive cumsum); kept blocks are written in ascending order (another
   running cumsum gives each its slot), then the partial tail block, into an output the host
   filled with -1.

Every score is one row-block dot that no other row touches, so the selection does not depend
on the batch or the chunk split. Under the CPU interpreter operands are widened to fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.attention.triton_paged import find_tile_seq
from kernels.backend import interpreting
from kernels.chunking import next_pow2
from kernels.indexer.reference import check_select, out_width
from kernels.launch_grid import attention_grid
from kernels.triton_state import dot


@triton.jit
def order_key(score):
    """fp32 -> int64 in [0, 2**32) with the floats' order (for non-NaN scores)."""
    bits = score.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return key.to(tl.int64) + 2147483648


@triton.jit
def count_at_least(sc_row, nb, bound, BJ: tl.constexpr):
    """How many of the row's nb scores have ``order_key >= bound``."""
    cnt = nb * 0
    for j0 in range(0, nb, BJ):
        o_j = j0 + tl.arange(0, BJ)
        m_j = o_j < nb
        u = order_key(tl.load(sc_row + o_j, mask=m_j, other=0.0))
        cnt += tl.sum((m_j & (u >= bound)).to(tl.int32))
    return cnt


@triton.jit
def count_at_least_16(sc_row, nb, lo, step, BJ: tl.constexpr):
    """[16]: how many of the row's nb scores have ``order_key >= lo + b * step``, b = 0 .. 15."""
    bounds = lo + tl.arange(0, 16).to(tl.int64) * step
    cnt = tl.zeros([16], dtype=tl.int32)
    for j0 in range(0, nb, BJ):
        o_j = j0 + tl.arange(0, BJ)
        m_j = o_j < nb
        u = order_key(tl.load(sc_row + o_j, mask=m_j, other=0.0))
        cnt += tl.sum((m_j[:, None] & (u[:, None] >= bounds[None, :])).to(tl.int32), axis=0)
    return cnt


@triton.jit
def kth_key(sc_row, nb, kk, BJ: tl.constexpr):
    """The largest t with count(key >= t) >= kk: the kk-th largest key (kk <= nb). Radix 16:
    with count(key >= lo) >= kk > count(key >= lo + 16 * step), eight passes narrow step
    from 2**28 to 1, each keeping the largest of lo + b * step that still counts kk."""
    lo = (nb * 0).to(tl.int64)
    step = lo + 268435456
    for _ in range(8):
        ok = count_at_least_16(sc_row, nb, lo, step, BJ) >= kk
        lo += (tl.sum(ok.to(tl.int64)) - 1) * step     # counts fall as b grows: ok is a prefix
        step = step // 16
    return lo


@triton.jit
def score_blocks(key_base, sc_row, b_q, b_w, nb, pre_scale, post_scale,
                 D: tl.constexpr, BD: tl.constexpr, BJ: tl.constexpr, F32_DOTS: tl.constexpr):
    """Each block's score post * sum_h w_h relu(pre q_h . K_j) into ``sc_row`` [nb] (-0 as 0)."""
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    for j0 in range(0, nb, BJ):
        o_j = j0 + tl.arange(0, BJ)
        m_j = o_j < nb
        b_k = tl.load(key_base + o_j[:, None] * D + o_d[None, :], mask=m_j[:, None] & m_d[None, :],
                      other=0.0).to(b_q.dtype)
        b_s = tl.maximum(dot(b_k, tl.trans(b_q), F32_DOTS) * pre_scale, 0.0)     # [BJ, BH]
        b_sc = tl.sum(b_s * b_w[None, :], axis=1) * post_scale
        b_sc = tl.where(b_sc == 0.0, 0.0, b_sc)
        tl.store(sc_row + o_j, b_sc, mask=m_j)


@triton.jit
def select_kernel(
    q, w, keys, scratch, out,              # q [T, H, D]; w [T, H]; keys [B, N, D]; scratch [T, N] f32; out [T, W]
    cu_seqlens, seq_lens,                  # int32 [B + 1] / [B]
    num_seqs, num_blocks, width, top_blocks, pre_scale, post_scale,
    H: tl.constexpr, D: tl.constexpr, C: tl.constexpr,
    BH: tl.constexpr, BD: tl.constexpr, BJ: tl.constexpr, BC: tl.constexpr,
    HAS_W: tl.constexpr, TAIL: tl.constexpr, F32_DOTS: tl.constexpr,
):
    i_tile = tl.program_id(0)
    seq = find_tile_seq(cu_seqlens, num_seqs, i_tile, 1)
    bos = tl.load(cu_seqlens + seq)
    q_len = tl.load(cu_seqlens + seq + 1) - bos
    i = i_tile - bos - seq
    if i < q_len:
        row = (bos + i).to(tl.int64)
        q_pos = tl.load(seq_lens + seq) - q_len + i
        nb = tl.minimum((q_pos + 1) // C, num_blocks)
        kk = tl.minimum(nb, top_blocks)
        o_h = tl.arange(0, BH)
        o_d = tl.arange(0, BD)
        m_h = o_h < H
        m_d = o_d < D
        b_q = tl.load(q + (row * H + o_h[:, None]) * D + o_d[None, :], mask=m_h[:, None] & m_d[None, :], other=0.0)
        if HAS_W:
            b_w = tl.load(w + row * H + o_h, mask=m_h, other=0.0).to(tl.float32)
        else:
            b_w = m_h.to(tl.float32)
        if F32_DOTS:
            b_q = b_q.to(tl.float32)
        key_base = keys + seq.to(tl.int64) * num_blocks * D
        sc_row = scratch + row * num_blocks
        score_blocks(key_base, sc_row, b_q, b_w, nb, pre_scale, post_scale, D, BD, BJ, F32_DOTS)
        tl.debug_barrier()
        thr = (nb * 0).to(tl.int64)                    # kk == nb: every block is kept
        if kk < nb:
            thr = kth_key(sc_row, nb, kk, BJ)
        need = kk - count_at_least(sc_row, nb, thr + 1, BJ)
        out_row = out + row * width
        o_c = tl.arange(0, BC)
        m_c = o_c < C
        n_eq = nb * 0
        n_sel = nb * 0
        for j0 in range(0, nb, BJ):
            o_j = j0 + tl.arange(0, BJ)
            m_j = o_j < nb
            u = order_key(tl.load(sc_row + o_j, mask=m_j, other=0.0))
            eq = (m_j & (u == thr)).to(tl.int32)
            eq_rank = n_eq + tl.cumsum(eq, axis=0) - eq
            take = ((m_j & (u > thr)) | ((eq == 1) & (eq_rank < need))).to(tl.int32)
            slot = n_sel + tl.cumsum(take, axis=0) - take
            tl.store(out_row + slot[:, None] * C + o_c[None, :], o_j[:, None] * C + o_c[None, :],
                     mask=(take == 1)[:, None] & m_c[None, :])
            n_eq += tl.sum(eq)
            n_sel += tl.sum(take)
        if TAIL:
            tail_start = nb * C
            tl.store(out_row + kk * C + o_c, tail_start + o_c, mask=(tail_start + o_c <= q_pos) & (o_c < C - 1))


def select_positions_triton(
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
    """Contract of ``kernels.indexer.select_positions``, run by the Triton kernel."""
    check_select(q, weights, block_keys, block_size, top_blocks)
    num_rows, num_heads, head_dim = q.shape
    num_seqs, num_blocks = seq_lens.shape[0], block_keys.shape[1]
    width = out_width(block_size, top_blocks, tail)
    out = torch.full((num_rows, width), -1, dtype=torch.int32, device=q.device)
    if num_rows == 0 or num_seqs == 0 or width == 0:
        return out
    scratch = torch.empty(num_rows, max(num_blocks, 1), dtype=torch.float32, device=q.device)
    i32 = dict(device=q.device, dtype=torch.int32)
    grid = attention_grid("indexer_select", num_rows, num_seqs, 1, 1)
    select_kernel[grid](
        q.contiguous(), q if weights is None else weights.contiguous(), block_keys.contiguous(), scratch, out,
        cu_seqlens.to(**i32), seq_lens.to(**i32), num_seqs, num_blocks, width, top_blocks,
        float(pre_scale), float(post_scale), H=num_heads, D=head_dim, C=block_size,
        BH=max(16, next_pow2(num_heads)), BD=max(16, next_pow2(head_dim)), BJ=32, BC=next_pow2(block_size),
        HAS_W=weights is not None, TAIL=tail, F32_DOTS=q.dtype == torch.float32 or interpreting())
    return out

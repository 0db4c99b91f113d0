"""Chunked KDA prefill in three Triton kernels (the form of ``reference._kda_chunk``).

Chunks come from a ``kernels.chunking.ChunkTable`` (at most BT tokens, cut at snapshot
tokens). Within chunk c of one head, with lb_i = sum_{m<=i} g_m [K] (per key channel) and
<x, y>_ij = sum_d x_i[d] y_j[d] exp(lb_i[d] - lb_j[d]) for j <= i:

1. ``kda_chunk_prep_kernel`` (parallel over chunks x heads): A = strict_lower(beta_i <k, k>_ij);
   X = (I + A)^-1 by forward substitution; w = X (beta k exp(lb)) [BT, K], u = X (beta v)
   [BT, V]; also stores lb [T, H, K].
2. ``kda_chunk_state_kernel`` (sequential over a sequence's chunks, parallel over heads x V
   blocks): saves S0 per chunk, turns u into v_new = u - w S0 in place, advances
   S <- exp(lb_last) S0 + sum_j (k_j exp(lb_last - lb_j)) v_new_j^T, writes snapshot / live slots.
3. ``kda_chunk_output_kernel`` (parallel over chunks x heads x V blocks):
   o = (q exp(lb)) S0 + lower_incl_diag(<q, k>) v_new.

A decay per channel cannot be folded into the operands of one ``tl.dot`` without exp(-lb_j),
which overflows for strong gates; so <x, y> is an elementwise [BT, BT, BKC] product reduced
over blocks of BKC channels, with every exponent a masked difference (<= 0). That bounds BT
(16 here). Scratch (fp32): lb, w [T, H, K]; u/v_new [T, H, V]; S0 per chunk [NC, H, K, V].
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernels.triton_state import (
    chunk_rows,
    load_initial_state,
    program_seq_head,
    state_tile,
    store_snapshot,
    store_state,
)


@triton.jit
def _inv_norms(x, rows, m_t, i_h, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
               BKC: tl.constexpr, USE_L2NORM: tl.constexpr):
    """[BT] 1 / sqrt(sum_d x[row, i_h, d]^2 + 1e-6) over all K channels (ones without l2norm)."""
    r = tl.full([BT], 1.0, dtype=tl.float32)
    if USE_L2NORM:
        acc = tl.zeros([BT], dtype=tl.float32)
        for k0 in range(0, K, BKC):
            o_d = k0 + tl.arange(0, BKC)
            b = tl.load(x + (rows[:, None] * H + i_h) * K + o_d[None, :],
                        mask=m_t[:, None] & (o_d[None, :] < K), other=0.0).to(tl.float32)
            acc += tl.sum(b * b, axis=1)
        r = 1.0 / tl.sqrt(acc + 1e-6)
    return r


@triton.jit
def _decayed_gram(a, b, la, lb, mask):
    """[BT, BT]: sum_d a_i[d] b_j[d] exp(la_i[d] - lb_j[d]) where ``mask`` (i, j), else 0.
    The exponent is masked before exp, so entries off the mask cannot overflow."""
    m3 = mask[:, :, None]
    diff = tl.where(m3, la[:, None, :] - lb[None, :, :], 0.0)
    prod = a[:, None, :] * b[None, :, :] * tl.exp(diff)
    return tl.where(mask, tl.sum(prod, axis=2), 0.0)


@triton.jit
def kda_chunk_prep_kernel(
    k, v, g, beta, lb_out, w_out, u_out,    # k, g [T, H, K]; v [T, H, V]; beta [T, H]
    chunk_starts, chunk_lens,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BKC: tl.constexpr, BV: tl.constexpr, USE_L2NORM: tl.constexpr,
):
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    o_t = tl.arange(0, BT)
    start, length, m_t, rows = chunk_rows(chunk_starts, chunk_lens, i_c, o_t)
    rk = _inv_norms(k, rows, m_t, i_h, H, K, BT, BKC, USE_L2NORM)
    b_beta = tl.load(beta + rows * H + i_h, mask=m_t, other=0.0).to(tl.float32)

    lower = (o_t[:, None] > o_t[None, :]) & m_t[:, None]
    b_a = tl.zeros([BT, BT], dtype=tl.float32)
    for k0 in range(0, K, BKC):
        o_d = k0 + tl.arange(0, BKC)
        m_td = m_t[:, None] & (o_d[None, :] < K)
        off = (rows[:, None] * H + i_h) * K + o_d[None, :]
        b_k = tl.load(k + off, mask=m_td, other=0.0).to(tl.float32) * rk[:, None]
        b_lb = tl.cumsum(tl.load(g + off, mask=m_td, other=0.0).to(tl.float32), axis=0)
        tl.store(lb_out + off, b_lb, mask=m_td)
        b_a += _decayed_gram(b_k, b_k, b_lb, b_lb, lower)
    b_a = b_a * b_beta[:, None]

    # X = (I + A)^-1, rows in order: X_i = e_i - sum_{j<i} A_ij X_j
    b_x = tl.where(o_t[:, None] == o_t[None, :], 1.0, 0.0)
    for i in range(1, length):
        a_i = tl.sum(tl.where(o_t[:, None] == i, b_a, 0.0), axis=0)        # A[i, :]
        x_i = tl.where(o_t == i, 1.0, 0.0) - tl.sum(a_i[:, None] * b_x, axis=0)
        b_x = tl.where(o_t[:, None] == i, x_i[None, :], b_x)

    for k0 in range(0, K, BKC):       # w = X (beta k exp(lb)); lb recomputed, not re-read
        o_d = k0 + tl.arange(0, BKC)
        m_td = m_t[:, None] & (o_d[None, :] < K)
        off = (rows[:, None] * H + i_h) * K + o_d[None, :]
        b_k = tl.load(k + off, mask=m_td, other=0.0).to(tl.float32) * rk[:, None]
        b_lb = tl.cumsum(tl.load(g + off, mask=m_td, other=0.0).to(tl.float32), axis=0)
        b_kw = tl.where(m_td, b_k * tl.exp(b_lb) * b_beta[:, None], 0.0)
        tl.store(w_out + off, tl.dot(b_x, b_kw), mask=m_td)
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v[None, :] < V)
        p_v = (rows[:, None] * H + i_h) * V + o_v[None, :]
        b_v = tl.load(v + p_v, mask=m_tv, other=0.0).to(tl.float32)
        tl.store(u_out + p_v, tl.dot(b_x, b_v * b_beta[:, None]),
                 mask=m_tv)


@triton.jit
def kda_chunk_state_kernel(
    k, lb, w, u, chunk_states, states,      # u is overwritten with v_new
    slot_ids, has_init, seq_ids, seq_chunk_offsets, chunk_starts, chunk_lens, chunk_dst,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_L2NORM: tl.constexpr,
):
    i_v = tl.program_id(1)
    i_n, i_h, _, seq = program_seq_head(seq_ids, H, H)
    slot = tl.load(slot_ids + seq).to(tl.int64)
    c_begin = tl.load(seq_chunk_offsets + i_n)
    c_end = tl.load(seq_chunk_offsets + i_n + 1)

    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v, m_kv, s_off = state_tile(i_h, o_k, o_v, K, V)
    s = load_initial_state(states, has_init, seq, slot, s_off, m_kv, H * K * V, BK, BV)

    for c in range(c_begin, c_end):
        store_state(chunk_states, tl.cast(c, tl.int64), s_off, s, m_kv, H * K * V)  # S0, fp32
        start, length, m_t, rows = chunk_rows(chunk_starts, chunk_lens, c, o_t)
        m_tk = m_t[:, None] & m_k[None, :]
        p_tk = (rows[:, None] * H + i_h) * K + o_k[None, :]
        b_w = tl.load(w + p_tk, mask=m_tk, other=0.0)
        p_u = u + (rows[:, None] * H + i_h) * V + o_v[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        b_vnew = tl.load(p_u, mask=m_tv, other=0.0) - tl.dot(b_w, s)
        tl.store(p_u, b_vnew, mask=m_tv)
        b_lb = tl.load(lb + p_tk, mask=m_tk, other=0.0)
        lb_last = tl.load(lb + ((start + length - 1) * H + i_h) * K + o_k, mask=m_k, other=0.0)
        b_k = tl.load(k + p_tk, mask=m_tk, other=0.0).to(tl.float32)
        if USE_L2NORM:
            b_k = b_k / tl.sqrt(tl.sum(b_k * b_k, axis=1) + 1e-6)[:, None]
        b_k = b_k * tl.where(m_tk, tl.exp(lb_last[None, :] - b_lb), 0.0)
        s = s * tl.exp(lb_last)[:, None] + tl.dot(tl.trans(b_k), b_vnew)
        store_snapshot(states, chunk_dst, c, s_off, s, m_kv, H * K * V)

    store_state(states, slot, s_off, s, m_kv, H * K * V)


@triton.jit
def kda_chunk_output_kernel(
    q, k, lb, v_new, chunk_states, o,       # o [T, H, V] (output dtype)
    chunk_starts, chunk_lens, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BKC: tl.constexpr, BV: tl.constexpr,
    USE_L2NORM: tl.constexpr,
):
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    i_v = tl.program_id(2)
    o_t = tl.arange(0, BT)
    start, length, m_t, rows = chunk_rows(chunk_starts, chunk_lens, i_c, o_t)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_tk = m_t[:, None] & m_k[None, :]
    m_tv = m_t[:, None] & (o_v[None, :] < V)
    rq = _inv_norms(q, rows, m_t, i_h, H, K, BT, BKC, USE_L2NORM) * scale
    rk = _inv_norms(k, rows, m_t, i_h, H, K, BT, BKC, USE_L2NORM)

    p_tk = (rows[:, None] * H + i_h) * K + o_k[None, :]
    b_q = tl.load(q + p_tk, mask=m_tk, other=0.0).to(tl.float32) * rq[:, None]
    b_lb = tl.load(lb + p_tk, mask=m_tk, other=0.0)
    c64 = tl.cast(i_c, tl.int64)
    b_s = tl.load(chunk_states + c64 * (H * K * V) + (i_h * K + o_k[:, None]) * V + o_v[None, :],
                  mask=m_k[:, None] & (o_v[None, :] < V), other=0.0)
    b_o = tl.dot(tl.where(m_tk, b_q * tl.exp(b_lb), 0.0), b_s)

    causal = (o_t[:, None] >= o_t[None, :]) & m_t[:, None]
    b_qk = tl.zeros([BT, BT], dtype=tl.float32)
    for k0 in range(0, K, BKC):
        o_d = k0 + tl.arange(0, BKC)
        m_td = m_t[:, None] & (o_d[None, :] < K)
        off = (rows[:, None] * H + i_h) * K + o_d[None, :]
        b_qc = tl.load(q + off, mask=m_td, other=0.0).to(tl.float32) * rq[:, None]
        b_kc = tl.load(k + off, mask=m_td, other=0.0).to(tl.float32) * rk[:, None]
        b_lbc = tl.load(lb + off, mask=m_td, other=0.0)
        b_qk += _decayed_gram(b_qc, b_kc, b_lbc, b_lbc, causal)
    b_vnew = tl.load(v_new + (rows[:, None] * H + i_h) * V + o_v[None, :], mask=m_tv, other=0.0)
    b_o += tl.dot(b_qk, b_vnew)
    tl.store(o + (rows[:, None] * H + i_h) * V + o_v[None, :], b_o.to(o.dtype.element_ty),
             mask=m_tv)

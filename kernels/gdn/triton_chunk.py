"""Chunked Gated DeltaNet prefill in three Triton kernels (the WY form of ``reference._gdn_chunk``).

Chunks come from a ``kernels.chunking.ChunkTable`` (at most BT tokens, cut at snapshot
tokens). Within chunk c of one value head, with b_i = exp(lb_i), lb_i = sum_{m<=i} g_m:

1. ``gdn_chunk_prep_kernel`` (parallel over chunks x heads): A = strict_lower(beta_i
   (k_i.k_j) b_i/b_j); X = (I + A)^-1 by forward substitution; w = X (beta b k) [BT, K] and
   u = X (beta v) [BT, V]; also stores lb. Then the chunk's corrected values are
   v_new = u - w S0 for the state S0 at the chunk start.
2. ``gdn_chunk_state_kernel`` (sequential over a sequence's chunks, parallel over heads x V
   blocks): saves S0 per chunk, turns u into v_new in place, advances
   S <- b_last S0 + sum_j (b_last / b_j) k_j v_new_j^T, and writes snapshot / live slots.
3. ``gdn_chunk_output_kernel`` (parallel over chunks x heads x V blocks):
   o = b * (q S0) + (strict_or_diag_lower((q k^T) b_i/b_j)) v_new.

Scratch (fp32): lb [T, H], w [T, H, K], u/v_new [T, H, V], S0 per chunk [NC, H, K, V].
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
def _l2norm_rows(x, USE_L2NORM: tl.constexpr):
    if USE_L2NORM:
        x = x / tl.sqrt(tl.sum(x * x, axis=1) + 1e-6)[:, None]
    return x


@triton.jit
def gdn_chunk_prep_kernel(
    k, v, g, beta, lb_out, w_out, u_out,     # k [T, HK, K]; v [T, H, V]; g, beta [T, H]
    chunk_starts, chunk_lens,
    H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_L2NORM: tl.constexpr,
):
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    i_hk = i_h // (H // HK)
    o_t = tl.arange(0, BT)
    start, length, m_t, rows = chunk_rows(chunk_starts, chunk_lens, i_c, o_t)
    o_k = tl.arange(0, BK)

    b_k = tl.load(k + (rows[:, None] * HK + i_hk) * K + o_k[None, :],
                  mask=m_t[:, None] & (o_k[None, :] < K), other=0.0).to(tl.float32)
    b_k = _l2norm_rows(b_k, USE_L2NORM)
    b_g = tl.load(g + rows * H + i_h, mask=m_t, other=0.0).to(tl.float32)
    b_beta = tl.load(beta + rows * H + i_h, mask=m_t, other=0.0).to(tl.float32)
    b_lb = tl.cumsum(b_g, axis=0)
    tl.store(lb_out + rows * H + i_h, b_lb, mask=m_t)

    lower = (o_t[:, None] > o_t[None, :]) & m_t[:, None]     # padding rows: no exp overflow
    diff = tl.where(lower, b_lb[:, None] - b_lb[None, :], 0.0)
    b_a = tl.dot(b_k, tl.trans(b_k)) * b_beta[:, None]
    b_a = tl.where(lower, b_a * tl.exp(diff), 0.0)                       # [BT, BT]

    # X = (I + A)^-1, rows in order: X_i = e_i - sum_{j<i} A_ij X_j
    b_x = tl.where(o_t[:, None] == o_t[None, :], 1.0, 0.0)
    for i in range(1, length):
        a_i = tl.sum(tl.where(o_t[:, None] == i, b_a, 0.0), axis=0)        # A[i, :]
        x_i = tl.where(o_t == i, 1.0, 0.0) - tl.sum(a_i[:, None] * b_x, axis=0)
        b_x = tl.where(o_t[:, None] == i, x_i[None, :], b_x)

    b_kw = b_k * (b_beta * tl.exp(b_lb))[:, None]
    b_w = tl.dot(b_x, b_kw)                                              # [BT, BK]
    tl.store(w_out + (rows[:, None] * H + i_h) * K + o_k[None, :], b_w,
             mask=m_t[:, None] & (o_k[None, :] < K))
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v[None, :] < V)
        b_v = tl.load(v + (rows[:, None] * H + i_h) * V + o_v[None, :], mask=m_tv,
                      other=0.0).to(tl.float32)
        b_u = tl.dot(b_x, b_v * b_beta[:, None])
        tl.store(u_out + (rows[:, None] * H + i_h) * V + o_v[None, :], b_u, mask=m_tv)


@triton.jit
def gdn_chunk_state_kernel(
    k, lb, w, u, chunk_states, states,      # u is overwritten with v_new
    slot_ids, has_init, seq_ids, seq_chunk_offsets, chunk_starts, chunk_lens, chunk_dst,
    H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_L2NORM: tl.constexpr,
):
    i_v = tl.program_id(1)
    i_n, i_h, i_hk, seq = program_seq_head(seq_ids, H, HK)
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
        b_w = tl.load(w + (rows[:, None] * H + i_h) * K + o_k[None, :],
                      mask=m_t[:, None] & m_k[None, :], other=0.0)
        p_u = u + (rows[:, None] * H + i_h) * V + o_v[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        b_vnew = tl.load(p_u, mask=m_tv, other=0.0) - tl.dot(b_w, s)       # [BT, BV]
        tl.store(p_u, b_vnew, mask=m_tv)
        b_lb = tl.load(lb + rows * H + i_h, mask=m_t, other=0.0)
        lb_last = tl.load(lb + (start + length - 1) * H + i_h)
        b_k = tl.load(k + (rows[:, None] * HK + i_hk) * K + o_k[None, :],
                      mask=m_t[:, None] & m_k[None, :], other=0.0).to(tl.float32)
        b_k = _l2norm_rows(b_k, USE_L2NORM)
        b_k = b_k * tl.where(m_t, tl.exp(lb_last - b_lb), 0.0)[:, None]
        s = s * tl.exp(lb_last) + tl.dot(tl.trans(b_k), b_vnew)
        store_snapshot(states, chunk_dst, c, s_off, s, m_kv, H * K * V)

    store_state(states, slot, s_off, s, m_kv, H * K * V)


@triton.jit
def gdn_chunk_output_kernel(
    q, k, lb, v_new, chunk_states, o,       # o [T, H, V] (output dtype)
    chunk_starts, chunk_lens, scale,
    H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_L2NORM: tl.constexpr,
):
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    i_v = tl.program_id(2)
    i_hk = i_h // (H // HK)
    o_t = tl.arange(0, BT)
    start, length, m_t, rows = chunk_rows(chunk_starts, chunk_lens, i_c, o_t)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_tk = m_t[:, None] & m_k[None, :]
    m_tv = m_t[:, None] & m_v[None, :]

    b_q = tl.load(q + (rows[:, None] * HK + i_hk) * K + o_k[None, :], mask=m_tk,
                  other=0.0).to(tl.float32)
    b_q = _l2norm_rows(b_q, USE_L2NORM) * scale
    b_k = tl.load(k + (rows[:, None] * HK + i_hk) * K + o_k[None, :], mask=m_tk,
                  other=0.0).to(tl.float32)
    b_k = _l2norm_rows(b_k, USE_L2NORM)
    b_lb = tl.load(lb + rows * H + i_h, mask=m_t, other=0.0)
    c64 = tl.cast(i_c, tl.int64)
    b_s = tl.load(chunk_states + c64 * (H * K * V) + (i_h * K + o_k[:, None]) * V + o_v[None, :],
                  mask=m_k[:, None] & m_v[None, :], other=0.0)
    b_vnew = tl.load(v_new + (rows[:, None] * H + i_h) * V + o_v[None, :], mask=m_tv, other=0.0)

    causal = (o_t[:, None] >= o_t[None, :]) & m_t[:, None]
    diff = tl.where(causal, b_lb[:, None] - b_lb[None, :], 0.0)
    b_qk = tl.where(causal, tl.dot(b_q, tl.trans(b_k)) * tl.exp(diff), 0.0)
    b_o = tl.dot(b_q, b_s) * tl.exp(b_lb)[:, None] + tl.dot(b_qk, b_vnew)
    tl.store(o + (rows[:, None] * H + i_h) * V + o_v[None, :], b_o.to(o.dtype.element_ty),
             mask=m_tv)

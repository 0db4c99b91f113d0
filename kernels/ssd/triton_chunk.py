"""Chunked Mamba2 SSD prefill in two Triton kernels (the form of ``reference._ssd_chunk``).

Chunks come from a ``kernels.chunking.ChunkTable`` (at most BT tokens, cut at snapshot
tokens). Within a chunk of head h, with la_i = sum_{m<=i} dt'_m A (log decay from the chunk
start through token i):

1. ``ssd_chunk_state_kernel`` (sequential over a sequence's chunks, parallel over heads x P
   blocks): saves the state S0 at each chunk start, advances
   S <- exp(la_last) S0 + sum_j exp(la_last - la_j) dt'_j x_j B_j^T, and writes snapshot and
   live slots.
2. ``ssd_chunk_output_kernel`` (parallel over chunks x heads x P blocks):
   y_i = exp(la_i) S0 C_i + sum_{j<=i} exp(la_i - la_j) (C_i.B_j) dt'_j x_j + D x_i.

Scratch (fp32): S0 per chunk [NC, H, P, N]. dt' and la are recomputed in both kernels. Every
dot is on fp32 operands: tf32 on a GPU for bf16 / fp16 activations, IEEE fp32 for fp32 ones
(``F32_DOTS``: with tf32, a 700-token fp32 prefill of 128 heads of 64 x 128 was off the
reference by 0.27 on an H200).
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernels.ssd.triton_recurrent import discretize
from kernels.triton_state import (
    chunk_rows,
    dot,
    load_initial_state,
    program_seq_head,
    state_tile,
    store_snapshot,
    store_state,
)


@triton.jit
def _chunk_decay(dt, A, dt_bias, rows, m_t, i_h, dt_min, dt_max,
                 H: tl.constexpr, DT_SOFTPLUS: tl.constexpr, HAS_DT_MAX: tl.constexpr):
    """dt' [BT] (0 on padding rows) and la = cumsum(dt' A) [BT] of one chunk of head i_h."""
    b_dt = tl.load(dt + rows * H + i_h, mask=m_t, other=0.0).to(tl.float32)
    b_dt = discretize(b_dt, tl.load(dt_bias + i_h).to(tl.float32), DT_SOFTPLUS, dt_min, dt_max,
                      HAS_DT_MAX)
    b_dt = tl.where(m_t, b_dt, 0.0)
    b_la = tl.cumsum(b_dt * tl.load(A + i_h).to(tl.float32), axis=0)
    return b_dt, b_la


@triton.jit
def ssd_chunk_state_kernel(
    x, dt, A, B, dt_bias, chunk_states, states,
    slot_ids, has_init, seq_ids, seq_chunk_offsets, chunk_starts, chunk_lens, chunk_dst,
    dt_min, dt_max,
    H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
    BT: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr, HAS_DT_MAX: tl.constexpr, F32_DOTS: tl.constexpr,
):
    i_p = tl.program_id(1)
    i_n, i_h, i_g, seq = program_seq_head(seq_ids, H, G)
    slot = tl.load(slot_ids + seq).to(tl.int64)
    c_begin = tl.load(seq_chunk_offsets + i_n)
    c_end = tl.load(seq_chunk_offsets + i_n + 1)

    o_t = tl.arange(0, BT)
    o_p = i_p * BP + tl.arange(0, BP)
    o_n = tl.arange(0, BN)
    m_p, m_n, m_pn, s_off = state_tile(i_h, o_p, o_n, P, N)

    s = load_initial_state(states, has_init, seq, slot, s_off, m_pn, H * P * N, BP, BN)

    for c in range(c_begin, c_end):
        store_state(chunk_states, tl.cast(c, tl.int64), s_off, s, m_pn, H * P * N)  # S0, fp32
        start, length, m_t, rows = chunk_rows(chunk_starts, chunk_lens, c, o_t)
        b_dt, b_la = _chunk_decay(dt, A, dt_bias, rows, m_t, i_h, dt_min, dt_max, H,
                                  DT_SOFTPLUS, HAS_DT_MAX)
        la_last = tl.sum(tl.where(o_t == length - 1, b_la, 0.0), axis=0)
        b_x = tl.load(x + (rows[:, None] * H + i_h) * P + o_p[None, :],
                      mask=m_t[:, None] & m_p[None, :], other=0.0).to(tl.float32)
        b_b = tl.load(B + (rows[:, None] * G + i_g) * N + o_n[None, :],
                      mask=m_t[:, None] & m_n[None, :], other=0.0).to(tl.float32)
        weight = tl.where(m_t, b_dt * tl.exp(la_last - b_la), 0.0)
        s = s * tl.exp(la_last) + dot(tl.trans(b_x * weight[:, None]), b_b, F32_DOTS)
        store_snapshot(states, chunk_dst, c, s_off, s, m_pn, H * P * N)

    store_state(states, slot, s_off, s, m_pn, H * P * N)


@triton.jit
def ssd_chunk_output_kernel(
    x, dt, A, B, C, D, dt_bias, chunk_states, y,
    chunk_starts, chunk_lens, dt_min, dt_max,
    H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
    BT: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr, HAS_DT_MAX: tl.constexpr, F32_DOTS: tl.constexpr,
):
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    i_p = tl.program_id(2)
    i_g = i_h // (H // G)
    o_t = tl.arange(0, BT)
    start, length, m_t, rows = chunk_rows(chunk_starts, chunk_lens, i_c, o_t)
    o_p = i_p * BP + tl.arange(0, BP)
    o_n = tl.arange(0, BN)
    m_p = o_p < P
    m_n = o_n < N
    m_tp = m_t[:, None] & m_p[None, :]
    m_tn = m_t[:, None] & m_n[None, :]

    b_dt, b_la = _chunk_decay(dt, A, dt_bias, rows, m_t, i_h, dt_min, dt_max, H,
                              DT_SOFTPLUS, HAS_DT_MAX)
    b_x = tl.load(x + (rows[:, None] * H + i_h) * P + o_p[None, :], mask=m_tp,
                  other=0.0).to(tl.float32)
    b_b = tl.load(B + (rows[:, None] * G + i_g) * N + o_n[None, :], mask=m_tn,
                  other=0.0).to(tl.float32)
    b_c = tl.load(C + (rows[:, None] * G + i_g) * N + o_n[None, :], mask=m_tn,
                  other=0.0).to(tl.float32)
    c64 = tl.cast(i_c, tl.int64)
    b_s = tl.load(chunk_states + c64 * (H * P * N) + (i_h * P + o_p[:, None]) * N + o_n[None, :],
                  mask=m_p[:, None] & m_n[None, :], other=0.0)            # [BP, BN]

    causal = (o_t[:, None] >= o_t[None, :]) & m_t[:, None]
    diff = tl.where(causal, b_la[:, None] - b_la[None, :], 0.0)
    b_cb = tl.where(causal, dot(b_c, tl.trans(b_b), F32_DOTS) * tl.exp(diff), 0.0) * b_dt[None, :]
    b_y = dot(b_c, tl.trans(b_s), F32_DOTS) * tl.exp(b_la)[:, None] + dot(b_cb, b_x, F32_DOTS)
    b_y += tl.load(D + i_h).to(tl.float32) * b_x
    tl.store(y + (rows[:, None] * H + i_h) * P + o_p[None, :], b_y.to(y.dtype.element_ty),
             mask=m_tp)

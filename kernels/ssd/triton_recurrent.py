"""Selective state update (Mamba2 SSD per token): decode, speculative verify, short chunks.

One program per (sequence, head, P block) walks its sequence's tokens in order with the state
tile S[p-block, :] ([BP, BN] fp32) in registers: read from the pool by slot index (or zeros),
written back to the live slot after the last token and, where ``state_dst_slots[t] != 0``,
after token t into that slot (per-draft-token states for speculative verify).

Per token: dt' = clamp(softplus(dt + dt_bias)); S <- exp(dt' A) S + dt' x B^T;
y = S C + D x.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernels.triton_state import load_initial_state, program_seq_head, state_tile, store_snapshot, store_state


@triton.jit
def discretize(dt, dt_bias, DT_SOFTPLUS: tl.constexpr, dt_min, dt_max, HAS_DT_MAX: tl.constexpr):
    """The reference's dt rule (softplus threshold 20, as torch) on an fp32 tile."""
    dt = dt + dt_bias
    if DT_SOFTPLUS:
        dt = tl.where(dt > 20.0, dt, tl.log(1.0 + tl.exp(tl.minimum(dt, 20.0))))
    dt = tl.maximum(dt, dt_min)
    if HAS_DT_MAX:
        dt = tl.minimum(dt, dt_max)
    return dt


@triton.jit
def ssd_recurrent_kernel(
    x, dt, A, B, C, D, dt_bias, y, states,  # x, y [T, H, P]; dt [T, H]; B, C [T, G, N]
    cu_seqlens, slot_ids, has_init, seq_ids, dst_slots,
    dt_min, dt_max,
    H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
    BP: tl.constexpr, BN: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr, HAS_DT_MAX: tl.constexpr, HAS_DST: tl.constexpr,
):
    i_p = tl.program_id(1)
    i_n, i_h, i_g, seq = program_seq_head(seq_ids, H, G)
    bos = tl.load(cu_seqlens + seq).to(tl.int64)
    eos = tl.load(cu_seqlens + seq + 1).to(tl.int64)
    slot = tl.load(slot_ids + seq).to(tl.int64)

    o_p = i_p * BP + tl.arange(0, BP)
    o_n = tl.arange(0, BN)
    m_p, m_n, m_pn, s_off = state_tile(i_h, o_p, o_n, P, N)
    b_a = tl.load(A + i_h).to(tl.float32)
    b_d = tl.load(D + i_h).to(tl.float32)
    b_bias = tl.load(dt_bias + i_h).to(tl.float32)

    s = load_initial_state(states, has_init, seq, slot, s_off, m_pn, H * P * N, BP, BN)

    for t in range(bos, eos):
        b_x = tl.load(x + (t * H + i_h) * P + o_p, mask=m_p, other=0.0).to(tl.float32)
        b_b = tl.load(B + (t * G + i_g) * N + o_n, mask=m_n, other=0.0).to(tl.float32)
        b_c = tl.load(C + (t * G + i_g) * N + o_n, mask=m_n, other=0.0).to(tl.float32)
        b_dt = discretize(tl.load(dt + t * H + i_h).to(tl.float32), b_bias, DT_SOFTPLUS,
                          dt_min, dt_max, HAS_DT_MAX)
        s = s * tl.exp(b_dt * b_a) + (b_x * b_dt)[:, None] * b_b[None, :]
        b_y = tl.sum(s * b_c[None, :], axis=1) + b_d * b_x
        tl.store(y + (t * H + i_h) * P + o_p, b_y.to(y.dtype.element_ty), mask=m_p)
        if HAS_DST:
            store_snapshot(states, dst_slots, t, s_off, s, m_pn, H * P * N)

    if eos > bos:
        store_state(states, slot, s_off, s, m_pn, H * P * N)

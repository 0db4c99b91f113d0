"""Mamba1 selective state update, per token: decode, speculative verify, short chunks.

One program per (sequence, block of BH channels) walks its sequence's tokens in order with
the state tile S[h-block, :] ([BH, BN] fp32) in registers: read from the pool by slot index
(or zeros), written back to the live slot after the last token and, where
``state_dst_slots[t] != 0``, after token t into that slot.

Per token: dt' = softplus(dt + dt_bias); S <- exp(dt' A) S + dt' x B^T; y = S C + D x.
B and C are one row per token (G = 1) or G rows, row g feeding channels g H / G onwards.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernels.triton_state import load_initial_state, state_tile, store_snapshot, store_state


@triton.jit
def softplus_dt(dt, dt_bias, DT_SOFTPLUS: tl.constexpr):
    """The reference's dt rule (softplus threshold 20, as torch) on an fp32 tile."""
    dt = dt + dt_bias
    if DT_SOFTPLUS:
        dt = tl.where(dt > 20.0, dt, tl.log(1.0 + tl.exp(tl.minimum(dt, 20.0))))
    return dt


@triton.jit
def group_tile(ptr, t, o_h, o_n, m_h, m_n, H: tl.constexpr, N: tl.constexpr, G: tl.constexpr):
    """B or C of token t as an fp32 tile: [1, BN] when every channel shares it (G = 1), else
    [BH, BN] holding each channel's group row."""
    if G == 1:
        tile = tl.load(ptr + t * N + o_n, mask=m_n, other=0.0)[None, :]
    else:
        grp = o_h // (H // G)
        offs = t * (G * N) + grp[:, None] * N + o_n[None, :]
        tile = tl.load(ptr + offs, mask=m_h[:, None] & m_n[None, :], other=0.0)
    return tile.to(tl.float32)


@triton.jit
def selective_scan_recurrent_kernel(
    x, dt, A, B, C, D, dt_bias, y, states,  # x, dt, y [T, H]; A [H, N]; B, C [T, G, N]; D, dt_bias [H]
    cu_seqlens, slot_ids, has_init, seq_ids, dst_slots,
    H: tl.constexpr, N: tl.constexpr, G: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr, HAS_DST: tl.constexpr,
):
    seq = tl.load(seq_ids + tl.program_id(0))
    bos = tl.load(cu_seqlens + seq).to(tl.int64)
    eos = tl.load(cu_seqlens + seq + 1).to(tl.int64)
    slot = tl.load(slot_ids + seq).to(tl.int64)

    o_h = tl.program_id(1) * BH + tl.arange(0, BH)
    o_n = tl.arange(0, BN)
    m_h, m_n, m_hn, s_off = state_tile(0, o_h, o_n, H, N)
    b_a = tl.load(A + s_off, mask=m_hn, other=0.0).to(tl.float32)      # [BH, BN]
    b_d = tl.load(D + o_h, mask=m_h, other=0.0).to(tl.float32)
    b_bias = tl.load(dt_bias + o_h, mask=m_h, other=0.0).to(tl.float32)

    s = load_initial_state(states, has_init, seq, slot, s_off, m_hn, H * N, BH, BN)

    for t in range(bos, eos):
        b_x = tl.load(x + t * H + o_h, mask=m_h, other=0.0).to(tl.float32)
        b_dt = softplus_dt(tl.load(dt + t * H + o_h, mask=m_h, other=0.0).to(tl.float32),
                           b_bias, DT_SOFTPLUS)
        b_b = group_tile(B, t, o_h, o_n, m_h, m_n, H, N, G)
        b_c = group_tile(C, t, o_h, o_n, m_h, m_n, H, N, G)
        s = s * tl.exp(b_dt[:, None] * b_a) + (b_x * b_dt)[:, None] * b_b
        b_y = tl.sum(s * b_c, axis=1) + b_d * b_x
        tl.store(y + t * H + o_h, b_y.to(y.dtype.element_ty), mask=m_h)
        if HAS_DST:
            store_snapshot(states, dst_slots, t, s_off, s, m_hn, H * N)

    if eos > bos:
        store_state(states, slot, s_off, s, m_hn, H * N)

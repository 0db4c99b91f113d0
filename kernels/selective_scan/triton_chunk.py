"""Chunked Mamba1 selective scan (the form of ``reference._scan_chunk``) in one Triton kernel.

Chunks come from a ``kernels.chunking.ChunkTable`` (at most BT tokens, cut after every
snapshot token, so a snapshot is always the state at a chunk end). One program per (long
sequence, block of BH channels) walks its sequence's chunks in order, carrying the state
tile S [BH, BN] in fp32 registers. Within a chunk, with a_i = exp(dt'_i A) and
u_i = dt'_i x_i B_i^T ([BT, BH, BN] each; padding rows a = 1, u = 0), an inclusive
``tl.associative_scan`` of the pairs under (a, u) . (a', u') = (a a', a' u + u') gives every
S_i = acc_a_i S_0 + acc_u_i, hence y_i = S_i C_i + D x_i for the whole chunk at once; the
state after the chunk's last row carries on (and goes to the chunk's snapshot slot, if any).
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernels.selective_scan.triton_recurrent import softplus_dt
from kernels.triton_state import chunk_rows, load_initial_state, state_tile, store_snapshot, store_state


@triton.jit
def _compose(a_left, u_left, a_right, u_right):
    """The scan's operator: apply the left pair, then the right one."""
    return a_left * a_right, a_right * u_left + u_right


@triton.jit
def group_rows(ptr, rows, m_t, o_h, o_n, m_h, m_n, H: tl.constexpr, N: tl.constexpr, G: tl.constexpr):
    """B or C of a chunk's rows as an fp32 tile: [BT, 1, BN] when every channel shares it
    (G = 1), else [BT, BH, BN] holding each channel's group row."""
    if G == 1:
        tile = tl.load(ptr + rows[:, None] * N + o_n[None, :], mask=m_t[:, None] & m_n[None, :], other=0.0)
        tile = tile[:, None, :]
    else:
        grp = o_h // (H // G)
        offs = rows[:, None, None] * (G * N) + grp[None, :, None] * N + o_n[None, None, :]
        mask = m_t[:, None, None] & m_h[None, :, None] & m_n[None, None, :]
        tile = tl.load(ptr + offs, mask=mask, other=0.0)
    return tile.to(tl.float32)


@triton.jit
def selective_scan_chunk_kernel(
    x, dt, A, B, C, D, dt_bias, y, states,  # x, dt, y [T, H]; A [H, N]; B, C [T, G, N]; D, dt_bias [H]
    slot_ids, has_init, seq_ids, seq_chunk_offsets, chunk_starts, chunk_lens, chunk_dst,
    H: tl.constexpr, N: tl.constexpr, G: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr,
):
    i_n = tl.program_id(0)
    seq = tl.load(seq_ids + i_n)
    slot = tl.load(slot_ids + seq).to(tl.int64)
    c_begin = tl.load(seq_chunk_offsets + i_n)
    c_end = tl.load(seq_chunk_offsets + i_n + 1)

    o_t = tl.arange(0, BT)
    o_h = tl.program_id(1) * BH + tl.arange(0, BH)
    o_n = tl.arange(0, BN)
    m_h, m_n, m_hn, s_off = state_tile(0, o_h, o_n, H, N)
    b_a = tl.load(A + s_off, mask=m_hn, other=0.0).to(tl.float32)      # [BH, BN]
    b_d = tl.load(D + o_h, mask=m_h, other=0.0).to(tl.float32)
    b_bias = tl.load(dt_bias + o_h, mask=m_h, other=0.0).to(tl.float32)

    s = load_initial_state(states, has_init, seq, slot, s_off, m_hn, H * N, BH, BN)

    for c in range(c_begin, c_end):
        start, length, m_t, rows = chunk_rows(chunk_starts, chunk_lens, c, o_t)
        m_th = m_t[:, None] & m_h[None, :]
        b_x = tl.load(x + rows[:, None] * H + o_h[None, :], mask=m_th, other=0.0).to(tl.float32)
        b_dt = tl.load(dt + rows[:, None] * H + o_h[None, :], mask=m_th, other=0.0).to(tl.float32)
        b_dt = tl.where(m_th, softplus_dt(b_dt, b_bias[None, :], DT_SOFTPLUS), 0.0)
        b_b = group_rows(B, rows, m_t, o_h, o_n, m_h, m_n, H, N, G)      # [BT, 1 or BH, BN]
        b_c = group_rows(C, rows, m_t, o_h, o_n, m_h, m_n, H, N, G)
        decay = tl.exp(b_dt[:, :, None] * b_a[None, :, :])       # [BT, BH, BN]; 1 on padding
        update = (b_x * b_dt)[:, :, None] * b_b                          # 0 on padding
        acc_a, acc_u = tl.associative_scan((decay, update), 0, _compose)
        s_all = acc_a * s[None, :, :] + acc_u                            # S_i for every row
        b_y = tl.sum(s_all * b_c, axis=2) + b_d[None, :] * b_x
        tl.store(y + rows[:, None] * H + o_h[None, :], b_y.to(y.dtype.element_ty), mask=m_th)
        s = tl.sum(tl.where((o_t == length - 1)[:, None, None], s_all, 0.0), axis=0)
        store_snapshot(states, chunk_dst, c, s_off, s, m_hn, H * N)

    store_state(states, slot, s_off, s, m_hn, H * N)

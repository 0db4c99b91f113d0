"""Fused recurrent Gated DeltaNet kernel: decode, speculative verify and short chunks.

One program per (sequence, value head, V block) walks its sequence's tokens in order,
holding the state tile S[:, v-block] ([BK, BV] fp32) in registers. The state is read from
the pool by slot index (or zeros), written back to the live slot after the last token, and,
where ``state_dst_slots[t] != 0``, also after token t into that slot: the per-draft-token
states of speculative verify, with no copy through Python.

Per token (q, k l2-normalised over K inside the kernel, q scaled):
    S <- exp(g) S;  u = beta (v - S^T k);  S <- S + k u^T;  o = S^T q.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernels.triton_state import load_initial_state, program_seq_head, state_tile, store_snapshot, store_state


@triton.jit
def gdn_recurrent_kernel(
    q, k, v, g, beta, o, states,            # q, k [T, HK, K]; v, o [T, H, V]; g, beta [T, H]
    cu_seqlens, slot_ids, has_init,         # [B + 1], [B], [B] (int32)
    seq_ids, dst_slots,                     # [n] sequences of this launch; [T] or dummy
    scale,
    H: tl.constexpr, HK: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    USE_L2NORM: tl.constexpr, HAS_DST: tl.constexpr,
):
    i_v = tl.program_id(1)
    i_n, i_h, i_hk, seq = program_seq_head(seq_ids, H, HK)
    bos = tl.load(cu_seqlens + seq).to(tl.int64)
    eos = tl.load(cu_seqlens + seq + 1).to(tl.int64)
    slot = tl.load(slot_ids + seq).to(tl.int64)

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    # S[h, :, v-block] inside one slot of the [S, H, K, V] pool
    m_k, m_v, m_kv, s_off = state_tile(i_h, o_k, o_v, K, V)

    s = load_initial_state(states, has_init, seq, slot, s_off, m_kv, H * K * V, BK, BV)

    for t in range(bos, eos):
        b_q = tl.load(q + (t * HK + i_hk) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_k = tl.load(k + (t * HK + i_hk) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(v + (t * H + i_h) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_g = tl.load(g + t * H + i_h).to(tl.float32)
        b_beta = tl.load(beta + t * H + i_h).to(tl.float32)
        if USE_L2NORM:
            b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6)
            b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
        b_q = b_q * scale
        s = s * tl.exp(b_g)
        b_u = b_beta * (b_v - tl.sum(s * b_k[:, None], axis=0))          # [BV]
        s = s + b_k[:, None] * b_u[None, :]
        b_o = tl.sum(s * b_q[:, None], axis=0)                           # [BV]
        tl.store(o + (t * H + i_h) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
        if HAS_DST:
            store_snapshot(states, dst_slots, t, s_off, s, m_kv, H * K * V)

    if eos > bos:
        store_state(states, slot, s_off, s, m_kv, H * K * V)

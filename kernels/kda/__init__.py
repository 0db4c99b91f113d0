"""Kimi Delta Attention (KDA: Kimi-Linear, BailingHybrid) over a flat varlen batch with a
state pool.

Per head, with state S [K, V], q/k l2-normalised over K and q scaled (default K**-0.5):

    S'    = diag(exp(g_t)) S_{t-1}              (g_t [K]: a log decay per key channel)
    u_t   = beta_t (v_t - S'^T k_t)
    S_t   = S' + k_t u_t^T
    o_t   = S_t^T q_t

Gated DeltaNet (``kernels.gdn``) is the special case where every channel of a head shares
one decay. Files (the fla template): ``reference`` (torch: the ground truth and the CPU path),
``triton_recurrent`` (fused per-token kernel: decode, speculative verify and short chunks,
snapshot after any token), ``triton_chunk`` (chunked prefill), ``triton_varlen`` (the
launcher). ``kernels.backend`` picks one per call.

``kda_update`` is the decode fast path (one token per sequence, every initial state present,
no snapshots), ``kda_verify`` the speculative-verify one (``ForwardBatch.verify_len``); both
equal ``kda_varlen`` on such batches.
"""
from __future__ import annotations

from torch import Tensor

from kernels import backend, graph_ops, unit_layout
from kernels.kda.reference import (DEFAULT_CHUNK, kda_update_torch, kda_varlen_torch,
                                   kda_verify_torch)

__all__ = ["kda_update", "kda_varlen", "kda_verify"]


def kda_varlen(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, states: Tensor,
               cu_seqlens: Tensor, slot_ids: Tensor, has_initial_state: Tensor,
               scale: float | None = None, use_qk_l2norm: bool = True,
               chunk_size: int = DEFAULT_CHUNK, state_dst_slots: Tensor | None = None) -> Tensor:
    """q, k, g [T, H, K]; v [T, H, V]; beta [T, H]; states [S, H, K, V] -> o [T, H, V].

    Updates ``states`` in place (live and snapshot slots); see ``kernels`` for the contract.
    """
    if backend.use_triton(v):
        return graph_ops.kda_varlen(q, k, v, g, beta, states, cu_seqlens, slot_ids,
                                    has_initial_state, scale, use_qk_l2norm, state_dst_slots)
    return kda_varlen_torch(q, k, v, g, beta, states, cu_seqlens, slot_ids, has_initial_state,
                            scale, use_qk_l2norm, chunk_size, state_dst_slots)


def kda_update(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, states: Tensor,
               slot_ids: Tensor, scale: float | None = None, use_qk_l2norm: bool = True) -> Tensor:
    """Decode fast path, one token per sequence: q, k, g [B, H, K]; v [B, H, V]; beta [B, H].
    Reads and updates the live slots ``slot_ids`` in place."""
    if backend.use_triton(v):
        cu_seqlens, has_initial_state = unit_layout(slot_ids)
        return graph_ops.kda_varlen(q, k, v, g, beta, states, cu_seqlens, slot_ids,
                                    has_initial_state, scale, use_qk_l2norm, uniform_len=1)
    return kda_update_torch(q, k, v, g, beta, states, slot_ids, scale, use_qk_l2norm)


def kda_verify(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, states: Tensor,
               cu_seqlens: Tensor, slot_ids: Tensor, has_initial_state: Tensor,
               state_dst_slots: Tensor, seq_len: int, scale: float | None = None,
               use_qk_l2norm: bool = True) -> Tensor:
    """Speculative-verify fast path: every sequence has ``seq_len`` tokens, an initial state and
    a snapshot slot at every token. Equals ``kda_varlen`` on that batch."""
    if backend.use_triton(v):
        return graph_ops.kda_varlen(q, k, v, g, beta, states, cu_seqlens, slot_ids,
                                    has_initial_state, scale, use_qk_l2norm,
                                    state_dst_slots=state_dst_slots, uniform_len=seq_len)
    return kda_verify_torch(q, k, v, g, beta, states, slot_ids, state_dst_slots, seq_len, scale,
                            use_qk_l2norm)

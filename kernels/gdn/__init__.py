"""Gated DeltaNet (Qwen3-Next linear attention) over a flat varlen batch with a state pool.

Per value head, with state S [K, V] (HF/FLA layout), q/k l2-normalised over K and q scaled:

    S'    = exp(g_t) * S_{t-1}                  (decay; g_t <= 0 is a log decay)
    u_t   = beta_t * (v_t - S'^T k_t)           (delta rule: write only what S' mispredicts)
    S_t   = S' + k_t u_t^T
    o_t   = S_t^T q_t

Files (the fla template): ``reference`` (torch: the ground truth), ``cpu`` (the CPU path:
every token through the recurrence in C++, ``kernels/native_gdn.cpp``),
``triton_recurrent`` (fused per-token kernel: decode and speculative verify, snapshot after
any token), ``triton_chunk`` (chunked WY prefill), ``triton_varlen`` (the launcher).
``kernels.backend`` picks one per call.

``gated_delta_rule_update`` is the decode fast path (one token per sequence, every initial
state present, no snapshots): on the torch path a single step with one gather and one scatter
of the live states, in place of the varlen driver's planning and padding; on Triton the
recurrent kernel over the one-token layout (``kernels.unit_layout``).
"""
from __future__ import annotations

from torch import Tensor

from kernels import backend, graph_ops, unit_layout
from kernels.gdn.cpu import gated_delta_rule_update_cpu, gated_delta_rule_varlen_cpu, gated_delta_rule_verify_cpu
from kernels.gdn.reference import (gated_delta_rule_update_torch, gated_delta_rule_varlen_torch,
                                   gated_delta_rule_verify_torch, l2norm)

__all__ = ["gated_delta_rule_update", "gated_delta_rule_varlen", "gated_delta_rule_verify", "l2norm"]


def gated_delta_rule_varlen(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                            states: Tensor, cu_seqlens: Tensor, slot_ids: Tensor,
                            has_initial_state: Tensor, scale: float | None = None,
                            use_qk_l2norm: bool = True, chunk_size: int = 64,
                            state_dst_slots: Tensor | None = None) -> Tensor:
    """q, k [T, Hk, K]; v [T, H, V]; g, beta [T, H]; states [S, H, K, V] -> o [T, H, V].

    ``scale`` defaults to K**-0.5. Updates ``states`` in place (live and snapshot slots).
    """
    if backend.use_triton(v):
        return graph_ops.gdn_varlen(q, k, v, g, beta, states, cu_seqlens, slot_ids,
                                    has_initial_state, scale, use_qk_l2norm,
                                    chunk_size, state_dst_slots)
    if backend.use_native(v):
        return gated_delta_rule_varlen_cpu(q, k, v, g, beta, states, cu_seqlens, slot_ids, has_initial_state,
                                           scale, use_qk_l2norm, chunk_size, state_dst_slots)
    return gated_delta_rule_varlen_torch(q, k, v, g, beta, states, cu_seqlens, slot_ids,
                                         has_initial_state, scale, use_qk_l2norm, chunk_size,
                                         state_dst_slots)


def gated_delta_rule_update(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                            states: Tensor, slot_ids: Tensor, scale: float | None = None,
                            use_qk_l2norm: bool = True) -> Tensor:
    """Decode fast path, one token per sequence: q, k [B, Hk, K]; v [B, H, V]; g, beta [B, H];
    states [S, H, K, V] -> o [B, H, V]. Reads and updates the live slots ``slot_ids`` in place.

    Equals ``gated_delta_rule_varlen`` with every length 1, every initial state present and
    no snapshot slots (bitwise on the torch path: the same step function).
    """
    if backend.use_triton(v):
        cu_seqlens, has_initial_state = unit_layout(slot_ids)
        return graph_ops.gdn_varlen(q, k, v, g, beta, states, cu_seqlens, slot_ids,
                                    has_initial_state, scale, use_qk_l2norm, uniform_len=1)
    if backend.use_native(v):
        return gated_delta_rule_update_cpu(q, k, v, g, beta, states, slot_ids, scale, use_qk_l2norm)
    return gated_delta_rule_update_torch(q, k, v, g, beta, states, slot_ids, scale, use_qk_l2norm)


def gated_delta_rule_verify(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                            states: Tensor, cu_seqlens: Tensor, slot_ids: Tensor,
                            has_initial_state: Tensor, state_dst_slots: Tensor, seq_len: int,
                            scale: float | None = None, use_qk_l2norm: bool = True) -> Tensor:
    """Speculative-verify fast path (``ForwardBatch.verify_len``): every sequence has
    ``seq_len`` tokens, an initial state and a snapshot slot at every token. Equals
    ``gated_delta_rule_varlen`` on that batch (bitwise on the torch path)."""
    if backend.use_triton(v):
        return graph_ops.gdn_varlen(q, k, v, g, beta, states, cu_seqlens, slot_ids,
                                    has_initial_state, scale, use_qk_l2norm,
                                    state_dst_slots=state_dst_slots, uniform_len=seq_len)
    if backend.use_native(v):
        return gated_delta_rule_verify_cpu(q, k, v, g, beta, states, cu_seqlens, slot_ids, state_dst_slots,
                                           seq_len, scale, use_qk_l2norm)
    return gated_delta_rule_verify_torch(q, k, v, g, beta, states, slot_ids, state_dst_slots,
                                         seq_len, scale, use_qk_l2norm)

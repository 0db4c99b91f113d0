"""Gated DeltaNet (Qwen3-Next linear attention) over a flat varlen batch with a state pool.

Per value head, with state S [K, V] (HF/FLA layout), q/k l2-normalised over K and q scaled:

    S'    = exp(g_t) * S_{t-1}                  (decay; g_t <= 0 is a log decay)
    u_t   = beta_t * (v_t - S'^T k_t)           (delta rule: write only what S' mispredicts)
    S_t   = S' + k_t u_t^T
    o_t   = S_t^T q_t

Files (the fla template): ``reference`` (torch: the ground truth and the CPU path),
``triton_recurrent`` (fused per-token kernel: decode and speculative verify, snapshot after
any token), ``triton_chunk`` (chunked WY prefill), ``triton_varlen`` (the launcher).
``kernels.backend`` picks one per call.
"""
from __future__ import annotations

from torch import Tensor

from kernels import backend
from kernels.gdn.reference import gated_delta_rule_varlen_torch, l2norm

__all__ = ["gated_delta_rule_varlen", "l2norm"]


def gated_delta_rule_varlen(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                            states: Tensor, cu_seqlens: Tensor, slot_ids: Tensor,
                            has_initial_state: Tensor, scale: float | None = None,
                            use_qk_l2norm: bool = True, chunk_size: int = 64,
                            state_dst_slots: Tensor | None = None) -> Tensor:
    """q, k [T, Hk, K]; v [T, H, V]; g, beta [T, H]; states [S, H, K, V] -> o [T, H, V].

    ``scale`` defaults to K**-0.5. Updates ``states`` in place (live and snapshot slots).
    """
    if backend.use_triton(v):
        from kernels.gdn.triton_varlen import gated_delta_rule_varlen_triton
        return gated_delta_rule_varlen_triton(q, k, v, g, beta, states, cu_seqlens, slot_ids,
                                              has_initial_state, scale, use_qk_l2norm,
                                              chunk_size, state_dst_slots)
    return gated_delta_rule_varlen_torch(q, k, v, g, beta, states, cu_seqlens, slot_ids,
                                         has_initial_state, scale, use_qk_l2norm, chunk_size,
                                         state_dst_slots)

"""Gated DeltaNet (Qwen3-Next linear attention) over a flat varlen batch with a state pool.

Per value head, with state S [K, V] (HF/FLA layout), q/k l2-normalised over K and q scaled:

    S'    = exp(g_t) * S_{t-1}                  (decay; g_t <= 0 is a log decay)
    u_t   = beta_t * (v_t - S'^T k_t)           (delta rule: write only what S' mispredicts)
    S_t   = S' + k_t u_t^T
    o_t   = S_t^T q_t

Files (the fla template): ``reference`` (torch: the ground truth, with a decode and a verify
form that skip the varlen planning), ``cpu`` (the CPU path: every token through the
recurrence in C++, ``kernels/native_gdn.cpp``), ``triton_recurrent`` (fused per-token kernel:
decode and speculative verify, snapshot after any token), ``triton_chunk`` (chunked WY
prefill), ``triton_varlen`` (the launcher). ``kernels.backend`` picks one per call, and that
backend the form ``seqs.path`` allows.
"""

from __future__ import annotations

from torch import Tensor

from kernels import backend, graph_ops
from kernels.gdn.cpu import gated_delta_rule_cpu
from kernels.gdn.reference import gated_delta_rule_torch, l2norm
from kernels.recurrent_batch import RecurrentBatch

__all__ = ["gated_delta_rule", "l2norm"]


def gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    states: Tensor,
    seqs: RecurrentBatch,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
) -> Tensor:
    """q, k [T, Hk, K]; v [T, H, V]; g, beta [T, H]; states [S, H, K, V] -> o [T, H, V].

    ``scale`` defaults to K**-0.5. Updates ``states`` in place (live and snapshot slots).
    """
    if backend.use_triton(v):
        return graph_ops.gdn(q, k, v, g, beta, states, seqs, scale, use_qk_l2norm, chunk_size)
    run = gated_delta_rule_cpu if backend.use_native(v) else gated_delta_rule_torch
    return run(q, k, v, g, beta, states, seqs, scale, use_qk_l2norm, chunk_size)

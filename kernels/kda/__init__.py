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

``kimi_delta_attention`` is the op; the backend runs the form ``seqs.path`` allows (the reference has a decode
and a verify form besides the varlen one; Triton one launcher for all).
"""

from __future__ import annotations

from torch import Tensor

from kernels import backend, graph_ops
from kernels.kda.reference import DEFAULT_CHUNK, kda_torch
from kernels.recurrent_batch import RecurrentBatch

__all__ = ["kimi_delta_attention"]


def kimi_delta_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    states: Tensor,
    seqs: RecurrentBatch,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    chunk_size: int = DEFAULT_CHUNK,
) -> Tensor:
    """q, k, g [T, H, K]; v [T, H, V]; beta [T, H]; states [S, H, K, V] -> o [T, H, V].

    Updates ``states`` in place (live and snapshot slots); see ``kernels`` for the contract.
    """
    if backend.use_triton(v):
        return graph_ops.kda(q, k, v, g, beta, states, seqs, scale, use_qk_l2norm, chunk_size)
    return kda_torch(q, k, v, g, beta, states, seqs, scale, use_qk_l2norm, chunk_size)

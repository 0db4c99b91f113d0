"""Lightning attention (MiniMax's linear attention) over a flat varlen batch with a state pool.

Per head h, with a constant per-head decay rate s_h > 0 (MiniMax's ``slope_rate``) and no
normalisation of q or k, transformers keeps KV [K, V] and computes

    KV_t = exp(-s_h) KV_{t-1} + k_t^T v_t,      o_t = q_t KV_t

(its blocked prefill, ``query_decay`` / ``key_decay`` / ``diagonal_decay`` over blocks of
``block_size`` tokens, is the same sum reordered). That is exactly Mamba2's SSD recurrence
with x = v (P = V), B = k and C = q (N = K, one group per head), a step size dt' = 1,
A = -s_h and no skip (D = 0), on the transposed state S = KV^T [V, K]:

    S_t = exp(dt' A) S_{t-1} + dt' x_t B_t^T,    y_t = S_t C_t.

So this op is ``kernels.ssd`` with those arguments, on the torch path (the per-token
recurrence and the chunked form) and on the Triton path (selective state update and the
chunked kernels) alike, slot-indexed, with ``has_initial_state`` and per-token snapshots,
and the pool's state per slot is [H, V, K] fp32. There is no conv state.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels.recurrent_batch import RecurrentBatch
from kernels.ssd import ssd_scan

__all__ = ["lightning_attention", "state_shape"]

# The chunk length of the SSD form; the result does not depend on it.
CHUNK_SIZE = 64


def state_shape(num_heads: int, head_dim: int, v_head_dim: int | None = None) -> tuple[int, int, int]:
    """The per-slot state of one layer: [H, V, K] (the transposed KV)."""
    return (num_heads, head_dim if v_head_dim is None else v_head_dim, head_dim)


def _ssd_args(q: Tensor, k: Tensor, slope: Tensor, states: Tensor) -> tuple[Tensor, ...]:
    """dt [T, H] of ones, A = -slope, D = dt_bias = 0 [H]; validates the shapes."""
    num_tokens, num_heads, k_dim = q.shape
    if (
        k.shape != q.shape
        or slope.shape != (num_heads,)
        or states.dim() != 4
        or states.shape[1] != num_heads
        or states.shape[3] != k_dim
    ):
        raise ValueError(
            f"shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, "
            f"slope {tuple(slope.shape)}, states {tuple(states.shape)} "
            "(expected states [S, H, V, K])"
        )
    f32 = dict(dtype=torch.float32, device=q.device)
    zeros = torch.zeros(num_heads, **f32)
    return torch.ones(num_tokens, num_heads, **f32), -slope.float(), zeros, zeros


def lightning_attention(q: Tensor, k: Tensor, v: Tensor, slope: Tensor, states: Tensor, seqs: RecurrentBatch) -> Tensor:
    """q, k [T, H, K]; v [T, H, V]; slope [H] (> 0); states [S, H, V, K] -> o [T, H, V].

    Updates ``states`` in place (live and snapshot slots); see ``kernels`` for the contract.
    """
    dt, a, d, dt_bias = _ssd_args(q, k, slope, states)
    return ssd_scan(v, dt, a, k, q, d, dt_bias, states, seqs, dt_softplus=False, chunk_size=CHUNK_SIZE)

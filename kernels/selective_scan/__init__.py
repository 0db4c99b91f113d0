"""Mamba1 selective scan (Jamba) over a flat varlen batch with a state pool.

H channels (d_inner), state S [H, N] per slot, B and C [N] per token shared by every channel
(or [G, N]: G groups of H / G channels, each group its own row; Zamba's Mamba heads):

    dt'_t = softplus(dt_t + dt_bias)                  (softplus only if dt_softplus)
    S_t   = exp(dt'_t[:, None] * A) * S_{t-1} + (dt'_t * x_t)[:, None] * B_t[None, :]
    y_t   = S_t C_t + D * x_t

Files (the template of ``kernels.ssd``): ``reference`` (torch: the ground truth and the CPU
path), ``triton_recurrent`` (per-token kernel: decode, speculative verify and short chunks,
snapshot after any token), ``triton_chunk`` (chunked prefill: an associative scan within each
chunk), ``triton_varlen`` (the launcher). ``kernels.backend`` picks one per call. The gate
Jamba applies afterwards (``y * silu(z)``) and the conv before stay outside (the conv is
``kernels.conv1d``).

``mamba_selective_scan`` is the op; the backend runs the form ``seqs.path`` allows (the
reference has a one-step decode form besides the varlen one; Triton one launcher for all).
"""

from __future__ import annotations

from torch import Tensor

from kernels import backend, graph_ops
from kernels.recurrent_batch import RecurrentBatch
from kernels.selective_scan.reference import discretize_dt, mamba_selective_scan_torch

__all__ = ["discretize_dt", "mamba_selective_scan"]


def mamba_selective_scan(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None,
    dt_bias: Tensor | None,
    states: Tensor,
    seqs: RecurrentBatch,
    dt_softplus: bool = True,
    chunk_size: int = 64,
) -> Tensor:
    """x, dt [T, H] (dt raw); A [H, N]; B, C [T, N] or [T, G, N]; D, dt_bias [H] or None;
    states [S, H, N] -> y [T, H] in x.dtype. Updates ``states`` in place (live and snapshot
    slots). ``chunk_size`` picks the chunk of the chunked path (the result does not depend
    on it beyond rounding)."""
    if backend.use_triton(x):
        return graph_ops.selective_scan(x, dt, A, B, C, D, dt_bias, states, seqs, dt_softplus, chunk_size)
    return mamba_selective_scan_torch(x, dt, A, B, C, D, dt_bias, states, seqs, dt_softplus, chunk_size)

"""Mamba2 SSD (Granite-4.0-H, Nemotron-H, Bamba) over a flat varlen batch with a state pool.

Per head h, state S [P, N], group of the head ``h // (H // G)``:

    dt'_t = clamp(softplus(dt_t + dt_bias), *dt_limit)     (softplus only if dt_softplus)
    S_t   = exp(dt'_t * A) * S_{t-1} + dt'_t * x_t B_t^T
    y_t   = S_t C_t + D * x_t

Files: ``reference`` (torch: the ground truth), ``cpu`` (the CPU path: every token through
the recurrence in C++, ``kernels/native_ssd.cpp``), ``triton_recurrent``
(selective state update over short sequences: decode and speculative verify, snapshot after
any token), ``triton_chunk`` (chunked prefill), ``triton_varlen`` (the launcher).
``kernels.backend`` picks one per call.

``ssd_scan`` is the op; the backend runs the form ``seqs.path`` allows (the reference has a decode
and a verify form besides the varlen one; the C++ loop and Triton one entry for all).
"""

from __future__ import annotations

from torch import Tensor

from kernels import backend, graph_ops
from kernels.recurrent_batch import RecurrentBatch
from kernels.ssd.cpu import ssd_cpu
from kernels.ssd.reference import discretize_dt, ssd_torch

__all__ = ["discretize_dt", "ssd_scan"]


def ssd_scan(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor,
    dt_bias: Tensor,
    states: Tensor,
    seqs: RecurrentBatch,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    chunk_size: int = 256,
) -> Tensor:
    """x [T, H, P]; dt [T, H] raw; A, D, dt_bias [H]; B, C [T, G, N]; states [S, H, P, N].

    Returns y [T, H, P] in x.dtype; updates ``states`` in place (live and snapshot slots).
    """
    if backend.use_triton(x):
        return graph_ops.ssd(x, dt, A, B, C, D, dt_bias, states, seqs, dt_softplus, dt_limit, chunk_size)
    run = ssd_cpu if backend.use_native(x) else ssd_torch
    return run(x, dt, A, B, C, D, dt_bias, states, seqs, dt_softplus, dt_limit, chunk_size)

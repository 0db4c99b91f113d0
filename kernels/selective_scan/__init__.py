"""Mamba1 selective scan (Jamba) over a flat varlen batch with a state pool.

H channels (d_inner), state S [H, N] per slot, B and C [N] per token shared by every channel:

    dt'_t = softplus(dt_t + dt_bias)                  (softplus only if dt_softplus)
    S_t   = exp(dt'_t[:, None] * A) * S_{t-1} + (dt'_t * x_t)[:, None] * B_t[None, :]
    y_t   = S_t C_t + D * x_t

Files (the template of ``kernels.ssd``): ``reference`` (torch: the ground truth and the CPU
path), ``triton_recurrent`` (per-token kernel: decode, speculative verify and short chunks,
snapshot after any token), ``triton_chunk`` (chunked prefill: an associative scan within each
chunk), ``triton_varlen`` (the launcher). ``kernels.backend`` picks one per call. The gate
Jamba applies afterwards (``y * silu(z)``) and the conv before stay outside (the conv is
``kernels.conv1d``).

``selective_scan_update`` is the decode fast path (one token per sequence, every initial
state present, no snapshots): on the torch path a single step with one gather and one
scatter of the live states; on Triton the per-token kernel over the one-token layout
(``kernels.unit_layout``).
"""
from __future__ import annotations

from torch import Tensor

from kernels import backend, graph_ops, unit_layout
from kernels.selective_scan.reference import (discretize_dt, selective_scan_update_torch,
                                              selective_scan_varlen_torch)

__all__ = ["discretize_dt", "selective_scan_update", "selective_scan_varlen"]


def selective_scan_varlen(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                          D: Tensor | None, dt_bias: Tensor | None, states: Tensor,
                          cu_seqlens: Tensor, slot_ids: Tensor, has_initial_state: Tensor,
                          dt_softplus: bool = True, chunk_size: int = 64,
                          state_dst_slots: Tensor | None = None) -> Tensor:
    """x, dt [T, H] (dt raw); A [H, N]; B, C [T, N]; D, dt_bias [H] or None;
    states [S, H, N] -> y [T, H] in x.dtype. Updates ``states`` in place (live and snapshot
    slots). ``chunk_size`` picks the chunk of the chunked path (the result does not depend
    on it beyond rounding)."""
    if backend.use_triton(x):
        return graph_ops.selective_scan_varlen(x, dt, A, B, C, D, dt_bias, states, cu_seqlens,
                                               slot_ids, has_initial_state, dt_softplus,
                                               chunk_size, state_dst_slots)
    return selective_scan_varlen_torch(x, dt, A, B, C, D, dt_bias, states, cu_seqlens, slot_ids,
                                       has_initial_state, dt_softplus, chunk_size,
                                       state_dst_slots)


def selective_scan_update(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                          D: Tensor | None, dt_bias: Tensor | None, states: Tensor,
                          slot_ids: Tensor, dt_softplus: bool = True) -> Tensor:
    """Decode fast path, one token per sequence: x, dt [B, H]; B, C [B, N]; states [S, H, N]
    -> y [B, H] (x.dtype). Reads and updates the live slots in place.

    Equals ``selective_scan_varlen`` with every length 1, every initial state present and no
    snapshot slots (bitwise on the torch path: the same step function).
    """
    if backend.use_triton(x):
        cu_seqlens, has_initial_state = unit_layout(slot_ids)
        return graph_ops.selective_scan_varlen(x, dt, A, B, C, D, dt_bias, states, cu_seqlens,
                                               slot_ids, has_initial_state, dt_softplus,
                                               uniform_len=1)
    return selective_scan_update_torch(x, dt, A, B, C, D, dt_bias, states, slot_ids, dt_softplus)

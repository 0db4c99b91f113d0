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

``ssd_update`` is the decode fast path (one token per sequence, every initial state present,
no snapshots): on the torch path a single step with one gather and one scatter of the live
states; on Triton the selective state update kernel over the one-token layout
(``kernels.unit_layout``).
"""
from __future__ import annotations

from torch import Tensor

from kernels import backend, graph_ops, unit_layout
from kernels.ssd.cpu import ssd_update_cpu, ssd_varlen_cpu, ssd_verify_cpu
from kernels.ssd.reference import discretize_dt, ssd_update_torch, ssd_varlen_torch, ssd_verify_torch

__all__ = ["discretize_dt", "ssd_update", "ssd_varlen", "ssd_verify"]


def ssd_varlen(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor,
               dt_bias: Tensor, states: Tensor, cu_seqlens: Tensor, slot_ids: Tensor,
               has_initial_state: Tensor, dt_softplus: bool = True,
               dt_limit: tuple[float, float] = (0.0, float("inf")), chunk_size: int = 256,
               state_dst_slots: Tensor | None = None) -> Tensor:
    """x [T, H, P]; dt [T, H] raw; A, D, dt_bias [H]; B, C [T, G, N]; states [S, H, P, N].

    Returns y [T, H, P] in x.dtype; updates ``states`` in place (live and snapshot slots).
    """
    if backend.use_triton(x):
        return graph_ops.ssd_varlen(x, dt, A, B, C, D, dt_bias, states, cu_seqlens, slot_ids,
                                    has_initial_state, dt_softplus, dt_limit, chunk_size,
                                    state_dst_slots)
    if backend.use_native(x):
        return ssd_varlen_cpu(x, dt, A, B, C, D, dt_bias, states, cu_seqlens, slot_ids, has_initial_state,
                              dt_softplus, dt_limit, chunk_size, state_dst_slots)
    return ssd_varlen_torch(x, dt, A, B, C, D, dt_bias, states, cu_seqlens, slot_ids,
                            has_initial_state, dt_softplus, dt_limit, chunk_size, state_dst_slots)


def ssd_update(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor,
               dt_bias: Tensor, states: Tensor, slot_ids: Tensor, dt_softplus: bool = True,
               dt_limit: tuple[float, float] = (0.0, float("inf"))) -> Tensor:
    """Decode fast path, one token per sequence: x [B, H, P]; dt [B, H] raw; B, C [B, G, N];
    states [S, H, P, N] -> y [B, H, P] (x.dtype). Reads and updates the live slots in place.

    Equals ``ssd_varlen`` with every length 1, every initial state present and no snapshot
    slots (bitwise on the torch path: the same step function).
    """
    if backend.use_triton(x):
        cu_seqlens, has_initial_state = unit_layout(slot_ids)
        return graph_ops.ssd_varlen(x, dt, A, B, C, D, dt_bias, states, cu_seqlens, slot_ids,
                                    has_initial_state, dt_softplus, dt_limit, uniform_len=1)
    if backend.use_native(x):
        return ssd_update_cpu(x, dt, A, B, C, D, dt_bias, states, slot_ids, dt_softplus, dt_limit)
    return ssd_update_torch(x, dt, A, B, C, D, dt_bias, states, slot_ids, dt_softplus, dt_limit)


def ssd_verify(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor,
               dt_bias: Tensor, states: Tensor, cu_seqlens: Tensor, slot_ids: Tensor,
               has_initial_state: Tensor, state_dst_slots: Tensor, seq_len: int,
               dt_softplus: bool = True,
               dt_limit: tuple[float, float] = (0.0, float("inf"))) -> Tensor:
    """Speculative-verify fast path (``ForwardBatch.verify_len``): every sequence has
    ``seq_len`` tokens, an initial state and a snapshot slot at every token. Equals
    ``ssd_varlen`` on that batch (bitwise on the torch path)."""
    if backend.use_triton(x):
        return graph_ops.ssd_varlen(x, dt, A, B, C, D, dt_bias, states, cu_seqlens, slot_ids,
                                    has_initial_state, dt_softplus, dt_limit,
                                    state_dst_slots=state_dst_slots, uniform_len=seq_len)
    if backend.use_native(x):
        return ssd_verify_cpu(x, dt, A, B, C, D, dt_bias, states, cu_seqlens, slot_ids, state_dst_slots, seq_len,
                              dt_softplus, dt_limit)
    return ssd_verify_torch(x, dt, A, B, C, D, dt_bias, states, slot_ids, state_dst_slots,
                            seq_len, dt_softplus, dt_limit)

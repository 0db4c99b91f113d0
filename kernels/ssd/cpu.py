"""Mamba2 SSD on CPU: every token through the C++ recurrence of ``kernels/native_ssd.cpp``.

Under the ``auto`` backend a CPU batch of any kind -- decode, speculative verify, prefill and
mixed (``ssd_varlen``) -- is one call of ``hybridserve_native::ssd_recurrent`` on the pool,
in place (each sequence's state read once and written once, snapshots from the loop), then
the D skip. dt' (``reference.discretize_dt``'s rule) and exp(dt' A) are taken in the loop,
one scalar formula for each (ATen's softplus takes another for a vectorised loop's ragged
end), so a token gets the same bits whichever kind of batch computes it. The reference's
bits (MKL's products, a chunked form for long segments) are within a tolerance
(``tests/kernels/test_ssd_native.py``). Where the native ops do not build, or autograd must
see the op, the torch reference runs.
"""
from __future__ import annotations

import torch
from torch import Tensor

from kernels import native_ops
from kernels.ssd.reference import check_shapes, ssd_update_torch, ssd_varlen_torch, ssd_verify_torch


def usable(states: Tensor, *inputs: Tensor) -> bool:
    """The native loop's conditions (``native_ops.usable``) on a pool of [S, H, P, N] states."""
    return states.dim() == 4 and native_ops.usable(states, *inputs)


def ssd_varlen_cpu(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor, dt_bias: Tensor,
                   states: Tensor, cu_seqlens: Tensor, slot_ids: Tensor, has_initial_state: Tensor,
                   dt_softplus: bool, dt_limit: tuple[float, float], chunk_size: int,
                   state_dst_slots: Tensor | None) -> Tensor:
    """``kernels.ssd.ssd_varlen`` on CPU (shapes there; ``chunk_size`` is the reference's)."""
    if not usable(states, x, dt, A, B, C, D, dt_bias):
        return ssd_varlen_torch(x, dt, A, B, C, D, dt_bias, states, cu_seqlens, slot_ids, has_initial_state,
                                dt_softplus, dt_limit, chunk_size, state_dst_slots)
    return _native(x, dt, A, B, C, D, dt_bias, states, cu_seqlens, slot_ids, has_initial_state,
                   state_dst_slots, dt_softplus, dt_limit)


def ssd_update_cpu(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor, dt_bias: Tensor,
                   states: Tensor, slot_ids: Tensor, dt_softplus: bool, dt_limit: tuple[float, float]) -> Tensor:
    """``kernels.ssd.ssd_update`` on CPU (shapes there)."""
    if not usable(states, x, dt, A, B, C, D, dt_bias):
        return ssd_update_torch(x, dt, A, B, C, D, dt_bias, states, slot_ids, dt_softplus, dt_limit)
    cu_seqlens = torch.arange(slot_ids.shape[0] + 1, dtype=torch.int32, device=x.device)
    return _native(x, dt, A, B, C, D, dt_bias, states, cu_seqlens, slot_ids, None, None, dt_softplus, dt_limit)


def ssd_verify_cpu(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor, dt_bias: Tensor,
                   states: Tensor, cu_seqlens: Tensor, slot_ids: Tensor, state_dst_slots: Tensor, seq_len: int,
                   dt_softplus: bool, dt_limit: tuple[float, float]) -> Tensor:
    """``kernels.ssd.ssd_verify`` on CPU (shapes there)."""
    if not usable(states, x, dt, A, B, C, D, dt_bias):
        return ssd_verify_torch(x, dt, A, B, C, D, dt_bias, states, slot_ids, state_dst_slots, seq_len,
                                dt_softplus, dt_limit)
    return _native(x, dt, A, B, C, D, dt_bias, states, cu_seqlens, slot_ids, None, state_dst_slots,
                   dt_softplus, dt_limit)


def _native(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor, dt_bias: Tensor, states: Tensor,
            cu_seqlens: Tensor, slot_ids: Tensor, has_initial_state: Tensor | None,
            state_dst_slots: Tensor | None, dt_softplus: bool, dt_limit: tuple[float, float]) -> Tensor:
    check_shapes(x, dt, B, C, states)
    xf = x.float().contiguous()
    y = torch.ops.hybridserve_native.ssd_recurrent(
        states, cu_seqlens, slot_ids, has_initial_state, state_dst_slots, xf, dt.float().contiguous(),
        dt_bias.float().contiguous(), A.float().contiguous(), B.float().contiguous(), C.float().contiguous(),
        dt_softplus, float(dt_limit[0]), float(dt_limit[1]))
    return (y + D.float()[:, None] * xf).to(x.dtype)

"""Mamba2 SSD on CPU: every token through the C++ recurrence of ``kernels/native_ssd.cpp``.

Under the ``auto`` backend a CPU batch of any kind -- decode, speculative verify, prefill and
mixed -- is one call of ``hybridserve_native::ssd_recurrent`` on the pool,
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
from kernels.recurrent_batch import RecurrentBatch
from kernels.ssd.reference import check_shapes, ssd_torch


def usable(states: Tensor, *inputs: Tensor) -> bool:
    """The native loop's conditions (``native_ops.usable``) on a pool of [S, H, P, N] states."""
    return states.dim() == 4 and native_ops.usable(states, *inputs)


def ssd_cpu(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor,
    dt_bias: Tensor,
    states: Tensor,
    seqs: RecurrentBatch,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
    chunk_size: int,
) -> Tensor:
    """``kernels.ssd.ssd`` on CPU (shapes there): one loop for every path (``chunk_size`` is
    the reference's)."""
    if not usable(states, x, dt, A, B, C, D, dt_bias):
        return ssd_torch(x, dt, A, B, C, D, dt_bias, states, seqs, dt_softplus, dt_limit, chunk_size)
    return _native(
        x,
        dt,
        A,
        B,
        C,
        D,
        dt_bias,
        states,
        seqs.cu_seqlens,
        seqs.slot_ids,
        seqs.initial_flags,
        seqs.state_dst_slots,
        dt_softplus,
        dt_limit,
    )


def _native(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor,
    dt_bias: Tensor,
    states: Tensor,
    cu_seqlens: Tensor,
    slot_ids: Tensor,
    has_initial_state: Tensor | None,
    state_dst_slots: Tensor | None,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
) -> Tensor:
    check_shapes(x, dt, B, C, states)
    xf = x.float().contiguous()
    y = torch.ops.hybridserve_native.ssd_recurrent(
        states,
        cu_seqlens,
        slot_ids,
        has_initial_state,
        state_dst_slots,
        xf,
        dt.float().contiguous(),
        dt_bias.float().contiguous(),
        A.float().contiguous(),
        B.float().contiguous(),
        C.float().contiguous(),
        dt_softplus,
        float(dt_limit[0]),
        float(dt_limit[1]),
    )
    return (y + D.float()[:, None] * xf).to(x.dtype)

"""Depthwise causal conv1d on CPU: one C++ pass over the rows (``kernels/native_conv.cpp``).

Under the ``auto`` backend every CPU conv batch -- decode, speculative verify, prefill and
mixed -- is one call of ``hybridserve_native::causal_conv1d`` on the state pool, in place
(initial inputs, live and snapshot windows as the module docstring of ``kernels.conv1d``
says), its SiLU included (one formula for every element: ATen's takes another for the ragged
end of a vectorised loop). Each output element is the same chain of operations wherever its
row sits, so a token's conv gets the same bits in any kind of batch; the reference's (no FMA,
ATen's silu) are within a tolerance (``tests/kernels/test_conv1d_native.py``).
Where the native ops do not build, or autograd must see the op, the torch reference runs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels import native_ops
from kernels.conv1d.reference import causal_conv1d_torch, check_shapes
from kernels.recurrent_batch import RecurrentBatch

MAX_WIDTH = 16


def usable(x: Tensor, weight: Tensor, bias: Tensor | None, conv_states: Tensor) -> bool:
    """The native loop's conditions (``native_ops.usable``) on a pool of [S, D, W-1] states,
    with a kernel of 2..16 taps."""
    return (
        conv_states.dim() == 3
        and 2 <= weight.shape[-1] <= MAX_WIDTH
        and native_ops.usable(conv_states, x, weight, bias)
    )


def causal_conv1d_cpu(
    x: Tensor, weight: Tensor, bias: Tensor | None, conv_states: Tensor, seqs: RecurrentBatch, activation: str | None
) -> Tensor:
    """``kernels.conv1d.causal_conv1d`` on CPU (shapes there): one pass for every path."""
    if not usable(x, weight, bias, conv_states):
        return causal_conv1d_torch(x, weight, bias, conv_states, seqs, activation)
    return _native(
        x,
        weight,
        bias,
        conv_states,
        seqs.cu_seqlens,
        seqs.slot_ids,
        seqs.initial_flags,
        seqs.state_dst_slots,
        activation,
    )


def _native(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    conv_states: Tensor,
    cu_seqlens: Tensor,
    slot_ids: Tensor,
    has_initial_state: Tensor | None,
    state_dst_slots: Tensor | None,
    activation: str | None,
) -> Tensor:
    check_shapes(x, weight, conv_states, activation)
    out = torch.ops.hybridserve_native.causal_conv1d(
        conv_states,
        cu_seqlens,
        slot_ids,
        has_initial_state,
        state_dst_slots,
        x.float().contiguous(),
        weight,
        bias,
        activation is not None,
    )
    return out.to(x.dtype)

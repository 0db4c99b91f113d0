"""Depthwise causal conv1d over a flat varlen batch, with conv states in a slot pool.

Sequence b is convolved over ``initial W-1 inputs ++ x_b`` (the initial inputs come from
``conv_states[slot_ids[b]]`` when ``has_initial_state[b]``, else zeros). Afterwards the live
slot holds the last W-1 *pre-activation inputs*, oldest first; snapshot slots
(``state_dst_slots``) get the W-1 inputs ending at their token.

Files: ``reference`` (torch: the ground truth), ``cpu`` (the CPU path: one C++ pass over the
rows, ``kernels/native_conv.cpp``), ``triton_conv`` (varlen prefill/verify, state writes, and
the one-token update). ``kernels.backend`` picks one.
"""
from __future__ import annotations

from torch import Tensor

from kernels import backend, graph_ops
from kernels.conv1d.cpu import causal_conv1d_update_cpu, causal_conv1d_varlen_cpu, causal_conv1d_verify_cpu
from kernels.conv1d.reference import (causal_conv1d_update_torch, causal_conv1d_varlen_torch,
                                      causal_conv1d_verify_torch)

__all__ = ["causal_conv1d_update", "causal_conv1d_varlen", "causal_conv1d_verify"]


def causal_conv1d_varlen(x: Tensor, weight: Tensor, bias: Tensor | None, conv_states: Tensor,
                         cu_seqlens: Tensor, slot_ids: Tensor, has_initial_state: Tensor,
                         activation: str | None = "silu",
                         state_dst_slots: Tensor | None = None) -> Tensor:
    """x [T, D], weight [D, W], bias [D] | None, conv_states [S, D, W-1] -> [T, D] (x.dtype).

    Updates ``conv_states`` in place (see module docstring).
    """
    if backend.use_triton(x):
        return graph_ops.conv1d_varlen(x, weight, bias, conv_states, cu_seqlens, slot_ids,
                                       has_initial_state, activation, state_dst_slots)
    if backend.use_native(x):
        return causal_conv1d_varlen_cpu(x, weight, bias, conv_states, cu_seqlens, slot_ids, has_initial_state,
                                        activation, state_dst_slots)
    return causal_conv1d_varlen_torch(x, weight, bias, conv_states, cu_seqlens, slot_ids,
                                      has_initial_state, activation, state_dst_slots)


def causal_conv1d_update(x: Tensor, weight: Tensor, bias: Tensor | None, conv_states: Tensor,
                         slot_ids: Tensor, activation: str | None = "silu") -> Tensor:
    """Decode fast path, one token per sequence: x [B, D] -> [B, D] (x.dtype).

    Equals ``causal_conv1d_varlen`` with every length 1 and every initial state present.
    """
    if backend.use_triton(x):
        return graph_ops.conv1d_update(x, weight, bias, conv_states, slot_ids, activation)
    if backend.use_native(x):
        return causal_conv1d_update_cpu(x, weight, bias, conv_states, slot_ids, activation)
    return causal_conv1d_update_torch(x, weight, bias, conv_states, slot_ids, activation)


def causal_conv1d_verify(x: Tensor, weight: Tensor, bias: Tensor | None, conv_states: Tensor,
                         cu_seqlens: Tensor, slot_ids: Tensor, has_initial_state: Tensor,
                         state_dst_slots: Tensor, seq_len: int, activation: str | None = "silu") -> Tensor:
    """Speculative-verify fast path: every sequence has ``seq_len`` tokens, an initial state
    and a snapshot slot at every token (``ForwardBatch.verify_len``). Equals
    ``causal_conv1d_varlen`` on that batch (bitwise on the torch path)."""
    if backend.use_triton(x):
        return causal_conv1d_varlen(x, weight, bias, conv_states, cu_seqlens, slot_ids,
                                    has_initial_state, activation, state_dst_slots)
    if backend.use_native(x):
        return causal_conv1d_verify_cpu(x, weight, bias, conv_states, cu_seqlens, slot_ids, state_dst_slots,
                                        seq_len, activation)
    return causal_conv1d_verify_torch(x, weight, bias, conv_states, slot_ids, state_dst_slots,
                                      seq_len, activation)

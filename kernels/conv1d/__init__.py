"""Depthwise causal conv1d over a flat varlen batch, with conv states in a slot pool.

Sequence b is convolved over ``initial W-1 inputs ++ x_b`` (the initial inputs come from
``conv_states[slot_ids[b]]`` when ``has_initial_state[b]``, else zeros). Afterwards the live
slot holds the last W-1 *pre-activation inputs*, oldest first; snapshot slots
(``state_dst_slots``) get the W-1 inputs ending at their token.

Files: ``reference`` (torch: the ground truth), ``cpu`` (the CPU path: one C++ pass over the
rows, ``kernels/native_conv.cpp``), ``triton_conv`` (varlen prefill/verify, state writes, and
the one-token update). ``kernels.backend`` picks one, and that backend the form
``seqs.path`` allows (the reference and Triton have a one-token decode form).
"""

from __future__ import annotations

from torch import Tensor

from kernels import backend, graph_ops
from kernels.conv1d.cpu import causal_conv1d_cpu
from kernels.conv1d.reference import causal_conv1d_torch
from kernels.recurrent_batch import RecurrentBatch

__all__ = ["causal_conv1d"]


def causal_conv1d(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    conv_states: Tensor,
    seqs: RecurrentBatch,
    activation: str | None = "silu",
) -> Tensor:
    """x [T, D], weight [D, W], bias [D] | None, conv_states [S, D, W-1] -> [T, D] (x.dtype).

    Updates ``conv_states`` in place (see module docstring).
    """
    if backend.use_triton(x):
        return graph_ops.conv1d(x, weight, bias, conv_states, seqs, activation)
    run = causal_conv1d_cpu if backend.use_native(x) else causal_conv1d_torch
    return run(x, weight, bias, conv_states, seqs, activation)

"""RG-LRU (RecurrentGemma's Real-Gated Linear Recurrent Unit) over a flat varlen batch with
a state pool: per channel ``h_t = a_t h_{t-1} + u_t`` with a_t, u_t from the input and its
two gates (the formulas: ``kernels/rglru/reference.py``).

Files: ``reference`` (torch: the ground truth and the CPU path; a one-step decode form and
the varlen form, per-token for short sequences and an associative scan within chunks for
long ones), ``triton_scan`` (one kernel for every batch: the gates, the decay and the
per-token scan fused, one program per sequence and channel block). Both write snapshot
slots (``state_dst_slots``) as every recurrent op does; ``kernels.backend`` picks one.
"""

from __future__ import annotations

from torch import Tensor

from kernels import backend, graph_ops
from kernels.recurrent_batch import RecurrentBatch
from kernels.rglru.reference import rglru_inputs, rglru_torch, softplus_scale

__all__ = ["rg_lru", "rglru_inputs", "rglru_torch", "softplus_scale"]


def rg_lru(
    x: Tensor, gx: Tensor, ga: Tensor, log_a_scale: Tensor, reset: Tensor, states: Tensor, seqs: RecurrentBatch
) -> Tensor:
    """x, gx, ga [T, C] (input, input-gate and recurrence-gate logits); log_a_scale [C]
    (``softplus_scale(recurrent_param)``); reset bool [T] (position 0); states [S, C] fp32
    -> h [T, C] in x.dtype. Updates ``states`` in place (live and snapshot slots)."""
    if backend.use_triton(x):
        return graph_ops.rglru(x, gx, ga, log_a_scale, reset, states, seqs)
    return rglru_torch(x, gx, ga, log_a_scale, reset, states, seqs)

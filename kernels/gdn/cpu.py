"""Gated DeltaNet on CPU: every token through the C++ recurrence of ``kernels/native_gdn.cpp``.

Under the ``auto`` backend a CPU batch of any kind -- decode, speculative verify, prefill
and mixed -- is one call of ``hybridserve_native::gdn_recurrent`` on the pool, in place: each
sequence's state read once and written once, snapshots copied from the loop, no chunked form.
So from the same inputs a token's recurrence gets the same bits whichever kind of batch
computes it (decode-only, verify, prefill, mixed; compiled or eager; a prefix restored from a
checkpoint or recomputed); the model's elementwise ops before it (softplus, sigmoid; the q/k
L2 norms of a compiled step) are ATen's or inductor's, whose last bits can depend on a
tensor's shape. An eager call normalises q / k with the fused C++ kernel
(``kernels.fused_cpu.l2norm_scale``: each row's bits its own).

The loop's sums are not the reference's (MKL's products, a chunked form for long segments):
``tests/kernels/test_gdn_native.py`` holds the two within a tolerance. Where the native ops
do not build (``kernels.native_ops``), or autograd must see the op, the torch reference runs.
Why a loop: at model sizes it is several times faster than the reference (BENCHMARKS.md).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels import fused_cpu, native_ops
from kernels.gdn.reference import L2NORM_EPS, check_shapes, gated_delta_rule_torch, normalized_qk
from kernels.recurrent_batch import RecurrentBatch


def usable(states: Tensor, *inputs: Tensor) -> bool:
    """The native loop's conditions (``native_ops.usable``) on a pool of [S, H, K, V] states."""
    return states.dim() == 4 and native_ops.usable(states, *inputs)


def gated_delta_rule_cpu(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    states: Tensor,
    seqs: RecurrentBatch,
    scale: float | None,
    use_qk_l2norm: bool,
    chunk_size: int,
) -> Tensor:
    """``kernels.gdn.gated_delta_rule`` on CPU (shapes there): one loop for every path
    (``chunk_size`` is the reference's; the loop has no chunks)."""
    if not usable(states, q, k, v, g, beta):
        return gated_delta_rule_torch(q, k, v, g, beta, states, seqs, scale, use_qk_l2norm, chunk_size)
    return _native(
        q,
        k,
        v,
        g,
        beta,
        states,
        seqs.cu_seqlens,
        seqs.slot_ids,
        seqs.initial_flags,
        seqs.state_dst_slots,
        scale,
        use_qk_l2norm,
    )


def _native(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    states: Tensor,
    cu_seqlens: Tensor,
    slot_ids: Tensor,
    has_initial_state: Tensor | None,
    state_dst_slots: Tensor | None,
    scale: float | None,
    use_qk_l2norm: bool,
) -> Tensor:
    check_shapes(q, k, v, g, beta, states)
    if use_qk_l2norm and fused_cpu.usable(q, k):  # eager: one pass each (kernels.fused_cpu)
        q_scale = scale if scale is not None else q.shape[-1] ** -0.5
        qf, kf = fused_cpu.l2norm_scale(q, L2NORM_EPS, q_scale), fused_cpu.l2norm_scale(k, L2NORM_EPS, 1.0)
    else:
        qf, kf = normalized_qk(q, k, scale, use_qk_l2norm)
    out = torch.ops.hybridserve_native.gdn_recurrent(
        states,
        cu_seqlens,
        slot_ids,
        has_initial_state,
        state_dst_slots,
        qf.contiguous(),
        kf.contiguous(),
        v.float().contiguous(),
        g.float().contiguous(),
        beta.float().contiguous(),
    )
    return out.to(v.dtype)

"""Gated DeltaNet on CPU: every token through the C++ recurrence of ``kernels/native_gdn.cpp``.

Under the ``auto`` backend a CPU batch of any kind -- decode, speculative verify, prefill
and mixed (``gated_delta_rule_varlen``) -- is one call of ``hybridserve_native::gdn_recurrent``
on the pool, in place: each sequence's state read once and written once, snapshots copied
from the loop, no chunked form. So from the same inputs a token's recurrence gets the same
bits whichever kind of batch computes it (decode-only, verify, prefill, mixed; compiled or
eager; a prefix restored from a checkpoint or recomputed); the model's elementwise ops
before it (softplus, sigmoid; the q/k L2 norms of a compiled step) are ATen's or inductor's,
whose last bits can depend on a tensor's shape. An eager call normalises q / k with the
fused C++ kernel (``kernels.fused_cpu.l2norm_scale``: each row's bits its own).

The loop's sums are not the reference's (MKL's products, a chunked form for long segments):
``tests/kernels/test_gdn_native.py`` holds the two within a tolerance. Where the native ops
do not build (``kernels.native_ops``), or autograd must see the op, the torch reference runs.

One layer, one thread, Intel Xeon (AVX-512), eager, native vs torch: decode of 8 / 16
sequences, 8 heads of 128 x 128 (the suite's ~100M Qwen3-Next) 272 / 522 us vs 1,812 /
4,292 us; the trained tiny model's 4 heads of 64 x 64, one sequence: decode 44 vs 87 us, a
verify of 4 rows 58 vs 261 us; a 512-token prefill of 8 heads of 128 x 128 7.8 vs 14.6 ms
(the reference's chunked form), of 4 heads of 64 x 64 0.6 vs 3.8 ms.
"""
from __future__ import annotations

import torch
from torch import Tensor

from kernels import fused_cpu, native_ops
from kernels.gdn.reference import (L2NORM_EPS, check_shapes, gated_delta_rule_update_torch,
                                   gated_delta_rule_varlen_torch, gated_delta_rule_verify_torch, normalized_qk)


def usable(states: Tensor, *inputs: Tensor) -> bool:
    """The native loop's conditions (``native_ops.usable``) on a pool of [S, H, K, V] states."""
    return states.dim() == 4 and native_ops.usable(states, *inputs)


def gated_delta_rule_update_cpu(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, states: Tensor,
                                slot_ids: Tensor, scale: float | None, use_qk_l2norm: bool) -> Tensor:
    """``kernels.gdn.gated_delta_rule_update`` on CPU (shapes there)."""
    if not usable(states, q, k, v, g, beta):
        return gated_delta_rule_update_torch(q, k, v, g, beta, states, slot_ids, scale, use_qk_l2norm)
    cu_seqlens = torch.arange(slot_ids.shape[0] + 1, dtype=torch.int32, device=v.device)
    return _native(q, k, v, g, beta, states, cu_seqlens, slot_ids, None, None, scale, use_qk_l2norm)


def gated_delta_rule_verify_cpu(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, states: Tensor,
                                cu_seqlens: Tensor, slot_ids: Tensor, state_dst_slots: Tensor, seq_len: int,
                                scale: float | None, use_qk_l2norm: bool) -> Tensor:
    """``kernels.gdn.gated_delta_rule_verify`` on CPU (shapes there)."""
    if not usable(states, q, k, v, g, beta):
        return gated_delta_rule_verify_torch(q, k, v, g, beta, states, slot_ids, state_dst_slots, seq_len,
                                             scale, use_qk_l2norm)
    return _native(q, k, v, g, beta, states, cu_seqlens, slot_ids, None, state_dst_slots, scale, use_qk_l2norm)


def gated_delta_rule_varlen_cpu(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, states: Tensor,
                                cu_seqlens: Tensor, slot_ids: Tensor, has_initial_state: Tensor,
                                scale: float | None, use_qk_l2norm: bool, chunk_size: int,
                                state_dst_slots: Tensor | None) -> Tensor:
    """``kernels.gdn.gated_delta_rule_varlen`` on CPU (shapes there; ``chunk_size`` is the
    reference's, the loop has no chunks)."""
    if not usable(states, q, k, v, g, beta):
        return gated_delta_rule_varlen_torch(q, k, v, g, beta, states, cu_seqlens, slot_ids, has_initial_state,
                                             scale, use_qk_l2norm, chunk_size, state_dst_slots)
    return _native(q, k, v, g, beta, states, cu_seqlens, slot_ids, has_initial_state, state_dst_slots, scale,
                   use_qk_l2norm)


def _native(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, states: Tensor, cu_seqlens: Tensor,
            slot_ids: Tensor, has_initial_state: Tensor | None, state_dst_slots: Tensor | None,
            scale: float | None, use_qk_l2norm: bool) -> Tensor:
    check_shapes(q, k, v, g, beta, states)
    if use_qk_l2norm and fused_cpu.usable(q, k):        # eager: one pass each (kernels.fused_cpu)
        q_scale = scale if scale is not None else q.shape[-1] ** -0.5
        qf, kf = fused_cpu.l2norm_scale(q, L2NORM_EPS, q_scale), fused_cpu.l2norm_scale(k, L2NORM_EPS, 1.0)
    else:
        qf, kf = normalized_qk(q, k, scale, use_qk_l2norm)
    out = torch.ops.hybridserve_native.gdn_recurrent(
        states, cu_seqlens, slot_ids, has_initial_state, state_dst_slots, qf.contiguous(), kf.contiguous(),
        v.float().contiguous(), g.float().contiguous(), beta.float().contiguous())
    return out.to(v.dtype)

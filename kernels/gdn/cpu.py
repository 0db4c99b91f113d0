"""Gated DeltaNet on CPU: the per-token recurrence in C++ (``kernels/native_gdn.cpp``).

Under the ``auto`` backend every per-token recurrence of a CPU batch runs the one native
loop: the decode update and the speculative verify straight on the pool (each live state
read once and written once per call, snapshots copied from the loop), and the recurrent
segments of a varlen batch on the driver's fp32 copies. So a token gets the same bits
whichever kind of batch computes it (decode-only, verify, mixed, compiled or eager), as on
the torch path; long prefill segments keep the torch chunked form (``reference.gdn_chunked``).

The loop's sums are not the reference's (MKL's products): ``tests/kernels/test_gdn_native.py``
holds the two within a tolerance. Where the native ops do not build (``kernels.native_ops``),
or autograd must see the op, the torch reference runs instead.

One layer, one thread, Intel Xeon (AVX-512), eager, best of 10 over 6 pools (native vs torch):
decode of 8 / 16 sequences, 8 heads of 128 x 128 (the suite's ~100M Qwen3-Next) 272 / 522 us
vs 1,812 / 4,292 us; the trained tiny model's 4 heads of 64 x 64, one sequence: decode 44 vs
87 us, a verify of 4 rows 58 vs 261 us.
"""
from __future__ import annotations

from functools import partial

import torch
from torch import Tensor

from kernels import native_ops, scan_varlen
from kernels.gdn.reference import (RECURRENT_MAX_LEN, check_shapes, gdn_chunked, gated_delta_rule_update_torch,
                                   gated_delta_rule_varlen_torch, gated_delta_rule_verify_torch, normalized_qk)
from kernels.static import scatter_rows_


def usable(*tensors: Tensor) -> bool:
    """Whether the native loop may run on these tensors: CPU, no autograd graph to record,
    and the native ops built (built on the first call, once per process)."""
    if any(t.device.type != "cpu" for t in tensors):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    return native_ops.loaded() or native_ops.load()


def gated_delta_rule_update_cpu(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, states: Tensor,
                                slot_ids: Tensor, scale: float | None, use_qk_l2norm: bool) -> Tensor:
    """``kernels.gdn.gated_delta_rule_update`` on CPU (shapes there)."""
    if not usable(q, k, v, g, beta, states):
        return gated_delta_rule_update_torch(q, k, v, g, beta, states, slot_ids, scale, use_qk_l2norm)
    check_shapes(q, k, v, g, beta, states)
    qf, kf = normalized_qk(q, k, scale, use_qk_l2norm)
    return _on_pool(states, slot_ids, None, qf, kf, v, g.float(), beta.float()).to(v.dtype)


def gated_delta_rule_verify_cpu(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, states: Tensor,
                                slot_ids: Tensor, state_dst_slots: Tensor, seq_len: int, scale: float | None,
                                use_qk_l2norm: bool) -> Tensor:
    """``kernels.gdn.gated_delta_rule_verify`` on CPU (shapes there)."""
    if not usable(q, k, v, g, beta, states):
        return gated_delta_rule_verify_torch(q, k, v, g, beta, states, slot_ids, state_dst_slots, seq_len,
                                             scale, use_qk_l2norm)
    check_shapes(q, k, v, g, beta, states)
    if v.shape[0] != slot_ids.shape[0] * seq_len:
        raise ValueError(f"verify: {v.shape[0]} rows for {slot_ids.shape[0]} sequences of {seq_len}")
    qf, kf = normalized_qk(q, k, scale, use_qk_l2norm)
    return _on_pool(states, slot_ids, state_dst_slots, qf, kf, v, g.float(), beta.float()).to(v.dtype)


def gated_delta_rule_varlen_cpu(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, states: Tensor,
                                cu_seqlens: Tensor, slot_ids: Tensor, has_initial_state: Tensor,
                                scale: float | None, use_qk_l2norm: bool, chunk_size: int,
                                state_dst_slots: Tensor | None) -> Tensor:
    """``kernels.gdn.gated_delta_rule_varlen`` on CPU: the reference's driver with the native
    loop as its recurrence (short sequences and short segments)."""
    if not usable(q, k, v, g, beta, states):
        return gated_delta_rule_varlen_torch(q, k, v, g, beta, states, cu_seqlens, slot_ids, has_initial_state,
                                             scale, use_qk_l2norm, chunk_size, state_dst_slots)
    check_shapes(q, k, v, g, beta, states)
    qf, kf = normalized_qk(q, k, scale, use_qk_l2norm)
    out = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    scan_varlen((qf, kf, v.float(), g.float(), beta.float()), out, states, cu_seqlens, slot_ids,
                has_initial_state, state_dst_slots, native_recurrent, partial(gdn_chunked, chunk_size=chunk_size),
                RECURRENT_MAX_LEN)
    return out.to(v.dtype)


def native_recurrent(inputs: tuple[Tensor, ...], valid: Tensor, s: Tensor,
                     on_step=None) -> tuple[Tensor, Tensor]:
    """``reference.gdn_recurrent`` through the native loop (a ``kernels.RecurrentFn``):
    q, k [n, L, Hk, K]; v [n, L, H, V]; g, beta [n, L, H]; valid [n, L] (padded steps get
    g 0 (decay 1) and beta 0: the state stays exactly as it was); s [n, H, K, V] fp32."""
    q, k, v, g, beta = inputs
    n, steps, num_heads, v_dim = v.shape
    g = torch.where(valid[..., None], g, 0.0)
    beta = torch.where(valid[..., None], beta, 0.0)
    s = s.contiguous()
    if on_step is None:
        o = _dense(s, q, k, v, g, beta)
        return o.view(n, steps, num_heads, v_dim), s
    outs = []
    for i in range(steps):                       # a snapshot after some steps: one call a step
        outs.append(_dense(s, q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i]))
        on_step(i, s)
    return torch.stack(outs, dim=1).view(n, steps, num_heads, v_dim), s


def _rows(x: Tensor, trailing: int) -> Tensor:
    """x as contiguous fp32 rows: [..., *last `trailing` dims] -> [rows, *those dims]."""
    return x.float().reshape(-1, *x.shape[x.dim() - trailing:]).contiguous()


def _dense(s: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
    """The native loop on fp32 states s [n, H, K, V] (in place); inputs of n sequences'
    rows, sequence-major (g: the log decay) -> o [rows, H, V] fp32."""
    return torch.ops.hybridserve_native.gdn_recurrent_dense(s, _rows(q, 2), _rows(k, 2), _rows(v, 2),
                                                            _rows(g, 1), _rows(beta, 1))


def _on_pool(states: Tensor, slot_ids: Tensor, dst: Tensor | None, qf: Tensor, kf: Tensor, v: Tensor,
             g: Tensor, beta: Tensor) -> Tensor:
    """B sequences of T = rows / B rows (sequence-major) from their live slots, updated in
    place; where ``dst`` [rows] is not 0 the state after that row is also written there
    -> o [rows, H, V] fp32."""
    if states.dtype == torch.float32 and states.is_contiguous():
        return torch.ops.hybridserve_native.gdn_recurrent_pool(states, slot_ids, dst, _rows(qf, 2), _rows(kf, 2),
                                                               _rows(v, 2), _rows(g, 1), _rows(beta, 1))
    # Another pool dtype: the same loop on fp32 copies of the live states, written back.
    num_seqs = slot_ids.shape[0]
    slots = slot_ids.long()
    s = states[slots].float()
    if dst is None:
        o = _dense(s, qf, kf, v, g, beta)
    else:
        steps = v.shape[0] // max(num_seqs, 1)

        def at(x: Tensor, t: int) -> Tensor:
            return x.reshape(num_seqs, steps, *x.shape[1:])[:, t]
        outs = []
        for t in range(steps):
            outs.append(_dense(s, at(qf, t), at(kf, t), at(v, t), at(g, t), at(beta, t)))
            scatter_rows_(states, at(dst, t), s)
        o = torch.stack(outs, dim=1).reshape(v.shape) if outs else v.float()
    scatter_rows_(states, slots, s)
    return o

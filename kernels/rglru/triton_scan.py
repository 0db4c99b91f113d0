"""The RG-LRU as one Triton kernel: the gates, the decay and the scan, per token.

One program per (sequence, block of BC channels) walks its sequence's tokens in order with
h [BC] fp32 in registers: read from the live slot (or zeros), written back after the last
token and, where ``state_dst_slots[t] != 0``, after token t into that slot. Per token it
computes the reference's ``rglru_inputs`` (``a = exp(scale * sigmoid(ga))``,
``u = x * sigmoid(gx) * sqrt(1 - a^2)``, position 0: a = 0 and no sqrt factor) and
``h = a h + u``. The work per token is a few pointwise ops per channel, so the one
sequential pass (no chunked form) is the whole op: decodes, verifies and prefills alike.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.launch_grid import cdiv, checked
from kernels.recurrent_batch import RecurrentBatch
from kernels.rglru.reference import check_shapes

BLOCK_C = 128


@triton.jit
def rglru_kernel(
    x, gx, ga, scale, reset, y, states,  # x, gx, ga, y [T, C]; scale [C]; reset int8 [T]; states [S, C]
    cu_seqlens, slot_ids, has_init, dst_slots,
    C: tl.constexpr, BC: tl.constexpr, HAS_DST: tl.constexpr,
):
    seq = tl.program_id(0)
    bos = tl.load(cu_seqlens + seq).to(tl.int64)
    eos = tl.load(cu_seqlens + seq + 1).to(tl.int64)
    slot = tl.load(slot_ids + seq).to(tl.int64)
    o_c = tl.program_id(1) * BC + tl.arange(0, BC)
    m = o_c < C
    b_scale = tl.load(scale + o_c, mask=m, other=0.0).to(tl.float32)
    h = tl.zeros([BC], dtype=tl.float32)
    if tl.load(has_init + seq) != 0:
        h = tl.load(states + slot * C + o_c, mask=m, other=0.0).to(tl.float32)
    for t in range(bos, eos):
        b_x = tl.load(x + t * C + o_c, mask=m, other=0.0).to(tl.float32)
        b_gx = tl.load(gx + t * C + o_c, mask=m, other=0.0).to(tl.float32)
        b_ga = tl.load(ga + t * C + o_c, mask=m, other=0.0).to(tl.float32)
        log_a = b_scale * tl.sigmoid(b_ga)
        keep = tl.load(reset + t) == 0
        a = tl.where(keep, tl.exp(log_a), 0.0)
        mult = tl.where(keep, tl.sqrt(1.0 - tl.exp(2.0 * log_a)), 1.0)
        h = a * h + b_x * tl.sigmoid(b_gx) * mult
        tl.store(y + t * C + o_c, h.to(y.dtype.element_ty), mask=m)
        if HAS_DST:
            dst = tl.load(dst_slots + t).to(tl.int64)
            if dst != 0:
                tl.store(states + dst * C + o_c, h.to(states.dtype.element_ty), mask=m)
    if eos > bos:
        tl.store(states + slot * C + o_c, h.to(states.dtype.element_ty), mask=m)


def rglru_triton(
    x: Tensor, gx: Tensor, ga: Tensor, log_a_scale: Tensor, reset: Tensor, states: Tensor, seqs: RecurrentBatch
) -> Tensor:
    """Contract of ``kernels.rglru.rg_lru``."""
    check_shapes(x, gx, ga, log_a_scale, states)
    if not states.is_contiguous():
        raise ValueError("the state pool must be contiguous (it is updated in place)")
    channels, device = x.shape[-1], x.device
    x, gx, ga = (t.contiguous() for t in (x, gx, ga))
    scale = log_a_scale.to(device=device, dtype=torch.float32).contiguous()
    y = torch.empty_like(x)
    num_seqs = seqs.slot_ids.shape[0]
    if x.shape[0] == 0 or num_seqs == 0:
        return y

    def int32(t: Tensor) -> Tensor:
        return t.to(device=device, dtype=torch.int32)

    cu = int32(seqs.cu_seqlens)
    dst = seqs.state_dst_slots
    grid = checked((num_seqs, cdiv(channels, BLOCK_C)), "rglru")
    rglru_kernel[grid](
        x, gx, ga, scale, reset.to(device=device, dtype=torch.int8), y, states,
        cu, int32(seqs.slot_ids), int32(seqs.has_initial_state), cu if dst is None else int32(dst),
        C=channels, BC=BLOCK_C, HAS_DST=dst is not None, num_warps=4,
    )
    return y

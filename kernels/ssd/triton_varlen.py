"""Launcher of the Triton Mamba2 SSD path (the contract of ``kernels.ssd``'s op).

Short sequences (``<= recurrent_max_len`` tokens) take one selective-state-update launch;
long ones the two chunked kernels over a chunk table cut at snapshot tokens
(``kernels.chunking``). The groups touch disjoint slots, so the launch order is free.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from kernels.chunking import ChunkTable, block_size, varlen_launch
from kernels.launch_grid import chunk_head_grid, seq_head_grid
from kernels.recurrent_batch import RecurrentBatch
from kernels.ssd.reference import check_shapes
from kernels.ssd.triton_chunk import ssd_chunk_output_kernel, ssd_chunk_state_kernel
from kernels.ssd.triton_recurrent import ssd_recurrent_kernel

RECURRENT_MAX_LEN = 16      # as the reference: longer sequences take the chunked kernels
MAX_BLOCK_T = 64


def ssd_varlen_triton(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor,
                      dt_bias: Tensor, states: Tensor, seqs: RecurrentBatch, dt_softplus: bool = True,
                      dt_limit: Sequence[float] = (0.0, float("inf")), chunk_size: int = 256,
                      recurrent_max_len: int = RECURRENT_MAX_LEN) -> Tensor:
    """Contract of ``kernels.ssd.ssd``. ``chunk_size`` picks the chunk tile, clamped to a
    power of two in [16, 64] (the result does not depend on it)."""
    check_shapes(x, dt, B, C, states)
    num_heads, head_dim = x.shape[1], x.shape[2]
    groups, state_dim = B.shape[1], B.shape[2]
    block_t = block_size(chunk_size, hi=MAX_BLOCK_T)
    run = varlen_launch(states, seqs, recurrent_max_len, block_t, x.device)
    x, dt, B, C = (t.contiguous() for t in (x, dt, B, C))
    A, D, dt_bias = (t.to(device=x.device).contiguous() for t in (A, D, dt_bias))
    y = torch.empty_like(x)
    lo, hi = float(dt_limit[0]), float(dt_limit[1])
    meta = dict(H=num_heads, G=groups, P=head_dim, N=state_dim, BN=block_size(state_dim),
                DT_SOFTPLUS=bool(dt_softplus), HAS_DT_MAX=math.isfinite(hi))
    limits = (lo, hi if math.isfinite(hi) else 0.0)
    if run.plan.short_ids is not None:
        block_p = block_size(head_dim, hi=32)
        grid = seq_head_grid("ssd_recurrent", run.plan.short_ids.shape[0], num_heads, head_dim, block_p)
        ssd_recurrent_kernel[grid](x, dt, A, B, C, D, dt_bias, y, states, run.cu, run.slots, run.has_init,
                                   run.plan.short_ids, run.dst, *limits, BP=block_p,
                                   HAS_DST=run.has_dst, num_warps=4, **meta)
    if run.plan.chunks is not None:
        _launch_chunked(x, dt, A, B, C, D, dt_bias, y, states, run.slots, run.has_init, run.plan.chunks,
                        block_t, limits, meta)
    return y


def _launch_chunked(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor,
                    dt_bias: Tensor, y: Tensor, states: Tensor, slots: Tensor, has_init: Tensor,
                    table: ChunkTable, block_t: int, limits: tuple[float, float],
                    meta: dict) -> None:
    num_heads, head_dim, state_dim = meta["H"], meta["P"], meta["N"]
    chunk_states = torch.empty(table.num_chunks, num_heads, head_dim, state_dim,
                               dtype=torch.float32, device=x.device)
    block_p = block_size(head_dim, hi=32)
    ssd_chunk_state_kernel[seq_head_grid("ssd_chunk_state", table.seq_ids.shape[0], num_heads,
                                         head_dim, block_p)](
        x, dt, A, B, dt_bias, chunk_states, states, slots, has_init, table.seq_ids,
        table.seq_chunk_offsets, table.chunk_starts, table.chunk_lens, table.chunk_dst, *limits,
        BT=block_t, BP=block_p, F32_DOTS=x.dtype == torch.float32, num_warps=4, **meta)
    ssd_chunk_output_kernel[chunk_head_grid("ssd_chunk_output", table.num_chunks, num_heads,
                                            head_dim, block_p)](
        x, dt, A, B, C, D, dt_bias, chunk_states, y, table.chunk_starts, table.chunk_lens,
        *limits, BT=block_t, BP=block_p, F32_DOTS=x.dtype == torch.float32, num_warps=4, **meta)

"""Launcher of the Triton Mamba1 selective scan (the contract of ``kernels.selective_scan``'s op).

Short sequences (``<= recurrent_max_len`` tokens) take one per-token launch; long ones the
chunked kernel over a chunk table cut at snapshot tokens (``kernels.chunking``). The groups
touch disjoint slots, so the launch order is free. A missing ``D`` / ``dt_bias`` is passed as
zeros (adding 0 is exact).
"""
from __future__ import annotations

import torch
from torch import Tensor

from kernels.chunking import block_size, varlen_launch
from kernels.launch_grid import cdiv, checked
from kernels.recurrent_batch import RecurrentBatch
from kernels.selective_scan.reference import check_shapes, num_groups
from kernels.selective_scan.triton_chunk import selective_scan_chunk_kernel
from kernels.selective_scan.triton_recurrent import selective_scan_recurrent_kernel

RECURRENT_MAX_LEN = 16      # as the reference: longer sequences take the chunked kernel
BLOCK_T = 16                # chunk rows per scan step
TILE_ELEMENTS = 4096        # BT * BH * BN of one chunk tile (the scan keeps two of them)


def channel_block(state_block: int, rows: int) -> int:
    """Channels per program (a power of two in [4, 32]): the [rows, BH, BN] tile of a
    program stays within ``TILE_ELEMENTS``."""
    fits = max(1, TILE_ELEMENTS // (rows * state_block))
    return max(4, min(32, 1 << (fits.bit_length() - 1)))


def selective_scan_varlen_triton(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                                 D: Tensor | None, dt_bias: Tensor | None, states: Tensor,
                                 seqs: RecurrentBatch, dt_softplus: bool = True, chunk_size: int = 64,
                                 recurrent_max_len: int = RECURRENT_MAX_LEN) -> Tensor:
    """Contract of ``kernels.selective_scan.mamba_selective_scan``; ``chunk_size`` is not
    read (the chunk tile is ``BLOCK_T``: the result does not depend on it beyond rounding)."""
    check_shapes(x, dt, A, B, C, states)
    num_channels, state_dim = A.shape
    run = varlen_launch(states, seqs, recurrent_max_len, BLOCK_T, x.device)
    x, dt, B, C = (t.contiguous() for t in (x, dt, B, C))
    zeros = torch.zeros(num_channels, dtype=torch.float32, device=x.device)
    A = A.to(device=x.device, dtype=torch.float32).contiguous()
    D, dt_bias = ((zeros if t is None else t.to(device=x.device).contiguous())
                  for t in (D, dt_bias))
    y = torch.empty_like(x)
    block_n = block_size(state_dim, lo=1)
    meta = dict(H=num_channels, N=state_dim, G=num_groups(B), BN=block_n, DT_SOFTPLUS=bool(dt_softplus))
    if run.plan.short_ids is not None:
        block_h = channel_block(block_n, 1)
        grid = checked((run.plan.short_ids.shape[0], cdiv(num_channels, block_h)),
                       "selective_scan_recurrent")
        selective_scan_recurrent_kernel[grid](
            x, dt, A, B, C, D, dt_bias, y, states, run.cu, run.slots, run.has_init, run.plan.short_ids,
            run.dst, BH=block_h, HAS_DST=run.has_dst, num_warps=4, **meta)
    if run.plan.chunks is not None:
        table = run.plan.chunks
        block_h = channel_block(block_n, BLOCK_T)
        grid = checked((table.seq_ids.shape[0], cdiv(num_channels, block_h)),
                       "selective_scan_chunk")
        selective_scan_chunk_kernel[grid](
            x, dt, A, B, C, D, dt_bias, y, states, run.slots, run.has_init, table.seq_ids,
            table.seq_chunk_offsets, table.chunk_starts, table.chunk_lens, table.chunk_dst,
            BT=BLOCK_T, BH=block_h, num_warps=4, **meta)
    return y

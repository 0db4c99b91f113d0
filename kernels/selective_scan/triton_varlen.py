"""Launcher of the Triton Mamba1 selective scan: same contract as the torch reference.

Short sequences (``<= recurrent_max_len`` tokens) take one per-token launch; long ones the
chunked kernel over a chunk table cut at snapshot tokens (``kernels.chunking``). The groups
touch disjoint slots, so the launch order is free. A missing ``D`` / ``dt_bias`` is passed as
zeros (adding 0 is exact).
"""
from __future__ import annotations

import torch
from torch import Tensor

from kernels import chunking
from kernels.chunking import block_size
from kernels.launch_grid import checked, cdiv
from kernels.selective_scan.reference import check_shapes
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
                                 cu_seqlens: Tensor, slot_ids: Tensor, has_initial_state: Tensor,
                                 dt_softplus: bool = True, chunk_size: int = 64,
                                 state_dst_slots: Tensor | None = None,
                                 recurrent_max_len: int = RECURRENT_MAX_LEN,
                                 uniform_len: int = 0) -> Tensor:
    """Contract of ``kernels.selective_scan.selective_scan_varlen``; ``chunk_size`` is not
    read (the chunk tile is ``BLOCK_T``: the result does not depend on it beyond rounding).
    ``uniform_len``: every sequence has that many tokens (decode: ``launch_plan``)."""
    check_shapes(x, dt, A, B, C, states)
    if not states.is_contiguous():
        raise ValueError("the state pool must be contiguous (it is updated in place)")
    num_channels, state_dim = A.shape
    lp = chunking.launch_plan(cu_seqlens, state_dst_slots, recurrent_max_len, BLOCK_T, x.device,
                              uniform_len)
    x, dt, B, C = (t.contiguous() for t in (x, dt, B, C))
    zeros = torch.zeros(num_channels, dtype=torch.float32, device=x.device)
    A = A.to(device=x.device, dtype=torch.float32).contiguous()
    D, dt_bias = ((zeros if t is None else t.to(device=x.device).contiguous())
                  for t in (D, dt_bias))
    y = torch.empty_like(x)
    block_n = block_size(state_dim, lo=1)
    meta = dict(H=num_channels, N=state_dim, BN=block_n, DT_SOFTPLUS=bool(dt_softplus))
    cu = cu_seqlens.to(device=x.device, dtype=torch.int32)
    slots = slot_ids.to(device=x.device, dtype=torch.int32)
    has_init = has_initial_state.to(device=x.device, dtype=torch.int32)
    if lp.short_ids is not None:
        block_h = channel_block(block_n, 1)
        dst = (state_dst_slots.to(device=x.device, dtype=torch.int32)
               if state_dst_slots is not None else cu)     # dummy pointer when HAS_DST=False
        grid = checked((lp.short_ids.shape[0], cdiv(num_channels, block_h)),
                       "selective_scan_recurrent")
        selective_scan_recurrent_kernel[grid](
            x, dt, A, B, C, D, dt_bias, y, states, cu, slots, has_init, lp.short_ids, dst,
            BH=block_h, HAS_DST=state_dst_slots is not None, num_warps=4, **meta)
    if lp.chunks is not None:
        table = lp.chunks
        block_h = channel_block(block_n, BLOCK_T)
        grid = checked((table.seq_ids.shape[0], cdiv(num_channels, block_h)),
                       "selective_scan_chunk")
        selective_scan_chunk_kernel[grid](
            x, dt, A, B, C, D, dt_bias, y, states, slots, has_init, table.seq_ids,
            table.seq_chunk_offsets, table.chunk_starts, table.chunk_lens, table.chunk_dst,
            BT=BLOCK_T, BH=block_h, num_warps=4, **meta)
    return y

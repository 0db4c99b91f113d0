"""Launcher of the Triton KDA path (the contract of ``kernels.kda``'s op).

Short sequences (``<= recurrent_max_len`` tokens) take one fused recurrent launch; long ones
the three chunked kernels over a chunk table cut at snapshot tokens (``kernels.chunking``).
The two groups touch disjoint slots (live slots are distinct, snapshot slots are nobody's
live slot), so every initial state is read before it is overwritten whatever the order.
"""
from __future__ import annotations

import torch
from torch import Tensor

from kernels.chunking import ChunkTable, block_size, varlen_launch
from kernels.kda.reference import check_shapes
from kernels.kda.triton_chunk import kda_chunk_output_kernel, kda_chunk_prep_kernel, kda_chunk_state_kernel
from kernels.kda.triton_recurrent import kda_recurrent_kernel
from kernels.launch_grid import chunk_head_grid, seq_head_grid
from kernels.recurrent_batch import RecurrentBatch

RECURRENT_MAX_LEN = 16      # as the reference: longer sequences take the chunked kernels
BLOCK_T = 16                # chunk tile: the per-channel decay products are [BT, BT, BKC]
BLOCK_KC = 16               # key channels per step of those products


def kda_varlen_triton(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, states: Tensor,
                      seqs: RecurrentBatch, scale: float | None = None, use_qk_l2norm: bool = True,
                      chunk_size: int = BLOCK_T, recurrent_max_len: int = RECURRENT_MAX_LEN) -> Tensor:
    """Contract of ``kernels.kda.kda``; ``chunk_size`` is not read (the chunk tile is fixed:
    ``BLOCK_T``)."""
    check_shapes(q, k, v, g, beta, states)
    num_heads, k_dim, v_dim = v.shape[1], k.shape[2], v.shape[2]
    run = varlen_launch(states, seqs, recurrent_max_len, BLOCK_T, v.device)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    out = torch.empty_like(v)
    scale = float(scale if scale is not None else k_dim ** -0.5)
    meta = dict(H=num_heads, K=k_dim, V=v_dim, USE_L2NORM=bool(use_qk_l2norm))
    if run.plan.short_ids is not None:
        block_v = block_size(v_dim, hi=32)
        grid = seq_head_grid("kda_recurrent", run.plan.short_ids.shape[0], num_heads, v_dim, block_v)
        kda_recurrent_kernel[grid](q, k, v, g, beta, out, states, run.cu, run.slots, run.has_init,
                                   run.plan.short_ids, run.dst, scale, BK=block_size(k_dim), BV=block_v,
                                   HAS_DST=run.has_dst, num_warps=4, **meta)
    if run.plan.chunks is not None:
        _launch_chunked(q, k, v, g, beta, out, states, run.slots, run.has_init, run.plan.chunks,
                        scale, meta)
    return out


def _launch_chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, out: Tensor,
                    states: Tensor, slots: Tensor, has_init: Tensor, table: ChunkTable,
                    scale: float, meta: dict) -> None:
    num_tokens, num_heads, k_dim, v_dim = v.shape[0], meta["H"], meta["K"], meta["V"]
    f32 = dict(dtype=torch.float32, device=v.device)
    lb = torch.empty(num_tokens, num_heads, k_dim, **f32)
    w = torch.empty(num_tokens, num_heads, k_dim, **f32)
    u = torch.empty(num_tokens, num_heads, v_dim, **f32)
    chunk_states = torch.empty(table.num_chunks, num_heads, k_dim, v_dim, **f32)
    block_k, block_v = block_size(k_dim), block_size(v_dim, hi=32)
    kda_chunk_prep_kernel[chunk_head_grid("kda_chunk_prep", table.num_chunks, num_heads)](
        k, v, g, beta, lb, w, u, table.chunk_starts, table.chunk_lens, BT=BLOCK_T,
        BKC=BLOCK_KC, BV=block_v, num_warps=4, **meta)
    num_seqs = table.seq_ids.shape[0]
    kda_chunk_state_kernel[seq_head_grid("kda_chunk_state", num_seqs, num_heads, v_dim, block_v)](
        k, lb, w, u, chunk_states, states, slots, has_init, table.seq_ids,
        table.seq_chunk_offsets, table.chunk_starts, table.chunk_lens, table.chunk_dst,
        BT=BLOCK_T, BK=block_k, BV=block_v, num_warps=4, **meta)
    kda_chunk_output_kernel[chunk_head_grid("kda_chunk_output", table.num_chunks, num_heads,
                                            v_dim, block_v)](
        q, k, lb, u, chunk_states, out, table.chunk_starts, table.chunk_lens, scale,
        BT=BLOCK_T, BK=block_k, BKC=BLOCK_KC, BV=block_v, num_warps=4, **meta)

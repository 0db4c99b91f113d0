"""Triton causal conv1d: varlen prefill/verify, its state writes, and the one-token update.

Varlen (no host sync): ``seq_of_tok`` comes from a device ``searchsorted``. Three launches,
in stream order, so every initial state is read before any slot is written:

1. ``conv_varlen_kernel`` (BT tokens x BD channels per program): tap w of token t reads the
   input at relative position ``pos - (W-1) + w``, from x when >= 0, else from column
   ``pos + w`` of the sequence's initial state (zeros without one).
2. ``conv_state_kernel`` over the snapshot tokens (grid over all T; tokens without a
   snapshot slot do nothing): slot ``dst[t]`` gets the W-1 inputs ending at t. It reads
   live slots only.
3. The same kernel over each sequence's last token, into its live slot. A program reads its
   whole source window into registers, then a barrier, then stores: reading and writing the
   same live slot is safe.

``conv_update_kernel``: one token per sequence, window = state ++ x, then the state shifts.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.chunking import block_size
from kernels.conv1d.reference import check_shapes
from kernels.launch_grid import row_block_grid


@triton.jit
def conv_varlen_kernel(
    x, weight, bias, conv_states, out,      # x [T, D] (row stride stride_x); out [T, D]
    cu_seqlens, seq_of_tok, slot_ids, has_init,
    num_tokens, stride_x,
    D: tl.constexpr, W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
    HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
):
    i_t = tl.program_id(0)
    i_d = tl.program_id(1)
    o_t = i_t * BT + tl.arange(0, BT)
    o_d = i_d * BD + tl.arange(0, BD)
    m_t = o_t < num_tokens
    m_d = o_d < D
    seq = tl.load(seq_of_tok + o_t, mask=m_t, other=0)
    pos = o_t - tl.load(cu_seqlens + seq, mask=m_t, other=0)               # position in sequence
    slot = tl.load(slot_ids + seq, mask=m_t, other=0).to(tl.int64)
    init = tl.load(has_init + seq, mask=m_t, other=0) != 0
    m_td = m_t[:, None] & m_d[None, :]

    acc = tl.zeros([BT, BD], dtype=tl.float32)
    for w in tl.static_range(W):
        rel = pos - (W - 1) + w                      # input position relative to the sequence
        in_x = rel >= 0
        b_x = tl.load(x + (o_t - (W - 1) + w).to(tl.int64)[:, None] * stride_x + o_d[None, :],
                      mask=m_td & in_x[:, None], other=0.0).to(tl.float32)
        col = tl.where(in_x, 0, rel + (W - 1))
        b_s = tl.load(conv_states + (slot[:, None] * D + o_d[None, :]) * (W - 1) + col[:, None],
                      mask=m_td & (~in_x & init)[:, None], other=0.0).to(tl.float32)
        b_w = tl.load(weight + o_d * W + w, mask=m_d, other=0.0).to(tl.float32)
        acc += (b_x + b_s) * b_w[None, :]
    if HAS_BIAS:
        acc += tl.load(bias + o_d, mask=m_d, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(out + o_t.to(tl.int64)[:, None] * D + o_d[None, :], acc.to(out.dtype.element_ty),
             mask=m_td)


@triton.jit
def conv_state_kernel(
    x, conv_states, cu_seqlens, seq_of_tok, slot_ids, has_init,
    tok_ids, dst_slots, stride_x,           # program i: window ending at tok_ids[i] -> dst_slots[i]
    D: tl.constexpr, W: tl.constexpr, BD: tl.constexpr, BW: tl.constexpr,
    MIN_DST: tl.constexpr,                  # programs with dst_slots[i] < MIN_DST write nothing
):
    i = tl.program_id(0)
    i_d = tl.program_id(1)
    dst = tl.load(dst_slots + i).to(tl.int64)
    if dst >= MIN_DST:
        t = tl.load(tok_ids + i).to(tl.int64)
        seq = tl.load(seq_of_tok + t)
        pos = t - tl.load(cu_seqlens + seq)
        slot = tl.load(slot_ids + seq).to(tl.int64)
        o_d = i_d * BD + tl.arange(0, BD)
        o_j = tl.arange(0, BW)                       # state column j: input at pos - (W-2) + j
        init = (tl.load(has_init + seq) + o_j * 0) != 0     # as a [BW] vector
        m_dj = (o_d[:, None] < D) & (o_j[None, :] < W - 1)
        rel = pos - (W - 2) + o_j
        in_x = rel >= 0
        b_x = tl.load(x + (t - (W - 2) + o_j)[None, :] * stride_x + o_d[:, None],
                      mask=m_dj & in_x[None, :], other=0.0)
        col = tl.where(in_x, 0, rel + (W - 1))
        b_s = tl.load(conv_states + (slot * D + o_d[:, None]) * (W - 1) + col[None, :],
                      mask=m_dj & (~in_x & init)[None, :], other=0.0)
        window = tl.where(in_x[None, :], b_x.to(tl.float32), b_s.to(tl.float32))
        # The live pass reads and writes the same slot, column j from column pos + 1 + j:
        # every thread's loads must land before any thread's stores.
        tl.debug_barrier()
        tl.store(conv_states + (dst * D + o_d[:, None]) * (W - 1) + o_j[None, :],
                 window.to(conv_states.dtype.element_ty), mask=m_dj)


@triton.jit
def conv_update_kernel(
    x, weight, bias, conv_states, out, slot_ids, stride_x,
    D: tl.constexpr, W: tl.constexpr, BD: tl.constexpr,
    HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
):
    i_b = tl.program_id(0)
    i_d = tl.program_id(1)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    slot = tl.load(slot_ids + i_b).to(tl.int64)
    p_state = conv_states + (slot * D + o_d) * (W - 1)
    b_new = tl.load(x + i_b * stride_x + o_d, mask=m_d, other=0.0)
    acc = tl.zeros([BD], dtype=tl.float32)
    for w in tl.static_range(W - 1):                 # taps 0..W-2 read the state, all before
        tap = tl.load(p_state + w, mask=m_d, other=0.0)      # any store below
        b_w = tl.load(weight + o_d * W + w, mask=m_d, other=0.0)
        acc += tap.to(tl.float32) * b_w.to(tl.float32)
    acc += b_new.to(tl.float32) * tl.load(weight + o_d * W + W - 1, mask=m_d,
                                          other=0.0).to(tl.float32)
    for w in tl.static_range(W - 2):                 # shift: column w <- column w+1
        tl.store(p_state + w, tl.load(p_state + w + 1, mask=m_d, other=0.0), mask=m_d)
    tl.store(p_state + W - 2, b_new.to(conv_states.dtype.element_ty), mask=m_d)
    if HAS_BIAS:
        acc += tl.load(bias + o_d, mask=m_d, other=0.0).to(tl.float32)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(out + i_b * D + o_d, acc.to(out.dtype.element_ty), mask=m_d)


def _rows(x: Tensor) -> Tensor:
    """x [T, D] with unit channel stride (a column slice of a projection is fine)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def causal_conv1d_varlen_triton(x: Tensor, weight: Tensor, bias: Tensor | None,
                                conv_states: Tensor, cu_seqlens: Tensor, slot_ids: Tensor,
                                has_initial_state: Tensor, activation: str | None = "silu",
                                state_dst_slots: Tensor | None = None) -> Tensor:
    check_shapes(x, weight, conv_states, activation)
    if not conv_states.is_contiguous():
        raise ValueError("the conv state pool must be contiguous (it is updated in place)")
    num_tokens, dim = x.shape
    width = weight.shape[1]
    out = torch.empty(num_tokens, dim, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    x, weight = _rows(x), weight.contiguous()
    cu = cu_seqlens.to(device=x.device, dtype=torch.int32)
    seq_of_tok = torch.searchsorted(cu[1:], torch.arange(num_tokens, device=x.device,
                                                         dtype=torch.int32), right=True)
    seq_of_tok = seq_of_tok.to(torch.int32)
    slots = slot_ids.to(device=x.device, dtype=torch.int32)
    has_init = has_initial_state.to(device=x.device, dtype=torch.int32)
    block_t, block_d = 16, block_size(dim, lo=16, hi=128)
    common = dict(D=dim, W=width)
    conv_varlen_kernel[row_block_grid("conv_varlen", num_tokens, block_t, dim, block_d)](
        x, weight, bias if bias is not None else weight, conv_states, out, cu, seq_of_tok,
        slots, has_init, num_tokens, x.stride(0), BT=block_t, BD=block_d,
        HAS_BIAS=bias is not None, SILU=activation is not None, num_warps=4, **common)
    state_args = (x, conv_states, cu, seq_of_tok, slots, has_init)
    block_w = block_size(width - 1, lo=2)
    if state_dst_slots is not None:          # snapshots first: they read live slots
        conv_state_kernel[row_block_grid("conv_state", num_tokens, 1, dim, block_d)](
            *state_args, torch.arange(num_tokens, device=x.device, dtype=torch.int32),
            state_dst_slots.to(device=x.device, dtype=torch.int32), x.stride(0),
            BD=block_d, BW=block_w, MIN_DST=1, num_warps=4, **common)
    last = (cu[1:] - 1).clamp(min=0)
    live = torch.where(cu[1:] > cu[:-1], slots, -1)   # empty sequences write nothing
    conv_state_kernel[row_block_grid("conv_state", slots.shape[0], 1, dim, block_d)](
        *state_args, last, live, x.stride(0), BD=block_d, BW=block_w, MIN_DST=0, num_warps=4,
        **common)
    return out


def causal_conv1d_update_triton(x: Tensor, weight: Tensor, bias: Tensor | None,
                                conv_states: Tensor, slot_ids: Tensor,
                                activation: str | None = "silu") -> Tensor:
    check_shapes(x, weight, conv_states, activation)
    if not conv_states.is_contiguous():
        raise ValueError("the conv state pool must be contiguous (it is updated in place)")
    batch, dim = x.shape
    out = torch.empty(batch, dim, dtype=x.dtype, device=x.device)
    if batch == 0:
        return out
    x = _rows(x)
    block_d = block_size(dim, lo=16, hi=256)
    conv_update_kernel[row_block_grid("conv_update", batch, 1, dim, block_d)](
        x, weight.contiguous(), bias if bias is not None else weight, conv_states, out,
        slot_ids.to(device=x.device, dtype=torch.int32), x.stride(0), D=dim,
        W=weight.shape[1], BD=block_d, HAS_BIAS=bias is not None, SILU=activation is not None,
        num_warps=4)
    return out

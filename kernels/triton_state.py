"""Device helpers shared by the recurrent ops' Triton kernels (``kernels.gdn``, ``kernels.ssd``),
and ``dot`` (the attention kernels' too).

Both ops keep one state per sequence in a contiguous pool [S, H, R, C] (GDN: R, C = K, V;
SSD: R, C = P, N). A program owns one tile S[h, r-block, c-block] in fp32 registers, reads it
from the sequence's live slot (or starts from zeros), and writes it, rounded once to the pool
dtype, to the live slot at the end and to snapshot slots on the way. ``SLOT`` below is the
elements of one slot, H * R * C; ``s_off`` the tile's offsets inside a slot.

These are ``@triton.jit`` functions: the compiler inlines them into each kernel.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def program_seq_head(seq_ids, H: tl.constexpr, HG: tl.constexpr):
    """Grid axis 0 enumerates (sequence of this launch, head) as i_n * H + i_h: the large
    product goes on the axis whose limit is 2**31 - 1 (``kernels.launch_grid``).

    Returns i_n, i_h, i_h's group (of HG groups, H // HG heads each) and the sequence's
    index in the batch, ``seq_ids[i_n]``.
    """
    i_nh = tl.program_id(0)
    i_n = i_nh // H
    i_h = i_nh % H
    i_g = i_h // (H // HG)
    seq = tl.load(seq_ids + i_n)
    return i_n, i_h, i_g, seq


@triton.jit
def state_tile(i_h, o_r, o_c, R: tl.constexpr, C: tl.constexpr):
    """The tile S[i_h, o_r, o_c] of a slot: masks ``o_r < R``, ``o_c < C``, their [BR, BC]
    product, and the offsets s_off of the tile's elements inside one slot."""
    m_r = o_r < R
    m_c = o_c < C
    m_rc = m_r[:, None] & m_c[None, :]
    s_off = (i_h * R + o_r[:, None]) * C + o_c[None, :]
    return m_r, m_c, m_rc, s_off


@triton.jit
def chunk_rows(chunk_starts, chunk_lens, c, o_t):
    """Chunk c of a ``kernels.chunking.ChunkTable``: its first row (int64), its length, the
    mask ``o_t < length`` and the rows ``start + o_t`` of the tile positions o_t."""
    start = tl.load(chunk_starts + c).to(tl.int64)
    length = tl.load(chunk_lens + c)
    return start, length, o_t < length, start + o_t


@triton.jit
def load_initial_state(states, has_init, seq, slot, s_off, mask, SLOT: tl.constexpr,
                       BR: tl.constexpr, BC: tl.constexpr):
    """The fp32 [BR, BC] tile a sequence starts from: its live slot's if ``has_init[seq]``,
    else zeros (the slot is not read, so whatever it holds cannot leak)."""
    s = tl.zeros([BR, BC], dtype=tl.float32)
    if tl.load(has_init + seq) != 0:
        s = tl.load(states + slot * SLOT + s_off, mask=mask, other=0.0).to(tl.float32)
    return s


@triton.jit
def store_state(states, slot, s_off, s, mask, SLOT: tl.constexpr):
    """Writes the fp32 tile s into pool slot ``slot`` (int64), cast to the pool's dtype."""
    tl.store(states + slot * SLOT + s_off, s.to(states.dtype.element_ty), mask=mask)


@triton.jit
def store_snapshot(states, dst_slots, i, s_off, s, mask, SLOT: tl.constexpr):
    """Also writes s into slot ``dst_slots[i]`` when that is not 0 (0: no snapshot here)."""
    dst = tl.load(dst_slots + i).to(tl.int64)
    if dst != 0:
        store_state(states, dst, s_off, s, mask, SLOT)


@triton.jit
def dot(a, b, F32_DOTS: tl.constexpr):
    """``tl.dot``, in IEEE fp32 precision (no tf32) when ``F32_DOTS``: a kernel given fp32
    activations computes in fp32 (on a GPU a plain fp32 ``tl.dot`` rounds its operands to tf32)."""
    if F32_DOTS:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)

"""Launch grids of the Triton kernels: pure functions, checked against CUDA's limits.

CUDA caps a grid at 2**31 - 1 blocks on axis 0 and 65,535 on axes 1 and 2. A kernel whose
large product (sequences x heads, tokens, chunks) sits on axis 1 fails to launch on a real
batch: 512 sequences of a 128-head Mamba2 model are 65,536 programs. So every grid here puts
its one unbounded product on axis 0 and only small tile counts (heads, feature blocks) on
axes 1 and 2, and ``checked`` refuses a grid past the limits with the numbers, before a
launch that the driver would fail with a bare ``invalid argument``.

No triton import: the grids are tested on machines without a GPU
(``tests/kernels/triton_path/test_grid_limits.py``).
"""

from __future__ import annotations

CUDA_MAX_GRID = (2**31 - 1, 65_535, 65_535)

Grid = tuple[int, ...]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def checked(grid: Grid, kernel: str) -> Grid:
    """``grid`` itself when every axis is within ``CUDA_MAX_GRID``; else ValueError."""
    if not 1 <= len(grid) <= 3 or any(n < 0 for n in grid):
        raise ValueError(f"{kernel}: a launch grid has 1-3 non-negative axes, got {grid}")
    over = [axis for axis, (n, cap) in enumerate(zip(grid, CUDA_MAX_GRID)) if n > cap]
    if over:
        raise ValueError(f"{kernel}: launch grid {grid} exceeds CUDA's limits {CUDA_MAX_GRID} on axis {over}")
    return grid


def seq_head_grid(kernel: str, num_seqs: int, num_heads: int, width: int, block: int) -> Grid:
    """A program per (sequence, head, feature block): ``(num_seqs * num_heads, blocks)``.

    Kernels read it through ``kernels.triton_state.program_seq_head`` (axis 0 = i_n * H + i_h)
    and ``tl.program_id(1)`` (the block of the ``width`` features, ``block`` each).
    """
    return checked((num_seqs * num_heads, cdiv(width, block)), kernel)


def chunk_head_grid(kernel: str, num_chunks: int, num_heads: int, width: int | None = None, block: int = 1) -> Grid:
    """A program per (chunk, head[, feature block]): ``(num_chunks, num_heads[, blocks])``."""
    if width is None:
        return checked((num_chunks, num_heads), kernel)
    return checked((num_chunks, num_heads, cdiv(width, block)), kernel)


def row_block_grid(kernel: str, num_rows: int, block_rows: int, width: int, block: int) -> Grid:
    """A program per (row block, feature block): ``(cdiv(num_rows, block_rows), blocks)``."""
    return checked((cdiv(num_rows, block_rows), cdiv(width, block)), kernel)


def attention_num_tiles(num_tokens: int, num_seqs: int, block_q: int) -> int:
    """Query tiles of a paged-attention launch, from shapes only (no host sync).

    Sequence b's tiles start at ``cu_seqlens[b] // block_q + b``, which grows by at least
    ``ceil(q_len_b / block_q)`` from one sequence to the next, so every sequence's tiles fit
    below ``num_tokens // block_q + num_seqs``; tiles past a sequence's queries do nothing.
    """
    return num_tokens // block_q + num_seqs


def attention_grid(kernel: str, num_tokens: int, num_seqs: int, block_q: int, num_kv_heads: int) -> Grid:
    """``(query tiles, KV heads)``: a program per tile of one sequence's queries and one KV
    head, with the query heads of that KV head's group inside the tile."""
    return checked((attention_num_tiles(num_tokens, num_seqs, block_q), num_kv_heads), kernel)

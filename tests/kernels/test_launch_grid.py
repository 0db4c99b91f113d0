"""The launch grids of the Triton kernels (``kernels.launch_grid``), without a GPU: CUDA's
axis limits, and the query-tile numbering the paged-attention kernel searches."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kernels.launch_grid import (
    CUDA_MAX_GRID,
    attention_grid,
    attention_num_tiles,
    cdiv,
    checked,
    chunk_head_grid,
    row_block_grid,
    seq_head_grid,
)


def test_checked_refuses_with_the_numbers():
    assert checked((2**31 - 1, 65_535, 65_535), "k") == (2**31 - 1, 65_535, 65_535)
    with pytest.raises(ValueError, match=r"k: launch grid \(4, 65536\) exceeds .* axis \[1\]"):
        checked((4, 65_536), "k")
    with pytest.raises(ValueError, match="axis"):
        checked((2**31, 1), "k")
    with pytest.raises(ValueError, match="1-3 non-negative"):
        checked((1, 2, 3, 4), "k")


def test_sequences_times_heads_on_axis_zero():
    """512+ sequences of a 128-head model: 65,536+ programs, which axis 1 cannot take."""
    for num_seqs in (512, 4096, 100_000):
        grid = seq_head_grid("ssd_recurrent", num_seqs, 128, 64, 32)
        assert grid == (num_seqs * 128, 2)
        assert grid[0] > CUDA_MAX_GRID[1]  # the old layout (blocks, seqs x heads) fails
    assert chunk_head_grid("c", 10**6, 128) == (10**6, 128)
    assert chunk_head_grid("c", 10**6, 128, 128, 64) == (10**6, 128, 2)
    assert row_block_grid("r", 10**7, 16, 8192, 128) == (625_000, 64)


@given(q_lens=st.lists(st.integers(0, 300), min_size=1, max_size=40), block_q=st.sampled_from([1, 2, 4, 8, 16, 64]))
def test_attention_tiles_cover_every_query_once(q_lens, block_q):
    """Sequence b's tiles start at cu[b] // BQ + b; its ceil(q_len / BQ) tiles must not reach
    the next sequence's start nor the grid's end (what the kernel's binary search assumes)."""
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    num_tiles = attention_num_tiles(cu[-1], len(q_lens), block_q)
    starts = [cu[b] // block_q + b for b in range(len(q_lens))] + [num_tiles]
    for b, n in enumerate(q_lens):
        assert starts[b] + cdiv(n, block_q) <= starts[b + 1]
    assert attention_grid("a", cu[-1], len(q_lens), block_q, 8) == (num_tiles, 8)

"""The traced formulation of paged attention (``attend_uniform``: what a compiled decode or
verify step runs) against the dense oracle and the planned path, with extra empty page-table
columns (a compiled step's table is padded) and padding sequences."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.attention.reference import attend_paged, attend_uniform, write_kv
from tests.kernels.attention_cases import build_case, dense_reference

SCALE = 0.4


@pytest.mark.parametrize("q_len", [1, 3])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("window", [None, 4])
def test_uniform_equals_dense_and_planned(q_len, page_size, window):
    case = build_case([(5, q_len), (0, q_len), (13, q_len)], page_size, 4, 2, seed=q_len + page_size)
    write_kv(case["k"], case["v"], case["k_pool"], case["v_pool"], case["out_loc"])
    table = F.pad(case["page_table"], (0, 3))  # unused columns: page 0, masked
    out = attend_uniform(case["q"], case["k_pool"], case["v_pool"], table, case["seq_lens"], page_size, SCALE, window)
    planned = attend_paged(
        case["q"],
        case["k_pool"],
        case["v_pool"],
        case["page_table"],
        case["cu_seqlens"],
        case["seq_lens"],
        page_size,
        SCALE,
        window,
    )
    torch.testing.assert_close(out, dense_reference(case, SCALE, window), atol=1e-5, rtol=0)
    torch.testing.assert_close(out, planned, atol=1e-6, rtol=0)


def test_padding_sequences_leave_real_rows_alone():
    """A padded compiled batch: extra sequences of page 0, context q_len, garbage queries."""
    case = build_case([(6, 1), (2, 1)], 4, 4, 2, seed=3)
    write_kv(case["k"], case["v"], case["k_pool"], case["v_pool"], case["out_loc"])
    q = torch.cat([case["q"], torch.randn(2, 4, 8)])
    table = F.pad(case["page_table"], (0, 0, 0, 2))
    seq_lens = F.pad(case["seq_lens"], (0, 2), value=1)
    out = attend_uniform(q, case["k_pool"], case["v_pool"], table, seq_lens, 4, SCALE)
    torch.testing.assert_close(out[:2], dense_reference(case, SCALE), atol=1e-5, rtol=0)
    assert torch.isfinite(out).all()

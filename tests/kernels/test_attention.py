"""Paged attention against dense causal attention on the un-paged sequences (the CPU path)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.attention import paged_attention
from tests.kernels.attention_cases import build_case, dense_reference, expected_pools, run_paged

TOL = 1e-5


def run_and_check(case, scale: float = 0.4, window: int | None = None) -> None:
    out, k_pool, v_pool = run_paged(paged_attention, case, scale, window=window)
    torch.testing.assert_close(out, dense_reference(case, scale, window), atol=TOL, rtol=0)
    expect_k, expect_v = expected_pools(case)
    assert torch.equal(k_pool, expect_k) and torch.equal(v_pool, expect_v)  # nothing else written


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("heads", [(4, 2), (2, 2), (4, 1)])
def test_mixed_batch(page_size, heads):
    """Prefill, chunked-prefill continuation, decodes, and an idle (0 new tokens) sequence."""
    seqs = [(0, 7), (5, 1), (12, 1), (9, 4), (3, 0), (0, 1), (6, 1)]
    run_and_check(build_case(seqs, page_size, *heads, seed=page_size))


@settings(max_examples=20, deadline=None)
@given(
    seqs=st.lists(st.tuples(st.integers(0, 12), st.integers(0, 6)), min_size=1, max_size=5),
    page_size=st.sampled_from([1, 4]),
    heads=st.sampled_from([(4, 2), (2, 2), (6, 3)]),
    seed=st.integers(0, 2**16),
)
def test_random_batches(seqs, page_size, heads, seed):
    run_and_check(build_case(seqs, page_size, *heads, seed=seed))


@pytest.mark.parametrize("window", [1, 3, 8, 100])
def test_sliding_window(window):
    """Keys older than the window are masked: queries deep into a long prefix, chunks that
    straddle the window edge, decodes, an idle sequence; 100 is wider than every context."""
    seqs = [(0, 11), (9, 1), (20, 1), (13, 6), (3, 0), (0, 1), (30, 2)]
    case = build_case(seqs, 4, 4, 2, seed=window)
    run_and_check(case, window=window)
    if window < 30:  # the window does change the result
        full = dense_reference(case, 0.4)
        assert not torch.allclose(full, dense_reference(case, 0.4, window), atol=1e-3)


@settings(max_examples=10, deadline=None)
@given(
    seqs=st.lists(st.tuples(st.integers(0, 12), st.integers(0, 6)), min_size=1, max_size=5),
    window=st.integers(1, 10),
    seed=st.integers(0, 2**16),
)
def test_random_windowed_batches(seqs, window, seed):
    run_and_check(build_case(seqs, 4, 4, 2, seed=seed), window=window)


def test_window_must_be_positive():
    case = build_case([(0, 3)], 4, 2, 2, seed=0)
    with pytest.raises(ValueError, match="window must be a positive"):
        run_paged(paged_attention, case, 0.3, window=0)


def test_bf16_output_dtype():
    case = build_case([(3, 2), (4, 1)], 4, 4, 2, seed=0)
    for name in ("q", "k", "v", "k_pool", "v_pool"):
        case[name] = case[name].bfloat16()
    out = paged_attention(
        case["q"],
        case["k"],
        case["v"],
        case["k_pool"],
        case["v_pool"],
        case["out_loc"],
        case["page_table"],
        case["cu_seqlens"],
        case["seq_lens"],
        4,
        0.3,
    )
    assert out.dtype == torch.bfloat16 and out.shape == case["q"].shape


def test_seq_lens_shorter_than_new_tokens_raises():
    case = build_case([(0, 3)], 4, 2, 2, seed=0)
    with pytest.raises(ValueError, match="seq_lens"):
        paged_attention(
            case["q"],
            case["k"],
            case["v"],
            case["k_pool"],
            case["v_pool"],
            case["out_loc"],
            case["page_table"],
            case["cu_seqlens"],
            torch.tensor([2], dtype=torch.int32),
            4,
            0.3,
        )

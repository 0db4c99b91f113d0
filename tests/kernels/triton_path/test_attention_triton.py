"""The Triton paged-attention kernel against naive dense attention and the torch path.

On CPU under the interpreter (tiny sizes); on a GPU the same cases run compiled. Batches mix
prefills, chunked-prefill continuations over cached prefixes, verifies, decodes and idle
sequences (no new tokens), over shuffled pages of 1, 4 and 16 tokens; GQA ratios 1, 2, 3, 4
and 6; head dims from 32 to 256, powers of two or not. Every case also checks that the pools
received exactly the new tokens' K/V.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.attention.reference import paged_attention_torch
from tests.kernels.attention_cases import build_case, dense_reference, expected_pools, run_paged, with_dtype
from tests.kernels.varlen_cases import NO_SHRINK

SCALE = 0.3
# prefill past one key block (64) and one query tile, continuations, verify, decodes, idle
MIXED = [(0, 70), (5, 1), (12, 1), (9, 4), (3, 0), (0, 1), (80, 3), (40, 17)]


def triton_attention(**kwargs) -> torch.Tensor:
    from kernels.attention.triton_paged import paged_attention_triton

    return paged_attention_triton(**kwargs)


def check(case, device, atol: float, scale: float = SCALE, window: int | None = None) -> None:
    out, k_pool, v_pool = run_paged(triton_attention, case, scale, device, window)
    assert out.dtype == case["q"].dtype and out.shape == case["q"].shape
    torch.testing.assert_close(out.float(), dense_reference(case, scale, window), atol=atol, rtol=0)
    want, _, _ = run_paged(paged_attention_torch, case, scale, window=window)
    torch.testing.assert_close(out.float(), want.float(), atol=atol, rtol=0)
    expect_k, expect_v = expected_pools(case)
    assert torch.equal(k_pool, expect_k) and torch.equal(v_pool, expect_v)


@pytest.fixture(scope="module")
def atol(device) -> float:
    return 1e-5 if device.type == "cpu" else 1e-4  # fp32 dots run in IEEE precision


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("heads", [(2, 2), (4, 2), (8, 2), (6, 1)], ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_mixed_batch(heads, page_size, device, atol):
    check(build_case(MIXED, page_size, *heads, seed=page_size, head_dim=32), device, atol)


@pytest.mark.parametrize("window", [1, 5, 64, 200])
def test_sliding_window(window, device, atol):
    """Windows narrower than a key block, equal to one (the walk starts mid-context) and
    wider than every context; prefill tiles whose rows see different key ranges."""
    check(build_case(MIXED, 4, 4, 2, seed=window, head_dim=32), device, atol, window=window)


@pytest.mark.parametrize("head_dim", [32, 64, 80, 96, 128, 160, 192, 256])
def test_head_dims(head_dim, device, atol):
    """Non-powers of two run padded to the next power of two, masked."""
    case = build_case([(0, 5), (6, 1), (3, 0), (2, 3)], 4, 4, 2, seed=head_dim, head_dim=head_dim)
    check(case, device, atol, scale=head_dim**-0.5)


def test_decode_only_long_context(device, atol):
    """Decode tiles (16 rows: one token x the group's heads), several key blocks each."""
    seqs = [(150, 1), (0, 1), (63, 1), (64, 1), (17, 1)]
    check(build_case(seqs, 16, 8, 2, seed=3, head_dim=64), device, atol)


def test_no_new_tokens(device):
    """Only idle sequences (T = 0), and no sequences at all: nothing to attend, pools kept."""
    for seqs in ([(4, 0), (7, 0)], []):
        case = build_case(seqs, 4, 4, 2, seed=0, head_dim=32)
        out, k_pool, v_pool = run_paged(triton_attention, case, SCALE, device)
        assert out.shape == (0, 4, 32)
        assert torch.equal(k_pool, case["k_pool"]) and torch.equal(v_pool, case["v_pool"])


def test_bf16(device):
    """bf16 operands, fp32 accumulation: within bf16 rounding of the rounded inputs' result."""
    case = with_dtype(build_case(MIXED, 4, 4, 2, seed=5, head_dim=32), torch.bfloat16)
    out, k_pool, v_pool = run_paged(triton_attention, case, SCALE, device)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), dense_reference(case, SCALE), atol=3e-2, rtol=0)
    expect_k, expect_v = expected_pools(case)
    assert torch.equal(k_pool, expect_k) and torch.equal(v_pool, expect_v)


@settings(max_examples=30, deadline=None, phases=NO_SHRINK)
@given(
    seqs=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 20)), min_size=1, max_size=6),
    page_size=st.sampled_from([1, 4, 16]),
    heads=st.sampled_from([(2, 2), (4, 2), (6, 3), (8, 2), (6, 1)]),
    head_dim=st.sampled_from([32, 48, 80]),
    seed=st.integers(0, 2**16),
)
def test_random_batches(seqs, page_size, heads, head_dim, seed, device, atol):
    check(build_case(seqs, page_size, *heads, seed=seed, head_dim=head_dim), device, atol)

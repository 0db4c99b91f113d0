"""The Triton MLA kernel against dense attention on the un-paged latents and the torch path."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.mla.reference import mla_attention_torch
from tests.kernels.mla_cases import MIXED, dense_mla, expected_pool, mla_case, run_mla
from tests.kernels.varlen_cases import NO_SHRINK

SCALE = 0.3


def triton_mla(**kwargs) -> torch.Tensor:
    from kernels.mla.triton_paged import mla_attention_triton

    return mla_attention_triton(**kwargs)


@pytest.fixture(scope="module")
def atol(device) -> float:
    return 1e-5 if device.type == "cpu" else 1e-4  # fp32 dots run in IEEE precision


def check(case, device, atol: float) -> None:
    out, pool = run_mla(triton_mla, case, SCALE, device)
    assert out.dtype == case["q"].dtype and out.shape == (*case["q"].shape[:2], case["latent_dim"])
    torch.testing.assert_close(out.float(), dense_mla(case, SCALE), atol=atol, rtol=0)
    want, _ = run_mla(mla_attention_torch, case, SCALE)
    torch.testing.assert_close(out.float(), want.float(), atol=atol, rtol=0)
    assert torch.equal(pool, expected_pool(case))


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads", [1, 4, 6])
def test_mixed_batch(heads, page_size, device, atol):
    """Prefill past a key block, continuations, verify, decodes, idle; heads padded to 8."""
    check(mla_case(MIXED, page_size, heads, latent_dim=32, rope_dim=16, seed=heads), device, atol)


def test_unpadded_and_padded_dims(device, atol):
    """R and P that are not powers of two (masked), and no rope part at all."""
    for r, p in ((24, 8), (16, 0), (40, 24)):
        check(mla_case([(0, 20), (7, 1), (3, 5)], 4, 4, r, p, seed=r), device, atol)


def test_bf16(device):
    case = mla_case(MIXED, 4, 4, 32, 16, seed=5)
    for name in ("q", "latent", "pool"):
        case[name] = case[name].bfloat16()
    case["k_full"] = [k.bfloat16().float() for k in case["k_full"]]
    out, pool = run_mla(triton_mla, case, SCALE, device)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), dense_mla(case, SCALE), atol=3e-2, rtol=0)
    assert torch.equal(pool, expected_pool(case))


@settings(max_examples=12, deadline=None, phases=NO_SHRINK)
@given(
    seqs=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 20)), min_size=1, max_size=5),
    page_size=st.sampled_from([1, 4, 16]),
    heads=st.sampled_from([1, 2, 5]),
    seed=st.integers(0, 2**16),
)
def test_random_batches(seqs, page_size, heads, seed, device, atol):
    check(mla_case(seqs, page_size, heads, 16, 8, seed=seed), device, atol)

"""MLA over the paged latent pool (the torch path) against dense attention on the un-paged
latents, and the absorbed form against transformers' decompressed keys and values."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.mla import mla_attention
from tests.kernels.mla_cases import MIXED, dense_mla, expected_pool, mla_case, run_mla

TOL = 1e-5


def check(case, scale: float = 0.3) -> None:
    out, pool = run_mla(mla_attention, case, scale)
    torch.testing.assert_close(out, dense_mla(case, scale), atol=TOL, rtol=0)
    assert torch.equal(pool, expected_pool(case))  # only the new tokens' rows written


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_mixed_batch(page_size):
    """Prefills, continuations over cached prefixes, verify, decodes and an idle sequence."""
    check(mla_case(MIXED, page_size, heads=4, latent_dim=16, rope_dim=8, seed=page_size))


@settings(max_examples=20, deadline=None)
@given(
    seqs=st.lists(st.tuples(st.integers(0, 12), st.integers(0, 6)), min_size=1, max_size=5),
    page_size=st.sampled_from([1, 4]),
    heads=st.sampled_from([1, 3, 4]),
    dims=st.sampled_from([(8, 4), (12, 6), (16, 0)]),
    seed=st.integers(0, 2**16),
)
def test_random_batches(seqs, page_size, heads, dims, seed):
    check(mla_case(seqs, page_size, heads, *dims, seed=seed))


def test_absorbed_equals_decompressed_attention():
    """(W_uk^T q_nope) . c + q_r . k_r and W_uv (p . c) equal softmax attention over the
    decompressed k = [W_uk c | k_r], v = W_uv c of every head (what transformers computes)."""
    gen = torch.Generator().manual_seed(0)
    heads, r, p, nope, vd, n = 3, 16, 8, 12, 10, 9
    c, k_r = torch.randn(n, r, generator=gen), torch.randn(n, p, generator=gen)
    w_uk, w_uv = torch.randn(heads, nope, r, generator=gen), torch.randn(heads, vd, r, generator=gen)
    q_nope, q_r = torch.randn(n, heads, nope, generator=gen), torch.randn(n, heads, p, generator=gen)
    scale = (nope + p) ** -0.5
    keys = torch.cat([torch.einsum("hdr,tr->htd", w_uk, c), k_r[None].expand(heads, n, p)], -1)
    values = torch.einsum("hvr,tr->htv", w_uv, c)
    queries = torch.cat([q_nope, q_r], -1).transpose(0, 1)  # [H, n, D]
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    want = torch.nn.functional.scaled_dot_product_attention(
        queries, keys, values, attn_mask=mask, scale=scale
    ).transpose(0, 1)
    case = mla_case([(0, n)], 4, heads, r, p, seed=1)
    case["q"] = torch.cat([torch.einsum("thd,hdr->thr", q_nope, w_uk), q_r], -1)
    case["latent"] = torch.cat([c, k_r], -1)
    out, _ = run_mla(mla_attention, case, scale)
    got = torch.einsum("thr,hvr->thv", out, w_uv)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_shape_errors_name_the_shapes():
    case = mla_case([(0, 3)], 4, 2, 8, 4, seed=0)
    with pytest.raises(ValueError, match=r"latent_dim R=13"):
        run_mla(mla_attention, {**case, "latent_dim": 13}, 0.3)

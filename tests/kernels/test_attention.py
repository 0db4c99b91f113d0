"""Paged attention against dense causal attention on the un-paged sequences."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.attention import paged_attention

D = 8
TOL = 1e-5


def build_case(seqs: list[tuple[int, int]], page_size: int, h_q: int, h_kv: int, seed: int):
    """seqs: (cached prefix, new tokens) per sequence. Pages are shuffled, page 0 unused."""
    gen = torch.Generator().manual_seed(seed)
    ctx = [p + n for p, n in seqs]
    pages_per_seq = [math.ceil(c / page_size) for c in ctx]
    num_pages = 1 + sum(pages_per_seq) + 2
    order = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(seqs), max(1, max(pages_per_seq)), dtype=torch.int32)
    k_full = [torch.randn(c, h_kv, D, generator=gen) for c in ctx]
    v_full = [torch.randn(c, h_kv, D, generator=gen) for c in ctx]
    k_pool = torch.randn(num_pages * page_size, h_kv, D, generator=gen)
    v_pool = torch.randn(num_pages * page_size, h_kv, D, generator=gen)
    out_loc = []
    for b, (prefix, new) in enumerate(seqs):
        table[b, : pages_per_seq[b]] = torch.tensor(order[: pages_per_seq[b]], dtype=torch.int32)
        order = order[pages_per_seq[b]:]
        locs = [int(table[b, p // page_size]) * page_size + p % page_size for p in range(ctx[b])]
        k_pool[locs[:prefix]] = k_full[b][:prefix]          # the cached prefix is already there
        v_pool[locs[:prefix]] = v_full[b][:prefix]
        out_loc += locs[prefix:]
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor([n for _, n in seqs]), 0)
    return dict(
        q=torch.randn(int(cu[-1]), h_q, D, generator=gen),
        k=torch.cat([k[p:] for k, (p, _) in zip(k_full, seqs)]),
        v=torch.cat([v[p:] for v, (p, _) in zip(v_full, seqs)]),
        k_pool=k_pool, v_pool=v_pool, out_loc=torch.tensor(out_loc, dtype=torch.int64),
        page_table=table, cu_seqlens=cu, seq_lens=torch.tensor(ctx, dtype=torch.int32),
        page_size=page_size, k_full=k_full, v_full=v_full, seqs=seqs)


def dense_reference(case, scale: float) -> torch.Tensor:
    out = torch.zeros(case["q"].shape)
    h_q, h_kv = case["q"].shape[1], case["k_full"][0].shape[1] if case["k_full"] else 1
    for b, (prefix, new) in enumerate(case["seqs"]):
        start = int(case["cu_seqlens"][b])
        for i in range(new):
            pos = prefix + i
            for h in range(h_q):
                keys = case["k_full"][b][: pos + 1, h // (h_q // h_kv)]
                vals = case["v_full"][b][: pos + 1, h // (h_q // h_kv)]
                probs = torch.softmax(keys @ case["q"][start + i, h] * scale, dim=0)
                out[start + i, h] = probs @ vals
    return out


def run_and_check(case, scale: float = 0.4) -> None:
    k_pool, v_pool = case["k_pool"].clone(), case["v_pool"].clone()
    out = paged_attention(case["q"], case["k"], case["v"], k_pool, v_pool, case["out_loc"],
                          case["page_table"], case["cu_seqlens"], case["seq_lens"],
                          case["page_size"], scale)
    torch.testing.assert_close(out, dense_reference(case, scale), atol=TOL, rtol=0)
    expect_k, expect_v = case["k_pool"].clone(), case["v_pool"].clone()
    expect_k[case["out_loc"]], expect_v[case["out_loc"]] = case["k"], case["v"]
    assert torch.equal(k_pool, expect_k) and torch.equal(v_pool, expect_v)  # nothing else written


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("heads", [(4, 2), (2, 2), (4, 1)])
def test_mixed_batch(page_size, heads):
    """Prefill, chunked-prefill continuation, decodes, and an idle (0 new tokens) sequence."""
    seqs = [(0, 7), (5, 1), (12, 1), (9, 4), (3, 0), (0, 1), (6, 1)]
    run_and_check(build_case(seqs, page_size, *heads, seed=page_size))


@settings(max_examples=20, deadline=None)
@given(seqs=st.lists(st.tuples(st.integers(0, 12), st.integers(0, 6)), min_size=1, max_size=5),
       page_size=st.sampled_from([1, 4]), heads=st.sampled_from([(4, 2), (2, 2), (6, 3)]),
       seed=st.integers(0, 2**16))
def test_random_batches(seqs, page_size, heads, seed):
    run_and_check(build_case(seqs, page_size, *heads, seed=seed))


def test_bf16_output_dtype():
    case = build_case([(3, 2), (4, 1)], 4, 4, 2, seed=0)
    for name in ("q", "k", "v", "k_pool", "v_pool"):
        case[name] = case[name].bfloat16()
    out = paged_attention(case["q"], case["k"], case["v"], case["k_pool"], case["v_pool"],
                          case["out_loc"], case["page_table"], case["cu_seqlens"], case["seq_lens"],
                          4, 0.3)
    assert out.dtype == torch.bfloat16 and out.shape == case["q"].shape


def test_seq_lens_shorter_than_new_tokens_raises():
    case = build_case([(0, 3)], 4, 2, 2, seed=0)
    with pytest.raises(ValueError, match="seq_lens"):
        paged_attention(case["q"], case["k"], case["v"], case["k_pool"], case["v_pool"],
                        case["out_loc"], case["page_table"], case["cu_seqlens"],
                        torch.tensor([2], dtype=torch.int32), 4, 0.3)

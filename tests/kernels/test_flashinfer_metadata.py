"""The FlashInfer glue's page metadata, checked on CPU through a torch model of FlashInfer's
paged-KV semantics (CSR pages, last-page length, bottom-right causal mask, NHD pages).

FlashInfer itself only runs on CUDA (tests/gpu); this pins what we hand it.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.attention.flashinfer_backend import paged_kv_metadata
from kernels.attention.reference import paged_attention_torch
from tests.kernels.attention_cases import build_case


def flashinfer_semantics(q, k_pool, v_pool, meta, page_size: int, scale: float) -> torch.Tensor:
    """What FlashInfer computes from ``meta`` over NHD pages ``pool.view(-1, page_size, H, D)``."""
    k_pages = k_pool.view(-1, page_size, *k_pool.shape[1:])
    v_pages = v_pool.view(-1, page_size, *v_pool.shape[1:])
    out = torch.zeros_like(q)
    group = q.shape[1] // k_pool.shape[1]
    qo, kv, idx, last = (t.tolist() for t in meta[:4])
    for i in range(len(last)):
        pages = idx[kv[i] : kv[i + 1]]
        kv_len = (len(pages) - 1) * page_size + last[i]
        keys = k_pages[pages].reshape(-1, *k_pool.shape[1:])[:kv_len]  # [L, Hkv, D]
        vals = v_pages[pages].reshape(-1, *v_pool.shape[1:])[:kv_len]
        rows = q[qo[i] : qo[i + 1]]  # [n, Hq, D]
        scores = torch.einsum("nhd,lhd->hnl", rows, keys.repeat_interleave(group, dim=1)) * scale
        q_pos = kv_len - rows.shape[0] + torch.arange(rows.shape[0])  # bottom-right
        scores = scores.masked_fill(torch.arange(kv_len)[None, :] > q_pos[:, None], float("-inf"))
        probs = scores.softmax(-1)
        out[qo[i] : qo[i + 1]] = torch.einsum("hnl,lhd->nhd", probs, vals.repeat_interleave(group, dim=1))
    return out


def check(seqs, page_size: int, heads: tuple[int, int], seed: int) -> None:
    case = build_case(seqs, page_size, *heads, seed=seed)
    k_pool, v_pool = case["k_pool"].clone(), case["v_pool"].clone()
    want = paged_attention_torch(
        case["q"],
        case["k"],
        case["v"],
        k_pool,
        v_pool,
        case["out_loc"],
        case["page_table"],
        case["cu_seqlens"],
        case["seq_lens"],
        page_size,
        0.4,
    )
    meta = paged_kv_metadata(case["page_table"], case["cu_seqlens"], case["seq_lens"], page_size)
    assert meta.all_decode == all(n == 1 for _, n in seqs if n > 0)
    assert all(1 <= n <= page_size for n in meta.kv_last_page_len.tolist())
    got = flashinfer_semantics(case["q"], k_pool, v_pool, meta, page_size, 0.4)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("page_size", [1, 4])
def test_mixed_batch(page_size):
    """Prefill, chunked-prefill continuation, decodes, verify-sized, and an idle sequence."""
    check([(0, 7), (5, 1), (12, 1), (9, 4), (3, 0), (0, 1), (6, 1)], page_size, (4, 2), seed=1)


def test_decode_only_batch():
    check([(5, 1), (12, 1), (0, 1)], 4, (8, 1), seed=2)


@settings(max_examples=20, deadline=None)
@given(
    seqs=st.lists(st.tuples(st.integers(0, 12), st.integers(0, 6)), min_size=1, max_size=5),
    page_size=st.sampled_from([1, 4]),
    seed=st.integers(0, 2**16),
)
def test_random_batches(seqs, page_size, seed):
    check(seqs, page_size, (4, 2), seed)


def test_rejects_short_seq_lens():
    case = build_case([(0, 3)], 4, 2, 2, seed=0)
    with pytest.raises(ValueError, match="seq_lens"):
        paged_kv_metadata(case["page_table"], case["cu_seqlens"], torch.tensor([2], dtype=torch.int32), 4)

"""FlashInfer paged attention against the torch path, over our pool layout, on CUDA.

Qwen3-Next attention sizes (16 query heads, 2 KV heads, head dim 256), bf16 pools with
shuffled pages: mixed batches (prefill, chunked-prefill continuation, decodes, multi-token
verify, an idle sequence) take the prefill wrapper, decode-only batches the decode wrapper.
"""
from __future__ import annotations

import math

import pytest
import torch

from tests.gpu.common import close, has_flashinfer

pytestmark = pytest.mark.skipif(not has_flashinfer(), reason="flashinfer is not installed")

PAGE = 16


def build(seqs: list[tuple[int, int]], h_q: int, h_kv: int, dim: int, seed: int,
          dev: str = "cuda"):
    """seqs: (cached prefix, new tokens). Returns the kwargs of paged_attention."""
    gen = torch.Generator().manual_seed(seed)
    ctx = [p + n for p, n in seqs]
    pages = [math.ceil(c / PAGE) for c in ctx]
    num_pages = 1 + sum(pages) + 4
    order = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(seqs), max(1, max(pages)), dtype=torch.int32)
    out_loc = []
    for b, (prefix, new) in enumerate(seqs):
        table[b, :pages[b]] = torch.tensor(order[:pages[b]], dtype=torch.int32)
        order = order[pages[b]:]
        out_loc += [int(table[b, p // PAGE]) * PAGE + p % PAGE for p in range(prefix, ctx[b])]
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor([n for _, n in seqs]), 0)
    num_tokens, bf16 = int(cu[-1]), torch.bfloat16
    return dict(
        q=torch.randn(num_tokens, h_q, dim, device=dev, dtype=bf16),
        k=torch.randn(num_tokens, h_kv, dim, device=dev, dtype=bf16),
        v=torch.randn(num_tokens, h_kv, dim, device=dev, dtype=bf16),
        k_pool=torch.randn(num_pages * PAGE, h_kv, dim, device=dev, dtype=bf16),
        v_pool=torch.randn(num_pages * PAGE, h_kv, dim, device=dev, dtype=bf16),
        out_loc=torch.tensor(out_loc, dtype=torch.int64, device=dev),
        page_table=table.to(dev), cu_seqlens=cu.to(dev),
        seq_lens=torch.tensor(ctx, dtype=torch.int32, device=dev), page_size=PAGE,
        scale=dim ** -0.5)


def compare(case: dict, what: str) -> None:
    from kernels.attention.flashinfer_backend import paged_attention_flashinfer
    from kernels.attention.reference import paged_attention_torch

    ref_case = {**case, "k_pool": case["k_pool"].clone(), "v_pool": case["v_pool"].clone()}
    want = paged_attention_torch(**ref_case)
    got = paged_attention_flashinfer(**case)
    close(got, want, 2e-2, 2e-2, what)
    assert torch.equal(case["k_pool"], ref_case["k_pool"])      # same KV written
    assert torch.equal(case["v_pool"], ref_case["v_pool"])


MIXED = [(0, 300), (100, 64), (1000, 1), (37, 1), (500, 4), (64, 0), (15, 4), (0, 1)]
DECODE = [(1000, 1), (37, 1), (15, 1), (4095, 1), (0, 1)]


@pytest.mark.parametrize("heads", [(16, 2), (8, 8)])
@pytest.mark.parametrize("seqs", [MIXED, DECODE], ids=["mixed", "decode"])
def test_matches_torch(seqs, heads):
    compare(build(seqs, *heads, dim=256, seed=1), f"{len(seqs)} seqs, heads {heads}")


def test_plan_reused_across_layers_and_replanned_for_a_new_batch():
    """Two layers on one batch (the second reuses the plan), then a different batch."""
    first = build(MIXED, 16, 2, 256, seed=2)
    compare(first, "layer 0")
    second = {**first, "k_pool": torch.randn_like(first["k_pool"]),
              "v_pool": torch.randn_like(first["v_pool"]), "q": torch.randn_like(first["q"])}
    compare(second, "layer 1 (plan reused)")
    compare(build(DECODE, 16, 2, 256, seed=3), "next step (new plan)")


def test_dispatcher_picks_flashinfer_on_cuda_bf16(monkeypatch):
    import kernels.attention
    from kernels import backend

    case = build([(10, 3)], 16, 2, 256, seed=4)

    def boom(*args, **kwargs):
        raise AssertionError("the torch attention ran")

    monkeypatch.setattr(kernels.attention, "paged_attention_torch", boom)
    with backend.use_backend("auto"):
        kernels.attention.paged_attention(**case)

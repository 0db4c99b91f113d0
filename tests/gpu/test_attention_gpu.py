"""Attention dispatch and FlashInfer's plans on CUDA (the kernels' numbers against the torch
path are stage (a)'s rows, ``test_kernels_gpu.py``)."""

from __future__ import annotations

import pytest
import torch

import kernels.attention
from kernels import backend
from tests.gpu.common import has_flashinfer
from tests.kernels.attention_cases import build_case, run_paged, with_dtype

MIXED = [(0, 300), (100, 64), (1000, 1), (37, 1), (500, 4), (64, 0), (15, 4), (0, 1)]
DECODE = [(1000, 1), (37, 1), (15, 1), (4095, 1), (0, 1)]


def _case(seqs, head_dim: int, seed: int):
    return with_dtype(build_case(seqs, 16, 16, 2, seed=seed, head_dim=head_dim), torch.bfloat16)


def _boom(*args, **kwargs):
    raise AssertionError("this attention implementation must not run here")


@pytest.mark.parametrize("head_dim", [32, 80, 256])
def test_dispatch_on_cuda(head_dim, monkeypatch):
    """bf16: FlashInfer at the head dims it is built for (when installed), the Triton kernel
    otherwise (the shipped tiny model's 32); never the torch path under ``auto``."""
    import kernels.attention.triton_paged as triton_paged

    flashinfer = has_flashinfer() and head_dim in backend.FLASHINFER_HEAD_DIMS
    monkeypatch.setattr(kernels.attention, "paged_attention_torch", _boom)
    if flashinfer:
        monkeypatch.setattr(triton_paged, "paged_attention_triton", _boom)
    with backend.use_backend("auto"):
        out, _, _ = run_paged(kernels.attention.paged_attention, _case(MIXED, head_dim, 1), head_dim**-0.5, "cuda")
    assert out.isfinite().all()


NAMES = ("q", "k", "v", "k_pool", "v_pool", "out_loc", "page_table", "cu_seqlens", "seq_lens")


@pytest.mark.skipif(not has_flashinfer(), reason="flashinfer is not installed")
def test_flashinfer_plan_reused_across_layers_and_replanned_for_a_new_batch():
    """Two layers on one batch's metadata tensors (the second reuses the plan), then a new
    batch (a new plan); each against the torch path."""
    from kernels.attention.flashinfer_backend import paged_attention_flashinfer
    from kernels.attention.reference import paged_attention_torch

    first = {n: t.to("cuda") for n, t in _case(MIXED, 256, seed=2).items() if n in NAMES}
    second = {
        **first,
        "k_pool": torch.randn_like(first["k_pool"]),
        "v_pool": torch.randn_like(first["v_pool"]),
        "q": torch.randn_like(first["q"]),
    }
    third = {n: t.to("cuda") for n, t in _case(DECODE, 256, seed=3).items() if n in NAMES}
    for case in (first, second, third):
        want = paged_attention_torch(
            **{**case, "k_pool": case["k_pool"].clone(), "v_pool": case["v_pool"].clone()},
            page_size=16,
            scale=256**-0.5,
        )
        got = paged_attention_flashinfer(**case, page_size=16, scale=256**-0.5)
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)

"""The Triton block-scaled FP8 GEMM against the torch reference: partial edge blocks in N
and K, one-row and multi-tile row counts, bias, bf16 and fp32 outputs."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8.reference import fp8_linear_torch, quantize_groups
from tests.kernels.fp8_cases import quantized_weight

BLOCK = (16, 32)


@pytest.mark.parametrize("m", [1, 5, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_kernel_equals_the_reference(m: int, dtype: torch.dtype, device) -> None:
    from kernels.fp8.triton_block import block_fp8_matmul

    _, wq, ws = quantized_weight(40, 72, "block", BLOCK, seed=m)
    x, bias = torch.randn(m, 72).to(dtype), torch.randn(40).to(dtype)
    q, scale = quantize_groups(x, BLOCK[1])
    got = block_fp8_matmul(q.to(device), scale.to(device), wq.to(device), ws.to(device), BLOCK, dtype, bias.to(device))
    want = fp8_linear_torch(x, wq, ws, bias, BLOCK)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert got.dtype == dtype and torch.allclose(got.cpu().float(), want.float(), rtol=tol, atol=tol)


def test_block_dispatch_takes_the_kernel_under_the_triton_backend(device) -> None:
    from kernels import backend
    from kernels.fp8 import fp8_linear

    _, wq, ws = quantized_weight(40, 72, "block", BLOCK)
    x = torch.randn(4, 72)
    with backend.use_backend("triton"):
        got = fp8_linear(x.to(device), wq.to(device), ws.to(device), block=BLOCK)
    assert torch.allclose(got.cpu(), fp8_linear_torch(x, wq, ws, block=BLOCK), rtol=1e-4, atol=1e-4)


def test_block_scales_that_do_not_fit_are_refused(device) -> None:
    from kernels.fp8.triton_block import block_fp8_matmul

    _, wq, ws = quantized_weight(40, 72, "block", BLOCK)
    q, scale = quantize_groups(torch.randn(2, 72), BLOCK[1])
    with pytest.raises(ValueError, match=r"block scales do not fit: .*\(40, 72\) with \(3, 3\)"):
        block_fp8_matmul(q, scale, wq, ws, (32, 32), torch.float32)

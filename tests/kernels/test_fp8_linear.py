"""FP8 linear products (``kernels.fp8``): the activation quantization, the torch reference
against a product written out block by block, and ``torch._scaled_mm``'s row-wise path
against the reference. The Triton block kernel: ``triton_path/test_fp8_triton.py``."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8 import FP8, fp8_linear, fp8_linear_torch, quantize_groups, quantize_rows
from kernels.fp8.reference import dequantize_input
from tests.kernels.fp8_cases import quantized_weight


def _close_to_input(deq: torch.Tensor, x: torch.Tensor, scale: torch.Tensor) -> bool:
    """Within e4m3's rounding: half a step (1/16 relative) above its normal range, and its
    subnormal step (scale * 2^-9) below it."""
    return bool(((deq - x).abs() <= x.abs() / 16 + scale * 2**-9 + 1e-12).all())


def test_activation_quantization_rounds_within_e4m3_and_keeps_zero_rows() -> None:
    x = torch.randn(6, 70) * torch.tensor([1e-3, 1.0, 30.0, 0.0, 5.0, 1e4])[:, None]
    q, scale = quantize_rows(x)
    assert q.dtype == FP8 and scale.shape == (6, 1)
    assert _close_to_input(dequantize_input(q, scale, None), x, scale)
    assert torch.equal(q[3].float(), torch.zeros(70))  # an all-zero row: zeros, not NaN
    qg, gscale = quantize_groups(x, 32)
    assert gscale.shape == (6, 3)  # 70 = 32 + 32 + 6: the last group partial
    assert _close_to_input(dequantize_input(qg, gscale, 32), x, gscale.repeat_interleave(32, 1)[:, :70])


def test_a_static_input_scale_saturates_instead_of_overflowing() -> None:
    x = torch.tensor([[1.0, -1000.0, 3.0]])
    q, scale = quantize_rows(x, input_scale=torch.tensor(0.5))
    assert scale.item() == 0.5 and q.float().tolist() == [[2.0, -448.0, 6.0]]


@pytest.mark.parametrize("layout", ["tensor", "channel", "block"])
def test_the_reference_is_the_blockwise_product_of_the_dequantized_operands(layout: str) -> None:
    """Written out without the reference's helpers: per output column, per K group."""
    n, k, block = 40, 72, (16, 32)
    _, wq, ws = quantized_weight(n, k, layout, block)
    x = torch.randn(3, k)
    got = fp8_linear_torch(x, wq, ws, block=block if layout == "block" else None)
    want = torch.zeros(3, n)
    for row in range(3):
        for lo in range(0, k, block[1]) if layout == "block" else [0]:
            hi = min(lo + block[1], k) if layout == "block" else k
            part = x[row, lo:hi]
            a_scale = max(part.abs().max().item() / 448.0, 1e-12)
            a = (part / a_scale).clamp(-448, 448).to(FP8).float() * a_scale
            for col in range(n):
                if layout == "tensor":
                    w_scale = ws.item()
                elif layout == "channel":
                    w_scale = ws[col, 0].item()
                else:
                    w_scale = ws[col // block[0], lo // block[1]].item()
                want[row, col] += (a * wq[col, lo:hi].float() * w_scale).sum()
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["tensor", "channel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scaled_mm_rowwise_equals_the_reference(layout: str, dtype: torch.dtype) -> None:
    _, wq, ws = quantized_weight(48, 64, layout)
    x, bias = torch.randn(2, 5, 64).to(dtype), torch.randn(48).to(dtype)
    got = fp8_linear(x, wq, ws, bias)
    want = fp8_linear_torch(x.reshape(10, 64), wq, ws, bias).reshape(2, 5, 48)
    assert got.shape == (2, 5, 48) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)


def test_fp8_products_stay_near_the_full_precision_product() -> None:
    """What FP8 costs: both operands rounded to 3 mantissa bits, the sums still within a few
    percent of the fp32 product's scale."""
    w, wq, ws = quantized_weight(64, 256, "channel")
    x = torch.randn(8, 256)
    exact = x @ w.t()
    err = (fp8_linear(x, wq, ws) - exact).abs().max() / exact.abs().max()
    assert err < 0.05


def test_bad_operands_are_refused_with_their_shapes() -> None:
    w, wq, ws = quantized_weight(40, 72, "block")
    with pytest.raises(ValueError, match="needs an e4m3 weight"):
        fp8_linear(torch.randn(2, 72), w, ws)
    with pytest.raises(ValueError, match="static input_scale goes with per-tensor"):
        fp8_linear_torch(torch.randn(2, 72), wq, ws, block=(16, 32), input_scale=torch.tensor(1.0))

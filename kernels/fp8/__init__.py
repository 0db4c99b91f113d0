"""FP8 (e4m3) linear products for checkpoints whose weights stay FP8 in memory.

``fp8_linear(x, weight, weight_scale, bias, block, input_scale)``: the layouts and the
activation quantization they prescribe are in ``reference``'s docstring. Paths:

- per tensor / per channel: ``torch._scaled_mm`` with row-wise scales (one per token, one
  per output channel; cuBLASLt's FP8 GEMM on sm89+, oneDNN on CPU) where its shape rules hold
  (K and N multiples of 16 on CUDA), else the torch reference;
- block (``weight_block_size``): the Triton kernel ``triton_block`` on CUDA (or under
  ``kernels.backend``'s ``triton`` with the interpreter), else the torch reference.

The torch reference dequantizes both operands to fp32: the oracle of the other two (tested
in ``tests/kernels/test_fp8_linear.py``) and the path wherever neither runs. Called by
``kernels.dense.Linear`` when its weight is e4m3 (``fp8_weights``, ``workers/quantization/keep.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels import backend
from kernels.fp8.reference import (
    FP8,
    dequantize_weight,
    fp8_linear_torch,
    quantize_groups,
    quantize_input,
    quantize_rows,
)

__all__ = ["FP8", "dequantize_weight", "fp8_linear", "fp8_linear_torch", "quantize_groups", "quantize_rows"]

_SCALED_MM_ALIGN = 16  # cuBLASLt's FP8 GEMM: K and N multiples of 16


def fp8_linear(
    x: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    bias: Tensor | None = None,
    block: tuple[int, int] | None = None,
    input_scale: Tensor | None = None,
) -> Tensor:
    """x [..., K] -> [..., N] in x.dtype: ``x @ weight^T`` with FP8 operands (see the module)."""
    if weight.dtype != FP8:
        raise ValueError(f"fp8_linear needs an e4m3 weight, got {weight.dtype}")
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)
    if block is not None:
        out = _block(rows, weight, weight_scale, bias, block)
    elif _scaled_mm_fits(rows, weight):
        out = _rowwise(rows, weight, weight_scale, bias, input_scale)
    else:
        out = fp8_linear_torch(rows, weight, weight_scale, bias, None, input_scale)
    return out.reshape(*lead, weight.shape[0])


def _block(x: Tensor, weight: Tensor, weight_scale: Tensor, bias: Tensor | None, block: tuple[int, int]) -> Tensor:
    if not backend.use_triton(x):
        return fp8_linear_torch(x, weight, weight_scale, bias, block)
    from kernels.fp8.triton_block import block_fp8_matmul

    q, scale = quantize_input(x, block)
    return block_fp8_matmul(q, scale, weight, weight_scale, block, x.dtype, bias)


def _scaled_mm_fits(x: Tensor, weight: Tensor) -> bool:
    if backend.get_backend() is backend.Backend.TORCH:
        return False
    n, k = weight.shape
    return not x.is_cuda or (k % _SCALED_MM_ALIGN == 0 and n % _SCALED_MM_ALIGN == 0)


def _rowwise(
    x: Tensor, weight: Tensor, weight_scale: Tensor, bias: Tensor | None, input_scale: Tensor | None
) -> Tensor:
    q, scale = quantize_rows(x, input_scale)
    n = weight.shape[0]
    w_scale = weight_scale.float().reshape(1, -1).expand(1, n).contiguous()  # per tensor -> per channel
    out_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.float32
    out = torch._scaled_mm(q, weight.t(), scale_a=scale, scale_b=w_scale, out_dtype=out_dtype)
    return out if bias is None else out + bias.to(out.dtype)

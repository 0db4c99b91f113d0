"""FP8 (e4m3) linear products in torch: activation quantization and the dequantized product
every other path is checked against (and the path where no FP8 GEMM runs).

Weight layouts (as the checkpoints store them, ``workers/quantization``): ``weight`` e4m3
[N, K] with ``weight_scale`` fp32 of shape [] or [1] (per tensor), [N, 1] (per output channel)
or [ceil(N / bn), ceil(K / bk)] (per ``block = (bn, bk)``; edge blocks partial). Activations
are quantized per token (rows) for the first two and per token and ``bk``-group of K for the
block layout, dynamically (``scale = amax / 448``), unless a static per-tensor ``input_scale``
is given (ModelOpt's).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_SCALE = 1e-12  # an all-zero row quantizes to zeros with this scale, not NaN


def quantize(x: Tensor, scale: Tensor) -> Tensor:
    """``x / scale`` saturated into e4m3 (``scale`` broadcast against x)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_rows(x: Tensor, input_scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 scales [M, 1]): one scale per row, or the static one."""
    if input_scale is not None:
        scale = input_scale.float().reshape(1, 1).expand(x.shape[0], 1)
    else:
        scale = (x.float().abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    return quantize(x, scale), scale.contiguous()


def quantize_groups(x: Tensor, group: int) -> tuple[Tensor, Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 scales [M, ceil(K / group)]): one scale per row and
    group of ``group`` columns (the last group partial)."""
    m, k = x.shape
    groups = math.ceil(k / group)
    padded = torch.nn.functional.pad(x.float(), (0, groups * group - k)).view(m, groups, group)
    scale = (padded.abs().amax(dim=-1) / FP8_MAX).clamp(min=MIN_SCALE)  # [M, G]
    q = quantize(padded, scale[..., None]).view(m, groups * group)[:, :k]
    return q.contiguous(), scale


def expand_block_scales(scale: Tensor, shape: tuple[int, int], block: tuple[int, int]) -> Tensor:
    """[ceil(R / br), ceil(C / bc)] block scales -> one per element of an [R, C] matrix."""
    rows, cols = shape
    return scale.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]


def dequantize_weight(weight: Tensor, weight_scale: Tensor, block: tuple[int, int] | None) -> Tensor:
    """The fp32 weight [N, K] the FP8 one stands for."""
    w = weight.float()
    if block is not None:
        return w * expand_block_scales(weight_scale, tuple(w.shape), block)  # type: ignore[arg-type]
    scale = weight_scale.float()
    return w * (scale.reshape(-1, 1) if scale.numel() > 1 else scale.reshape(()))


def quantize_input(
    x: Tensor, block: tuple[int, int] | None, input_scale: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The activation quantization the weight layout prescribes (see the module docstring)."""
    if block is not None:
        if input_scale is not None:
            raise ValueError("a static input_scale goes with per-tensor / per-channel weights, not block scales")
        return quantize_groups(x, block[1])
    return quantize_rows(x, input_scale)


def dequantize_input(q: Tensor, scale: Tensor, group: int | None) -> Tensor:
    if group is None:
        return q.float() * scale
    return q.float() * scale.repeat_interleave(group, 1)[:, : q.shape[1]]


def fp8_linear_torch(
    x: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    bias: Tensor | None = None,
    block: tuple[int, int] | None = None,
    input_scale: Tensor | None = None,
) -> Tensor:
    """x [M, K] -> x_q @ w_q^T with both operands quantized as the layout prescribes, in fp32,
    returned in x.dtype (+ bias)."""
    q, scale = quantize_input(x, block, input_scale)
    out = (
        dequantize_input(q, scale, None if block is None else block[1])
        @ dequantize_weight(weight, weight_scale, block).t()
    )
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)

"""FP8 weights of every layout, quantized here from random fp32 ones (the FP8 tests' inputs)."""

from __future__ import annotations

import math

import torch

from kernels.fp8.reference import FP8, FP8_MAX, expand_block_scales


def quantized_weight(n: int, k: int, layout: str, block: tuple[int, int] = (16, 32), seed: int = 0):
    """(fp32 weight [N, K], e4m3 weight, its scale) for ``layout`` tensor / channel / block."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 3  # rows of different ranges
    if layout == "tensor":
        scale = w.abs().max() / FP8_MAX
    elif layout == "channel":
        scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
    else:
        rows, cols = math.ceil(n / block[0]), math.ceil(k / block[1])
        padded = torch.nn.functional.pad(w, (0, cols * block[1] - k, 0, rows * block[0] - n))
        scale = padded.view(rows, block[0], cols, block[1]).abs().amax(dim=(1, 3)) / FP8_MAX
        return w, (w / expand_block_scales(scale, (n, k), block)).to(FP8), scale
    return w, (w / scale).to(FP8), scale

"""The projections' fp32 CPU product: the few-rows kernel for a handful of rows, else
``kernels/cpu_linear.py``'s library rule.

A product of at most ``FEW_ROWS`` rows -- a decode or verify step's, a draft chain's, an
lm-head over a few positions -- takes as long as its weight's bytes, and MKL's small-M sgemm
overlaps little of its arithmetic with that read. ``hybridserve_native::few_rows_linear``
(``kernels/native_gemm.cpp``) streams each weight row once against every row, faster than
MKL's packed product at a few rows and as fast at one (BENCHMARKS.md). It runs eager and
traced alike: inductor calls it as an extern kernel (its fake gives the shape), so a
compiled step and the eager forward compute those rows with the same bits. An output is
one dot product in a fixed order, so a row's bits depend on that row alone, never on the
row count: a projection gives a verify's row the bits it gives the same input in a decode
step, whatever the batch.

Above ``FEW_ROWS`` rows (from 12 rows MKL's packed product is as fast), and where the kernel
does not apply (the ``torch`` kernel backend, autograd, other dtypes, a weight whose rows are
not contiguous, the native ops not built), ``cpu_linear.linear`` runs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels import backend, cpu_linear, native_ops

FEW_ROWS = 8


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)`` by the few-rows kernel where ``few_rows`` says so."""
    if few_rows(x, weight, bias):
        return torch.ops.hybridserve_native.few_rows_linear(x, weight, bias)
    return cpu_linear.linear(x, weight, bias)


def few_rows(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """Whether ``x``'s rows take the few-rows kernel: 1 to ``FEW_ROWS`` fp32 CPU rows under the
    ``auto`` kernel backend (``torch`` keeps ATen's product), an fp32 weight with contiguous
    rows, no autograd to record, the native ops built."""
    if not backend.use_native(x) or x.dtype != torch.float32 or weight.dtype != torch.float32:
        return False
    if weight.dim() != 2 or weight.stride(-1) != 1 or x.shape[-1] == 0:
        return False
    if bias is not None and bias.dtype != torch.float32:
        return False
    if not 1 <= x.numel() // x.shape[-1] <= FEW_ROWS:
        return False
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
        return False
    # a compiled step loads the ops before it traces (load() takes a lock: never while tracing)
    return native_ops.loaded() or (not torch.compiler.is_compiling() and native_ops.load())


class Linear(torch.nn.Linear):
    """``nn.Linear`` (same parameters, same checkpoint names) whose forward is ``linear``."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)

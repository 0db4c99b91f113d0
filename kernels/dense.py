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

So by default a row's bits depend on its batch's row count (which kernel runs), and a
near-tie (a MoE router's, a greedy choice) can flip when a request shares a step with
others. The batch-invariant mode (``batch_invariant()``, the ``deterministic`` config field,
set per step by the model runner on its thread) takes every eligible product, and the
callers that ask ``invariant()`` (the MoE router and experts, Mamba1's dt projection, MLA's
head products), through the few-rows kernel at any row count: a row then gets the same bits
alone or in any batch, for a slower prefill (BENCHMARKS.md).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels import backend, cpu_linear, fp8, native_ops

FEW_ROWS = 8
ROW_ALIGN = 64  # floats: a padded row's every element takes ATen's vector formula
_mode = threading.local()


def invariant() -> bool:
    """Whether this thread runs the batch-invariant mode (never while tracing: compiled steps
    are off in that mode)."""
    return not torch.compiler.is_compiling() and getattr(_mode, "on", False)


@contextmanager
def batch_invariant(on: bool = True) -> Iterator[None]:
    """Run the batch-invariant mode (see the module docstring) on this thread inside."""
    old = getattr(_mode, "on", False)
    _mode.on = on
    try:
        yield
    finally:
        _mode.on = old


def check_invariant_mode(device: torch.device, dtypes: set[torch.dtype]) -> None:
    """Refuse the batch-invariant mode where its kernels do not run (a ValueError saying why)."""
    if device.type != "cpu" or dtypes - {torch.float32}:
        got = ", ".join(sorted(str(d) for d in dtypes))
        raise ValueError(f"deterministic needs an fp32 model on CPU, got {device.type} and {got}")
    if backend.get_backend() is not backend.Backend.AUTO or not native_ops.load():
        raise ValueError(f"deterministic needs the auto kernel backend and the native ops: {native_ops.failure()}")


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)`` by the few-rows kernel where ``few_rows`` says so."""
    if few_rows(x, weight, bias):
        return torch.ops.hybridserve_native.few_rows_linear(x, weight, bias)
    if invariant():  # refused rather than silently batch-dependent
        raise RuntimeError(
            f"the batch-invariant mode has no row-invariant product for {x.dtype} {x.device.type} rows and a "
            f"{weight.dtype} weight: it needs fp32 on CPU, the auto kernel backend and the native ops"
        )
    return cpu_linear.linear(x, weight, bias)


def plain_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear`` (a product that keeps ATen's kernel by default), or ``linear`` in the
    batch-invariant mode."""
    return linear(x, weight, bias) if invariant() else F.linear(x, weight, bias)


def few_rows(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """Whether ``x``'s rows take the few-rows kernel: 1 to ``FEW_ROWS`` fp32 CPU rows (any
    number in the batch-invariant mode) under the ``auto`` kernel backend (``torch`` keeps
    ATen's product), an fp32 weight with contiguous rows, no autograd to record, the native
    ops built."""
    if not backend.use_native(x) or x.dtype != torch.float32 or weight.dtype != torch.float32:
        return False
    if weight.dim() != 2 or weight.stride(-1) != 1 or x.shape[-1] == 0:
        return False
    if bias is not None and bias.dtype != torch.float32:
        return False
    rows = x.numel() // x.shape[-1]
    if not (1 <= rows <= FEW_ROWS or (rows > FEW_ROWS and invariant())):
        return False
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
        return False
    # a compiled step loads the ops before it traces (load() takes a lock: never while tracing)
    return native_ops.loaded() or (not torch.compiler.is_compiling() and native_ops.load())


class Linear(torch.nn.Linear):
    """``nn.Linear`` (same parameters, same checkpoint names) whose forward is ``linear``; with
    an e4m3 weight (an FP8 checkpoint kept FP8, ``workers/quantization/keep.py``) and its
    ``weight_scale``, ``kernels.fp8.fp8_linear``."""

    fp8_block: tuple[int, int] | None = None

    def forward(self, x: Tensor) -> Tensor:
        if self.weight.dtype == fp8.FP8:
            return fp8.fp8_linear(x, self.weight, self.weight_scale, self.bias, self.fp8_block)
        return linear(x, self.weight, self.bias)


def pointwise(fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """``fn(x)`` for an elementwise ``fn``; in the batch-invariant mode on rows padded to
    ``ROW_ALIGN`` floats: ATen finishes a length that is not a multiple of its vector pair with
    the scalar formula (other bits), so a narrow row's bits would depend on its place."""
    width = x.shape[-1]
    if not invariant() or width % ROW_ALIGN == 0:
        return fn(x)
    return fn(F.pad(x, (0, ROW_ALIGN - width % ROW_ALIGN)))[..., :width]


def head_products(x: Tensor, weight: Tensor) -> Tensor:
    """x [T, H, K] and per-head weight rows [H, N, K] -> [T, H, N] (``einsum("thk,hnk->thn")``);
    in the batch-invariant mode by ``linear`` per head (a batched product sums by its size)."""
    if not invariant():
        return torch.einsum("thk,hnk->thn", x, weight)
    return torch.stack([linear(x[:, h], weight[h].contiguous()) for h in range(weight.shape[0])], dim=1)

"""Block-scaled FP8 GEMM (the DeepSeek / Qwen ``weight_block_size`` layout): A e4m3 [M, K] with
per-row, per-``bk``-group scales [M, KB]; B (the weight) e4m3 [N, K] with per-(bn, bk)-block
scales [NB, KB]; out [M, N] = sum_kb (A_kb @ B_kb^T) * a_scale[:, kb] * b_scale[n // bn, kb].

One program per [BM, BN] output tile walks K one scale group at a time (BK = bk), so each
partial product is an FP8 ``tl.dot`` (tensor cores on Hopper) rescaled in fp32. Edge tiles and
a K that is not a multiple of bk are masked (zeros add nothing).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.launch_grid import row_block_grid


@triton.jit
def block_fp8_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, out_ptr, bias_ptr,
    M, N, K, KB, block_n,
    HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(0, KB):
        k = kb * BK + ks
        k_ok = k < K
        a = tl.load(a_ptr + rows[:, None] * K + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptr + cols[None, :] * K + k[:, None], mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        a_s = tl.load(a_scale_ptr + rows * KB + kb, mask=row_ok, other=0.0)
        b_s = tl.load(b_scale_ptr + (cols // block_n) * KB + kb, mask=col_ok, other=0.0)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out_mask = row_ok[:, None] & col_ok[None, :]
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def block_fp8_matmul(
    a: Tensor,
    a_scale: Tensor,
    b: Tensor,
    b_scale: Tensor,
    block: tuple[int, int],
    out_dtype: torch.dtype,
    bias: Tensor | None = None,
) -> Tensor:
    """a e4m3 [M, K], a_scale fp32 [M, KB]; b e4m3 [N, K], b_scale fp32 [NB, KB] -> [M, N]."""
    m, k = a.shape
    n = b.shape[0]
    bn, bk = block
    kb = triton.cdiv(k, bk)
    if a_scale.shape != (m, kb) or b_scale.shape != (triton.cdiv(n, bn), kb):
        raise ValueError(
            f"block scales do not fit: a {tuple(a.shape)} with {tuple(a_scale.shape)}, b {tuple(b.shape)} "
            f"with {tuple(b_scale.shape)}, block {block}"
        )
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    bm = 16 if m <= 16 else 64
    bn_tile = min(bn, 64 if not a.is_cuda or m <= 16 else 128)
    grid = row_block_grid("block_fp8_matmul", m, bm, n, bn_tile)
    block_fp8_kernel[grid](
        a.contiguous(), a_scale.float().contiguous(), b.contiguous(), b_scale.float().contiguous(), out,
        bias if bias is not None else out, m, n, k, kb, bn,
        HAS_BIAS=bias is not None, BM=bm, BN=bn_tile, BK=bk,
    )  # fmt: skip
    return out

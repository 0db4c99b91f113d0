"""Triton RMSNorm (plain, zero-centred, gated either way, grouped) against the torch reference."""

from __future__ import annotations

import pytest
import torch

from kernels.norm.reference import gated_rms_norm_torch, rms_norm_torch

DIM, EPS = 24, 1e-6


def rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("zero_centered", [False, True])
def test_rms_norm(zero_centered, device, tol, max_abs_diff):
    from kernels.norm.triton_norm import rms_norm_triton

    x, w = rand(3, 5, DIM, seed=1), rand(DIM, seed=2)
    out = rms_norm_triton(x.to(device), w.to(device), EPS, zero_centered)
    assert out.shape == x.shape
    assert max_abs_diff(out.cpu(), rms_norm_torch(x, w, EPS, zero_centered)) <= tol


@pytest.mark.parametrize("group_size", [None, DIM // 3, DIM // 4])
@pytest.mark.parametrize("norm_before_gate", [True, False])
def test_gated_rms_norm(group_size, norm_before_gate, device, tol, max_abs_diff):
    from kernels.norm.triton_norm import gated_rms_norm_triton

    x, z, w = rand(7, DIM, seed=3), rand(7, DIM, seed=4), rand(DIM, seed=5)
    ref = gated_rms_norm_torch(x, z, w, EPS, group_size, norm_before_gate)
    out = gated_rms_norm_triton(x.to(device), z.to(device), w.to(device), EPS, group_size, norm_before_gate)
    assert max_abs_diff(out.cpu(), ref) <= tol


def test_bf16_and_bad_group(device):
    from kernels.norm.triton_norm import gated_rms_norm_triton

    x, z, w = rand(4, DIM, seed=6).bfloat16(), rand(4, DIM, seed=7).bfloat16(), rand(DIM, seed=8)
    out = gated_rms_norm_triton(x.to(device), z.to(device), w.to(device), EPS)
    assert out.dtype == torch.bfloat16
    ref = gated_rms_norm_torch(x, z, w, EPS, None, True)
    torch.testing.assert_close(out.cpu().float(), ref.float(), rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="group_size"):
        gated_rms_norm_triton(x.to(device), z.to(device), w.to(device), EPS, group_size=5)

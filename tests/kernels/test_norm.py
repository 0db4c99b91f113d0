"""RMSNorm variants against the transformers classes whose conventions they must match."""

from __future__ import annotations

import pytest
import torch

from kernels.norm import gated_rms_norm, rms_norm

qwen = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
granite = pytest.importorskip("transformers.models.granitemoehybrid.modeling_granitemoehybrid")

DIM, EPS, TOL = 24, 1e-6, 1e-5


def rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def with_weight(module: torch.nn.Module, weight: torch.Tensor) -> torch.nn.Module:
    with torch.no_grad():
        module.weight.copy_(weight)
    return module


def test_zero_centered_matches_qwen3next_rmsnorm():
    x, w = rand(5, DIM, seed=1), rand(DIM, seed=2) * 0.1
    ref = with_weight(qwen.Qwen3NextRMSNorm(DIM, eps=EPS), w)(x)
    torch.testing.assert_close(rms_norm(x, w, EPS, zero_centered=True), ref, atol=TOL, rtol=0)


def test_plain_matches_granite_rmsnorm():
    x, w = rand(5, DIM, seed=3), rand(DIM, seed=4)
    ref = with_weight(granite.GraniteMoeHybridRMSNorm(DIM, eps=EPS), w)(x)
    torch.testing.assert_close(rms_norm(x, w, EPS), ref, atol=TOL, rtol=0)


def test_norm_before_gate_matches_qwen3next_gated():
    x, z, w = rand(7, DIM, seed=5), rand(7, DIM, seed=6), rand(DIM, seed=7)
    ref = with_weight(qwen.Qwen3NextRMSNormGated(DIM, eps=EPS), w)(x, z)
    torch.testing.assert_close(gated_rms_norm(x, z, w, EPS), ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("group_size", [DIM, DIM // 3])
def test_gate_before_norm_matches_granite_gated(group_size):
    x, z, w = rand(7, DIM, seed=8), rand(7, DIM, seed=9), rand(DIM, seed=10)
    ref = with_weight(granite.GraniteMoeHybridRMSNormGated(DIM, group_size, eps=EPS), w)(x, z)
    out = gated_rms_norm(x, z, w, EPS, group_size=group_size, norm_before_gate=False)
    torch.testing.assert_close(out, ref, atol=TOL, rtol=0)


def test_groups_differ_from_whole_row():
    """The group rule is live: per-group rms is not the whole-row rms."""
    x = rand(3, DIM, seed=11) * torch.linspace(0.1, 3, DIM)  # very uneven channel scales
    z, w = rand(3, DIM, seed=12), torch.ones(DIM)
    grouped = gated_rms_norm(x, z, w, EPS, group_size=DIM // 4, norm_before_gate=False)
    whole = gated_rms_norm(x, z, w, EPS, norm_before_gate=False)
    assert (grouped - whole).abs().max() > 1e-2


def test_dtype_and_bad_group():
    x, z, w = rand(2, DIM).bfloat16(), rand(2, DIM).bfloat16(), torch.ones(DIM)
    assert gated_rms_norm(x, z, w, EPS).dtype == torch.bfloat16
    assert rms_norm(x, w, EPS, zero_centered=True).dtype == torch.bfloat16
    ref = with_weight(qwen.Qwen3NextRMSNormGated(DIM, eps=EPS), w)(x, z)
    torch.testing.assert_close(gated_rms_norm(x, z, w, EPS), ref, atol=2e-2, rtol=1e-2)
    with pytest.raises(ValueError, match="group_size"):
        gated_rms_norm(x, z, w, EPS, group_size=5)

"""The eager CPU forward's fused C++ ops (``kernels/fused_cpu.py``): close to the torch
reference at every tail length and layout, and each row's bits its own (what keeps a
token's result the same whether it is computed alone, in a batch, or after a cached prefix)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import backend, fused_cpu, native_ops
from kernels.gdn.reference import L2NORM_EPS, normalized_qk
from kernels.norm import gated_rms_norm, rms_norm
from kernels.norm.reference import gated_rms_norm_torch, rms_norm_torch

EPS = 1e-6


@pytest.fixture(autouse=True)
def _native() -> None:
    assert native_ops.load(), native_ops.failure()


def rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dim", [7, 16, 24, 64, 256, 300])
@pytest.mark.parametrize("zero_centered", [True, False])
def test_rms_norm_matches_the_reference(dim, zero_centered):
    x, w = rand(37, dim, seed=1), rand(dim, seed=2)
    assert fused_cpu.usable(x, w)
    torch.testing.assert_close(fused_cpu.rms_norm(x, w, EPS, zero_centered), rms_norm_torch(x, w, EPS, zero_centered))


def test_rms_norm_reads_a_column_slice_in_place_and_other_layouts_by_copy():
    """q of a gated attention: [T, H, 2D] chunked to its first D -- rows 2D apart."""
    wide, w = rand(9, 4, 128, seed=3), rand(64, seed=4)
    for x in (wide[..., :64], wide.transpose(0, 1)[..., 64:]):
        torch.testing.assert_close(fused_cpu.rms_norm(x, w, EPS, True), rms_norm_torch(x, w, EPS, True))


@pytest.mark.parametrize("dim,group", [(32, None), (24, 8), (60, 20), (256, 64)])
@pytest.mark.parametrize("norm_before_gate", [True, False])
def test_gated_rms_norm_matches_the_reference(dim, group, norm_before_gate):
    x, z, w = rand(41, dim, seed=5), rand(41, dim, seed=6), rand(dim, seed=7)
    torch.testing.assert_close(
        fused_cpu.gated_rms_norm(x, z, w, EPS, group, norm_before_gate),
        gated_rms_norm_torch(x, z, w, EPS, group, norm_before_gate),
    )


def test_gated_rms_norm_refuses_a_group_that_does_not_divide():
    x = rand(3, 24)
    with pytest.raises(ValueError, match="group_size 7 does not divide the last dim 24"):
        fused_cpu.gated_rms_norm(x, x, rand(24), EPS, 7, True)


@pytest.mark.parametrize("dim", [5, 16, 77, 256])
def test_silu_and_mul_matches_the_reference(dim):
    g, u = rand(23, dim, seed=8), rand(23, dim, seed=9)
    torch.testing.assert_close(fused_cpu.silu_and_mul(g, u), F.silu(g) * u)


@pytest.mark.parametrize("dim", [20, 32, 128])
def test_l2norm_scale_is_the_gdn_reference_normalisation(dim):
    """q scaled by 1/sqrt(K) after the norm, k only normalised; q, k as column slices."""
    qk = rand(19, 4, 2 * dim, seed=18)
    q, k = qk[..., :dim], qk[..., dim:]
    want_q, want_k = normalized_qk(q, k, None, True)
    torch.testing.assert_close(fused_cpu.l2norm_scale(q, L2NORM_EPS, dim**-0.5), want_q)
    torch.testing.assert_close(fused_cpu.l2norm_scale(k, L2NORM_EPS, 1.0), want_k)


@pytest.mark.parametrize("dim,rot", [(64, 16), (64, 64), (32, 10), (128, 64)])
def test_rope_matches_apply_rotary(dim, rot):
    """Partial rotary (Qwen3-Next: a quarter of the head), whole-head, and a rot of 10 (no
    vector width divides it); cos / sin from real positions."""
    from workers.models.layers import RotaryEmbedding, apply_rotary

    x = rand(21, 3, dim, seed=19)
    tables = RotaryEmbedding(rot, 10000.0).tables(torch.arange(5, 26), torch.float32)
    with backend.use_backend("torch"):
        want = apply_rotary(x, tables)
    torch.testing.assert_close(fused_cpu.rope(x, *tables), want)
    assert torch.equal(apply_rotary(x, tables), fused_cpu.rope(x, *tables))  # the eager path


@pytest.mark.parametrize("dim", [24, 77, 256])
def test_a_row_gets_the_same_bits_alone_or_in_a_batch(dim):
    x, z, w = rand(29, dim, seed=10), rand(29, dim, seed=11), rand(dim, seed=12)
    ops = [
        lambda a, b: fused_cpu.rms_norm(a, w, EPS, True),
        lambda a, b: fused_cpu.gated_rms_norm(a, b, w, EPS, None, True),
        lambda a, b: fused_cpu.gated_rms_norm(a, b, w, EPS, None, False),
        fused_cpu.silu_and_mul,
        lambda a, b: fused_cpu.l2norm_scale(a, EPS, 0.5),
    ]
    for op in ops:
        batch = op(x, z)
        for r in (0, 13, 28):
            assert torch.equal(op(x[r : r + 1], z[r : r + 1])[0], batch[r])
            assert torch.equal(op(x[r:], z[r:])[0], batch[r])


def test_the_fused_path_is_taken_only_where_it_applies():
    x, w = rand(4, 16), rand(16)
    assert fused_cpu.usable(x, w)
    assert not fused_cpu.usable(x.double(), w.double())
    assert not fused_cpu.usable(x, w.requires_grad_())
    with backend.use_backend("torch"):
        assert not fused_cpu.usable(x, w.detach())


def test_the_norms_take_the_fused_kernels_on_cpu_and_the_reference_under_the_torch_backend():
    x, z, w = rand(6, 40, seed=13), rand(6, 40, seed=14), rand(40, seed=15)
    assert torch.equal(rms_norm(x, w, EPS, zero_centered=True), fused_cpu.rms_norm(x, w, EPS, True))
    assert torch.equal(gated_rms_norm(x, z, w, EPS), fused_cpu.gated_rms_norm(x, z, w, EPS, None, True))
    with backend.use_backend("torch"):
        assert torch.equal(rms_norm(x, w, EPS, zero_centered=True), rms_norm_torch(x, w, EPS, True))


def test_a_compiled_function_keeps_the_torch_formulation():
    seen = []

    def f(x, w):
        seen.append(fused_cpu.usable(x, w))
        return rms_norm(x, w, EPS, zero_centered=True)

    x, w = rand(5, 32, seed=16), rand(32, seed=17)
    torch.compile(f, backend="eager", fullgraph=True)(x, w)
    assert seen == [False]

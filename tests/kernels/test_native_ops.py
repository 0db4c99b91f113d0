"""The C++ pool write (``kernels/native_ops.py``) against the Python op it stands in for."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_linear, native_ops
from kernels.static import _scatter_rows
from workers.models.moe_experts import expert_loop, reference_loop


def test_the_native_op_builds_here():
    assert native_ops.load(), native_ops.failure()
    assert native_ops.build_dir().is_dir()


def test_the_native_write_equals_the_python_op():
    assert native_ops.load(), native_ops.failure()
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        pool = torch.randn(40, 3, 5, generator=gen).to(dtype)
        index = torch.randperm(40, generator=gen)[:7]
        src = torch.randn(7, 3, 5, generator=gen).to(dtype)
        native, python = pool.clone(), pool.clone()
        torch.ops.hybridserve_native.scatter_rows(native, index, src)
        _scatter_rows(python, index, src)
        assert torch.equal(native, python)
        assert torch.equal(native[index], src) and torch.equal(native[1:2], pool[1:2]) is (1 not in index)


def test_the_native_op_traces_with_a_fake():
    """Under dynamo the op is traced through its fake (no real write at trace time)."""
    assert native_ops.load(), native_ops.failure()
    pool = torch.zeros(6, 2)

    @torch.compile(fullgraph=True, backend="eager")
    def write(p, i, s):
        torch.ops.hybridserve_native.scatter_rows(p, i, s)
        return p.sum()

    assert float(write(pool, torch.tensor([1, 4]), torch.ones(2, 2))) == 4.0
    assert pool[[1, 4]].eq(1).all() and pool[[0, 2, 3, 5]].eq(0).all()


ACTS = ["silu", "gelu", "gelu_pytorch_tanh", "relu", "relu2"]


def _experts(gen, t, h, i, e, k, gated, out=None):
    x = torch.randn(t, h, generator=gen)
    # distinct experts per token; the last expert only on every 5th token (so few rows)
    ids = torch.stack([torch.randperm(e if r % 5 == 0 else e - 1, generator=gen)[:k] for r in range(t)])
    weights = torch.rand(t, k, generator=gen)
    w_gate = torch.randn(e, i, h, generator=gen) if gated else None
    w_up, w_down = torch.randn(e, i, h, generator=gen), torch.randn(e, out or h, i, generator=gen)
    return x, weights, ids, w_gate, w_up, w_down


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("gated", [True, False])
def test_the_native_expert_loop_matches_the_python_loop_on_many_rows(act, gated):
    """Experts of ~200 rows: the same GEMMs (both follow ``kernels/cpu_linear.py``'s rule).
    Without the fused SiLU glue the same ATen ops in the same order too, so equal, not just
    close; a gated SiLU expert's glue is C++ (``silu_of``, the weighted add): close."""
    assert native_ops.load(), native_ops.failure()
    args = _experts(torch.Generator().manual_seed(1), 600, 256, 320, 6, 2, gated)
    assert cpu_linear.use_onednn(600 * 2 // 6, 256, 320) is cpu_linear.prefers_onednn()
    want = reference_loop(*args, act)
    got = torch.ops.hybridserve_native.moe_experts(*args, act)
    assert torch.equal(expert_loop(*args, act), got)  # the eager path is the native loop
    if gated and act == "silu":
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("dims", [(24, 20, 24), (32, 48, 32), (17, 33, 40), (256, 256, 256)])
def test_the_few_rows_experts_match_the_python_loop(act, gated, dims):
    """Decode-sized experts (1-16 rows each; at 100 tokens 17+, the ATen path, in the same
    call) through the fused kernel: close to the Python loop at every K tail (K % 16 != 0),
    with H_out != H."""
    assert native_ops.load(), native_ops.failure()
    h, i, out = dims
    for t in (1, 3, 13, 40, 100):
        args = _experts(torch.Generator().manual_seed(t), t, h, i, 6, 2, gated, out)
        want = reference_loop(*args, act)
        got = torch.ops.hybridserve_native.moe_experts(*args, act)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_a_few_rows_token_gets_the_same_bits_alone_or_in_a_batch():
    """The fused kernel's sums per row do not depend on the other rows of the expert (each
    row's dot products run in one order), so a token's output is its own."""
    assert native_ops.load(), native_ops.failure()
    x, weights, ids, w_gate, w_up, w_down = _experts(torch.Generator().manual_seed(3), 12, 40, 56, 6, 2, True)
    assert int(torch.bincount(ids.flatten()).max()) <= 16  # every expert on the fused path
    both = torch.ops.hybridserve_native.moe_experts(x, weights, ids, w_gate, w_up, w_down, "silu")
    for t in range(12):
        alone = torch.ops.hybridserve_native.moe_experts(
            x[t : t + 1], weights[t : t + 1], ids[t : t + 1], w_gate, w_up, w_down, "silu"
        )
        assert torch.equal(alone[0], both[t])


def test_the_few_rows_experts_read_strided_expert_views():
    """Granite's fused [E, 2I, H] input weight arrives as gate / up views (rows I*H apart
    per expert, not contiguous as a whole); the kernel reads them in place."""
    assert native_ops.load(), native_ops.failure()
    gen = torch.Generator().manual_seed(4)
    x, weights, ids, _, _, w_down = _experts(gen, 5, 32, 24, 4, 2, False)
    fused = torch.randn(4, 48, 32, generator=gen)
    w_gate, w_up = fused[:, :24], fused[:, 24:]
    assert not w_up.is_contiguous()
    want = reference_loop(x, weights, ids, w_gate, w_up, w_down, "silu")
    got = torch.ops.hybridserve_native.moe_experts(x, weights, ids, w_gate, w_up, w_down, "silu")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_the_native_expert_loop_refuses_an_unknown_activation():
    assert native_ops.load(), native_ops.failure()
    x, ids, w = torch.zeros(2, 4), torch.zeros(2, 1, dtype=torch.int64), torch.zeros(1, 4, 4)
    with pytest.raises(RuntimeError, match="activation tanh is not supported"):
        torch.ops.hybridserve_native.moe_experts(x, torch.ones(2, 1), ids, None, w, w, "tanh")


def test_the_library_is_built_from_the_source_files():
    """Each ``SOURCES`` file is compiled as itself (its own object in the build), not pasted
    into one generated translation unit; each includes the shared header."""
    assert native_ops.load(), native_ops.failure()
    ninja = (native_ops.build_dir() / "build.ninja").read_text()
    for name in native_ops.SOURCES:
        path = native_ops.HERE / name
        assert '#include "native_common.h"' in path.read_text(), name
        assert str(path) in ninja, f"{name} is not a source of the build"

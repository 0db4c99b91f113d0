"""The C++ pool write (``kernels/native_ops.py``) against the Python op it stands in for."""
from __future__ import annotations

import pytest
import torch

from kernels import cpu_linear, native_ops
from kernels.static import _scatter_rows
from workers.models.moe_experts import expert_loop


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


@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_pytorch_tanh", "relu", "relu2"])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("size", ["decode", "prefill"])
def test_the_native_expert_loop_equals_the_python_loop_bit_for_bit(act, gated, size):
    """Same kernels in the same order: equal, not just close (greedy outputs depend on it).
    ``prefill``: experts of ~200 rows, where both take oneDNN (``kernels/cpu_linear.py``)."""
    assert native_ops.load(), native_ops.failure()
    gen = torch.Generator().manual_seed(1)
    t, h, i, e, k = (13, 24, 20, 6, 2) if size == "decode" else (600, 256, 320, 6, 2)
    assert cpu_linear.use_onednn(t * k // e, h, i) is (size == "prefill")
    x = torch.randn(t, h, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    ids[:, 0] = ids[:, 0].clamp(max=e - 2)         # expert e - 1 chosen rarely, some never
    weights = torch.rand(t, k, generator=gen)
    w_gate = torch.randn(e, i, h, generator=gen) if gated else None
    w_up, w_down = torch.randn(e, i, h, generator=gen), torch.randn(e, h, i, generator=gen)
    want = expert_loop(x, weights, ids, w_gate, w_up, w_down, act)
    got = torch.ops.hybridserve_native.moe_experts(x, weights, ids, w_gate, w_up, w_down, act)
    assert torch.equal(got, want)
    if size == "prefill":                 # oneDNN's sums differ from MKL's at these sizes
        assert not torch.equal(want, _aten_loop(x, weights, ids, w_gate, w_up, w_down, act))


def _aten_loop(*args):
    saved = cpu_linear.MIN_ROWS
    cpu_linear.MIN_ROWS = 1 << 62
    try:
        return expert_loop(*args)
    finally:
        cpu_linear.MIN_ROWS = saved


def test_the_native_expert_loop_refuses_an_unknown_activation():
    assert native_ops.load(), native_ops.failure()
    x, ids, w = torch.zeros(2, 4), torch.zeros(2, 1, dtype=torch.int64), torch.zeros(1, 4, 4)
    with pytest.raises(RuntimeError, match="activation tanh is not supported"):
        torch.ops.hybridserve_native.moe_experts(x, torch.ones(2, 1), ids, None, w, w, "tanh")

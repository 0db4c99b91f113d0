"""``kernels/dense.py``: the few-rows kernel (``kernels/native_gemm.cpp``) for 1 to
``FEW_ROWS`` rows, eager and traced, each row's bits its own; ``cpu_linear`` elsewhere."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import backend, cpu_linear, dense, native_ops


@pytest.fixture(autouse=True)
def _native() -> None:
    assert native_ops.load(), native_ops.failure()


def rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8])
@pytest.mark.parametrize("k, n", [(256, 768), (100, 37), (16, 5), (384, 256)])
def test_few_rows_match_aten(rows, k, n):
    """K with and without a tail of the 16-float vectors, N not a multiple of the blocks."""
    x, w, b = rand(rows, k, seed=1), rand(n, k, seed=2), rand(n, seed=3)
    assert dense.few_rows(x, w, b)
    torch.testing.assert_close(dense.linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(dense.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("k, n", [(256, 768), (100, 37)])
def test_a_row_gets_the_same_bits_at_every_row_count(k, n):
    """What makes a verify's row equal the decode step's for the same token: the row alone,
    with any other rows, at any position of the call."""
    x, w, b = rand(8, k, seed=4), rand(n, k, seed=5), rand(n, seed=6)
    alone = [dense.linear(x[r : r + 1], w, b)[0] for r in range(8)]
    for lo in range(8):
        for hi in range(lo + 1, 9):
            got = dense.linear(x[lo:hi], w, b)
            for r in range(lo, hi):
                assert torch.equal(got[r - lo], alone[r]), (lo, hi, r)


def test_a_row_gets_the_same_bits_with_more_threads():
    x, w = rand(4, 256, seed=7), rand(2048, 256, seed=8)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = dense.linear(x, w)
        torch.set_num_threads(2)
        assert torch.equal(dense.linear(x, w), one)
    finally:
        torch.set_num_threads(threads)


def test_other_inputs_take_cpu_linear():
    x, w = rand(4, 64), rand(32, 64)
    assert not dense.few_rows(rand(dense.FEW_ROWS + 1, 64), w, None)
    assert not dense.few_rows(x.double(), w.double(), None)
    assert not dense.few_rows(x, rand(64, 32).t(), None)  # rows not contiguous
    assert not dense.few_rows(x, w.requires_grad_(), None)
    assert not dense.few_rows(x[:0], w.detach(), None)
    with backend.use_backend("torch"):
        assert not dense.few_rows(x, w.detach(), None)
    big = rand(40, 64)
    assert torch.equal(dense.linear(big, w.detach()), cpu_linear.linear(big, w.detach()))


def test_three_dimensional_inputs_and_the_module():
    lin = dense.Linear(256, 512, bias=True)
    assert isinstance(lin, torch.nn.Linear) and set(lin.state_dict()) == {"weight", "bias"}
    with torch.inference_mode():
        for x in (rand(2, 3, 256), rand(2, 50, 256)):
            got = lin(x)
            assert got.shape == (*x.shape[:-1], 512)
            assert torch.equal(got, dense.linear(x.reshape(-1, 256), lin.weight, lin.bias).reshape(got.shape))
            torch.testing.assert_close(got, F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-4)


def test_a_compiled_step_calls_the_kernel_and_gets_the_eager_bits():
    graphs = []

    def backend_fn(gm, inputs):
        graphs.append(str(gm.graph))
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, inputs)

    x, w, b = rand(4, 256, seed=9), rand(512, 256, seed=10), rand(512, seed=11)
    traced = torch.compile(lambda a: torch.relu(dense.linear(a, w, b)), backend=backend_fn, fullgraph=True)
    with torch.inference_mode():
        got = traced(x)
    assert graphs and "few_rows_linear" in graphs[0]
    assert torch.equal(got, torch.relu(dense.linear(x, w, b)))


def test_bad_inputs_are_refused_with_the_shapes():
    op = torch.ops.hybridserve_native.few_rows_linear
    x, w = rand(17, 16), rand(4, 16)  # more than 16 rows: 16 at a time (the batch-invariant mode)
    assert torch.equal(op(x, w, None)[16:], op(x[16:], w, None))
    with pytest.raises(RuntimeError, match=r"fp32 x \[..., K\] and weight \[N, K\]"):
        op(rand(2, 16), rand(4, 8), None)
    with pytest.raises(RuntimeError, match="bias of 4 elements"):
        op(rand(2, 16), rand(4, 16), rand(3))
    assert torch.equal(op(rand(3, 0), rand(4, 0), torch.ones(4)), torch.ones(3, 4))  # K = 0: the bias

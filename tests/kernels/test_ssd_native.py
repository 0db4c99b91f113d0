"""The CPU path of Mamba2 SSD (``kernels/ssd/cpu.py``, the C++ loop of
``kernels/native_ssd.cpp``): close to the torch reference, and the same bits for a token
whichever call computes it -- decode, verify, prefill or mixed, on one thread or two."""

from __future__ import annotations

import pytest
import torch

from kernels import backend, native_ops
from kernels.recurrent_batch import RecurrentBatch
from kernels.ssd import ssd_scan
from tests.kernels.conftest import torch_threads

# (heads, groups, P, N): groups shared by heads, N with a scalar tail, the Granite / Nemotron
# size (64 x 128)
DIMS = [(4, 2, 6, 16), (3, 1, 5, 20), (8, 2, 64, 128)]


@pytest.fixture(autouse=True, scope="module")
def _built():
    assert native_ops.load(), native_ops.failure()


def _inputs(rows: int, heads: int, groups: int, p_dim: int, n_dim: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, heads, p_dim, generator=gen)
    dt = torch.randn(rows, heads, generator=gen)
    b, c = (torch.randn(rows, groups, n_dim, generator=gen) for _ in range(2))
    a = -torch.rand(heads, generator=gen) - 0.5
    d, dt_bias = torch.randn(heads, generator=gen), torch.randn(heads, generator=gen)
    return x, dt, a, b, c, d, dt_bias


def _pool(num_slots: int, heads: int, p_dim: int, n_dim: int, seed: int) -> torch.Tensor:
    return torch.randn(num_slots, heads, p_dim, n_dim, generator=torch.Generator().manual_seed(seed))


def _varlen(inputs, pool, lens, slots, init, dst=None, dt_limit=(0.0, float("inf"))):
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens), 0)
    seqs = RecurrentBatch(cu, torch.tensor(slots, dtype=torch.int32), torch.tensor(init), dst)
    return ssd_scan(*inputs, pool, seqs, dt_limit=dt_limit)


@pytest.mark.parametrize("dims", DIMS)
@pytest.mark.parametrize("dt_limit", [(0.0, float("inf")), (0.01, 0.5)])
def test_varlen_is_close_to_the_reference(dims, dt_limit):
    heads, groups, p_dim, n_dim = dims
    lens, slots, init = [1, 4, 0, 40], [1, 2, 3, 4], [True, False, True, True]
    inputs = _inputs(sum(lens), heads, groups, p_dim, n_dim, seed=p_dim)
    pool = _pool(8, heads, p_dim, n_dim, seed=1)
    dst = torch.zeros(sum(lens), dtype=torch.int32)
    dst[[2, 30]] = torch.tensor([6, 7], dtype=torch.int32)
    native, ref = pool.clone(), pool.clone()
    out = _varlen(inputs, native, lens, slots, init, dst, dt_limit)
    with backend.use_backend("torch"):
        want = _varlen(inputs, ref, lens, slots, init, dst, dt_limit)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(native, ref, rtol=1e-4, atol=1e-4)
    assert torch.equal(native[3], pool[3]) and torch.equal(native[5], pool[5])  # length 0; a spare


@pytest.mark.parametrize("dims", DIMS)
def test_prefill_decode_and_verify_give_a_token_the_same_bits(dims):
    heads, groups, p_dim, n_dim = dims
    inputs = _inputs(6, heads, groups, p_dim, n_dim, seed=2)
    pool = _pool(9, heads, p_dim, n_dim, seed=3)
    dst = torch.arange(3, 9, dtype=torch.int32)
    prefill = pool.clone()
    out = _varlen(inputs, prefill, [6], [1], [True], dst)
    x, dt, a, b, c, d, dt_bias = inputs
    stepped, one = pool.clone(), torch.tensor([1], dtype=torch.int32)
    for t in range(6):
        y = ssd_scan(x[[t]], dt[[t]], a, b[[t]], c[[t]], d, dt_bias, stepped, RecurrentBatch.decode(one))
        assert torch.equal(y, out[[t]])
        assert torch.equal(prefill[3 + t], stepped[1])
    verified = pool.clone()
    for v in range(2):
        rows = slice(3 * v, 3 * v + 3)
        seqs = RecurrentBatch(torch.tensor([0, 3], dtype=torch.int32), one, torch.tensor([True]), dst[rows], 3)
        y = ssd_scan(x[rows], dt[rows], a, b[rows], c[rows], d, dt_bias, verified, seqs)
        assert torch.equal(y, out[rows])
    assert torch.equal(verified, prefill) and torch.equal(stepped[1], prefill[1])


def test_threads_and_batch_neighbours_do_not_change_a_sequence():
    inputs = _inputs(50, 8, 2, 64, 128, seed=4)
    pool = _pool(4, 8, 64, 128, seed=5)
    results = []
    for n in (1, 2):
        with torch_threads(n):
            p = pool.clone()
            results.append((_varlen(inputs, p, [20, 30], [1, 2], [True, True]), p))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    alone = pool.clone()
    x, dt, a, b, c, d, dt_bias = inputs
    out = _varlen((x[20:], dt[20:], a, b[20:], c[20:], d, dt_bias), alone, [30], [2], [True])
    assert torch.equal(out, results[0][0][20:]) and torch.equal(alone[2], results[0][1][2])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_pool_takes_the_same_loop_on_copies(dtype):
    inputs = _inputs(5, 4, 2, 6, 16, seed=6)
    half = _pool(6, 4, 6, 16, seed=7).to(dtype)
    as_fp32 = half.float()
    dst = torch.tensor([0, 4, 0, 0, 5], dtype=torch.int32)
    out_half = _varlen(inputs, half, [5], [1], [True], dst)
    out_fp32 = _varlen(inputs, as_fp32, [5], [1], [True], dst)
    assert torch.equal(out_half, out_fp32)
    assert torch.equal(half, as_fp32.to(dtype))


def test_bad_inputs_are_refused_with_the_sizes():
    x, dt, a, b, c, d, dt_bias = _inputs(3, 4, 2, 6, 16, seed=8)
    pool = _pool(4, 4, 6, 16, seed=9)
    op = torch.ops.hybridserve_native.ssd_recurrent
    cu, slots = torch.tensor([0, 1, 3]), torch.tensor([1, 2])
    with pytest.raises(RuntimeError, match="must rise from 0 to the 3 rows"):
        op(pool, torch.tensor([0, 2]), slots, None, None, x, dt, dt_bias, a, b, c, True, 0.0, 1e9)
    with pytest.raises(RuntimeError, match="slot 5 of 4"):
        op(pool, cu, torch.tensor([5, 1]), None, None, x, dt, dt_bias, a, b, c, True, 0.0, 1e9)
    with pytest.raises(RuntimeError, match="do not fit H=4"):
        op(
            pool,
            cu,
            slots,
            None,
            None,
            x,
            dt,
            dt_bias,
            a,
            b[:, :, :8].contiguous(),
            c[:, :, :8].contiguous(),
            True,
            0.0,
            1e9,
        )
    with pytest.raises(RuntimeError, match="contiguous fp32"):
        op(pool, cu, slots, None, None, x.double(), dt, dt_bias, a, b, c, True, 0.0, 1e9)

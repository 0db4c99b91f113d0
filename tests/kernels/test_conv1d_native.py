"""The CPU path of the causal conv1d (``kernels/conv1d/cpu.py``, the C++ pass of
``kernels/native_conv.cpp``): close to the torch reference, and the same bits for a token
whichever call computes it -- decode, verify, prefill or mixed, on one thread or two."""

from __future__ import annotations

import pytest
import torch

from kernels import backend, native_ops
from kernels.conv1d import causal_conv1d
from kernels.recurrent_batch import RecurrentBatch
from tests.kernels.conftest import torch_threads


@pytest.fixture(autouse=True, scope="module")
def _built():
    assert native_ops.load(), native_ops.failure()


def _case(rows: int, dim: int, width: int, num_slots: int, seed: int, bias: bool = True):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, dim, generator=gen)
    weight = torch.randn(dim, width, generator=gen)
    b = torch.randn(dim, generator=gen) if bias else None
    pool = torch.randn(num_slots, dim, width - 1, generator=gen)
    return x, weight, b, pool


def _varlen(x, weight, bias, pool, lens, slots, init, dst=None, activation="silu"):
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens), 0)
    seqs = RecurrentBatch(cu, torch.tensor(slots, dtype=torch.int32), torch.tensor(init), dst)
    return causal_conv1d(x, weight, bias, pool, seqs, activation)


@pytest.mark.parametrize("dim,width", [(16, 4), (37, 4), (2048, 4), (24, 2), (40, 3)])
@pytest.mark.parametrize("activation", ["silu", None])
def test_varlen_is_close_to_the_reference(dim, width, activation):
    lens, slots, init = [1, 5, 0, 70, 2], [1, 2, 3, 4, 5], [True, False, True, True, True]
    x, weight, bias, pool = _case(sum(lens), dim, width, 9, seed=dim)
    dst = torch.zeros(sum(lens), dtype=torch.int32)
    dst[[3, 40, 76]] = torch.tensor([6, 7, 8], dtype=torch.int32)
    native, ref = pool.clone(), pool.clone()
    out = _varlen(x, weight, bias, native, lens, slots, init, dst, activation)
    with backend.use_backend("torch"):
        want = _varlen(x, weight, bias, ref, lens, slots, init, dst, activation)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(native, ref, rtol=0, atol=0)  # states are inputs: copied exactly
    assert torch.equal(native[3], pool[3])  # length 0: untouched


def test_prefill_decode_and_verify_give_a_token_the_same_bits():
    """A 9-token prefill in one varlen call == 9 decode updates == 3 verifies of 3 rows:
    outputs, snapshots after every row and the live state, bit for bit."""
    dim, width = 40, 4
    x, weight, bias, pool = _case(9, dim, width, 12, seed=1)
    prefill = pool.clone()
    dst = torch.arange(3, 12, dtype=torch.int32)
    out = _varlen(x, weight, bias, prefill, [9], [1], [True], dst)
    stepped, one = pool.clone(), torch.tensor([1], dtype=torch.int32)
    for t in range(9):
        o = causal_conv1d(x[[t]], weight, bias, stepped, RecurrentBatch.decode(one))
        assert torch.equal(o, out[[t]])
        assert torch.equal(prefill[3 + t], stepped[1])
    verified = pool.clone()
    for v in range(3):
        rows = slice(3 * v, 3 * v + 3)
        seqs = RecurrentBatch(torch.tensor([0, 3], dtype=torch.int32), one, torch.tensor([True]), dst[rows], 3)
        o = causal_conv1d(x[rows], weight, bias, verified, seqs)
        assert torch.equal(o, out[rows])
    assert torch.equal(verified, prefill) and torch.equal(stepped[1], prefill[1])


def test_threads_and_batch_neighbours_do_not_change_a_row():
    dim, width = 2048, 4
    x, weight, bias, pool = _case(300, dim, width, 4, seed=2)
    results = []
    for n in (1, 2):
        with torch_threads(n):
            p = pool.clone()
            results.append((_varlen(x, weight, bias, p, [100, 200], [1, 2], [True, True]), p))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    alone = pool.clone()
    out = _varlen(x[100:], weight, bias, alone, [200], [2], [True])
    assert torch.equal(out, results[0][0][100:]) and torch.equal(alone[2], results[0][1][2])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_pool_reads_and_writes_its_dtype(dtype):
    x, weight, bias, pool = _case(6, 24, 4, 5, seed=3)
    half = pool.to(dtype)
    as_fp32 = half.float()
    out_half = _varlen(x, weight, bias, half, [6], [1], [True], torch.tensor([0, 0, 3, 0, 0, 0], dtype=torch.int32))
    out_fp32 = _varlen(x, weight, bias, as_fp32, [6], [1], [True], torch.tensor([0, 0, 3, 0, 0, 0], dtype=torch.int32))
    assert torch.equal(out_half, out_fp32)
    assert torch.equal(half, as_fp32.to(dtype))


def test_bad_inputs_are_refused_with_the_sizes():
    x, weight, bias, pool = _case(3, 8, 4, 4, seed=4)
    op = torch.ops.hybridserve_native.causal_conv1d
    cu, slots = torch.tensor([0, 1, 3]), torch.tensor([1, 2])
    with pytest.raises(RuntimeError, match="must rise from 0 to the 3 rows"):
        op(pool, torch.tensor([0, 1, 2]), slots, None, None, x, weight, bias, True)
    with pytest.raises(RuntimeError, match="slot 7 of 4"):
        op(pool, cu, torch.tensor([7, 1]), None, None, x, weight, bias, True)
    with pytest.raises(RuntimeError, match=r"conv states must be a CPU \[S, 8, 3\]"):
        op(pool[:, :, :2], cu, slots, None, None, x, weight, bias, True)
    with pytest.raises(RuntimeError, match="2 <= W <= 16"):
        op(torch.zeros(4, 8, 0), cu, slots, None, None, x, weight[:, :1], bias, True)

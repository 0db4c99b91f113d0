"""The CPU path of Gated DeltaNet (``kernels/gdn/cpu.py``, the C++ loop of
``kernels/native_gdn.cpp``): close to the torch reference, and the same bits for a token
whichever call computes it -- decode, verify, prefill or mixed, alone or batched, in one call
or token by token, on one thread or two, eager or compiled."""

from __future__ import annotations

import pytest
import torch

from kernels import backend, native_ops
from kernels.gdn import gated_delta_rule
from kernels.recurrent_batch import RecurrentBatch
from tests.kernels.conftest import torch_threads

# (key heads, value heads, K, V): GQA, V with 16-column blocks below 64 and a scalar tail,
# an odd K, the ~100M bench model's 128 x 128
DIMS = [(2, 4, 16, 16), (1, 3, 5, 37), (2, 2, 24, 80), (4, 8, 128, 128)]


@pytest.fixture(autouse=True, scope="module")
def _built():
    assert native_ops.load(), native_ops.failure()


def _inputs(rows: int, hk: int, h: int, k_dim: int, v_dim: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(rows, hk, k_dim, generator=gen) for _ in range(2))
    v = torch.randn(rows, h, v_dim, generator=gen)
    return q, k, v, -torch.rand(rows, h, generator=gen), torch.rand(rows, h, generator=gen)


def _pool(num_slots: int, h: int, k_dim: int, v_dim: int, seed: int) -> torch.Tensor:
    return torch.randn(num_slots, h, k_dim, v_dim, generator=torch.Generator().manual_seed(seed)) * 0.3


def _verify(inputs, pool, num_seqs: int, seq_len: int):
    """Live slots 1..B, snapshot slots B+1.. (one per row)."""
    slots = torch.arange(1, num_seqs + 1, dtype=torch.int32)
    dst = torch.arange(num_seqs + 1, num_seqs + 1 + num_seqs * seq_len, dtype=torch.int32)
    cu = torch.arange(0, num_seqs * seq_len + 1, seq_len, dtype=torch.int32)
    init = torch.ones(num_seqs, dtype=torch.bool)
    return gated_delta_rule(*inputs, pool, RecurrentBatch(cu, slots, init, dst, seq_len)), dst


@pytest.mark.parametrize("dims", DIMS)
def test_update_and_verify_are_close_to_the_reference(dims):
    hk, h, k_dim, v_dim = dims
    num_seqs, seq_len = 3, 4
    inputs = _inputs(num_seqs * seq_len, hk, h, k_dim, v_dim, seed=1)
    pool = _pool(2 + num_seqs * (seq_len + 1), h, k_dim, v_dim, seed=2)
    native_pool, ref_pool = pool.clone(), pool.clone()
    out, _ = _verify(inputs, native_pool, num_seqs, seq_len)
    with backend.use_backend("torch"):
        ref, _ = _verify(inputs, ref_pool, num_seqs, seq_len)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(native_pool, ref_pool, rtol=1e-5, atol=1e-5)
    assert torch.equal(native_pool[-1], pool[-1])  # a spare slot: untouched
    one = tuple(x[::seq_len] for x in inputs)  # the first token of each
    slots = torch.arange(1, num_seqs + 1, dtype=torch.int32)
    native_pool, ref_pool = pool.clone(), pool.clone()
    out = gated_delta_rule(*one, native_pool, RecurrentBatch.decode(slots))
    with backend.use_backend("torch"):
        ref = gated_delta_rule(*one, ref_pool, RecurrentBatch.decode(slots))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(native_pool, ref_pool, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dims", DIMS)
def test_a_verify_is_its_decode_steps_bit_for_bit(dims):
    """T decode updates one after another give exactly the verify's outputs, its snapshot
    after every token and its final live state: speculation on or off, the same bits."""
    hk, h, k_dim, v_dim = dims
    num_seqs, seq_len = 2, 4
    inputs = _inputs(num_seqs * seq_len, hk, h, k_dim, v_dim, seed=3)
    pool = _pool(2 + num_seqs * (seq_len + 1), h, k_dim, v_dim, seed=4)
    verified = pool.clone()
    out, dst = _verify(inputs, verified, num_seqs, seq_len)
    stepped = pool.clone()
    slots = torch.arange(1, num_seqs + 1, dtype=torch.int32)
    dst = dst.view(num_seqs, seq_len)
    for t in range(seq_len):
        rows = torch.arange(num_seqs) * seq_len + t
        o = gated_delta_rule(*(x[rows] for x in inputs), stepped, RecurrentBatch.decode(slots))
        assert torch.equal(o, out[rows])
        assert torch.equal(verified[dst[:, t].long()], stepped[slots.long()])  # the snapshot after t
    assert torch.equal(verified[slots.long()], stepped[slots.long()])


def test_a_varlen_batch_gets_the_same_bits_as_decode():
    """Mixed lengths, one without an initial state, one of length 0, snapshots: every token
    of every sequence (a 40-token prefill too) equals its decode update, one at a time."""
    hk, h, k_dim, v_dim = 2, 4, 16, 32
    lens, init = [1, 3, 0, 40], [True, True, True, False]
    inputs = _inputs(sum(lens), hk, h, k_dim, v_dim, seed=5)
    pool = _pool(9, h, k_dim, v_dim, seed=6)
    cu = torch.tensor([0, 1, 4, 4, 44], dtype=torch.int32)
    slots = torch.tensor([1, 2, 6, 3], dtype=torch.int32)
    dst = torch.zeros(44, dtype=torch.int32)
    dst[2], dst[20] = 5, 7  # after row 2 (sequence 1), row 20 (sequence 3)
    varlen = pool.clone()
    out = gated_delta_rule(*inputs, varlen, RecurrentBatch(cu, slots, torch.tensor(init), dst))
    stepped = pool.clone()
    stepped[3] = 0.0  # no initial state: from zeros
    for first, n, slot in ((0, 1, 1), (1, 3, 2), (4, 40, 3)):
        for r in range(first, first + n):
            one_slot = RecurrentBatch.decode(torch.tensor([slot], dtype=torch.int32))
            o = gated_delta_rule(*(x[[r]] for x in inputs), stepped, one_slot)
            assert torch.equal(o, out[[r]]), r
            if dst[r]:
                assert torch.equal(varlen[dst[r]], stepped[slot])
        assert torch.equal(varlen[slot], stepped[slot])
    assert torch.equal(varlen[6], pool[6]) and torch.equal(varlen[8], pool[8])  # length 0; a spare
    with backend.use_backend("torch"):
        ref_pool = pool.clone()
        ref = gated_delta_rule(*inputs, ref_pool, RecurrentBatch(cu, slots, torch.tensor(init), dst))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(varlen[1:], ref_pool[1:], rtol=1e-4, atol=1e-4)


def test_a_sequence_alone_equals_it_in_a_batch_on_any_thread_count():
    hk, h, k_dim, v_dim = 4, 8, 128, 128
    inputs = _inputs(8, hk, h, k_dim, v_dim, seed=7)
    pool = _pool(10, h, k_dim, v_dim, seed=8)
    slots = torch.arange(1, 9, dtype=torch.int32)
    results = []
    for n in (1, 2):
        with torch_threads(n):
            batched = pool.clone()
            results.append((gated_delta_rule(*inputs, batched, RecurrentBatch.decode(slots)), batched))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    alone = pool.clone()
    o = gated_delta_rule(*(x[[5]] for x in inputs), alone, RecurrentBatch.decode(slots[[5]]))
    assert torch.equal(o, results[0][0][[5]]) and torch.equal(alone[6], results[0][1][6])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_pool_takes_the_same_loop_on_copies(dtype):
    hk, h, k_dim, v_dim = 2, 4, 16, 32
    inputs = _inputs(6, hk, h, k_dim, v_dim, seed=11)
    pool = _pool(10, h, k_dim, v_dim, seed=12)
    half = pool.to(dtype)
    want_pool = half.float()
    out_half, dst = _verify(inputs, half, 2, 3)
    out_fp32, _ = _verify(inputs, want_pool, 2, 3)
    assert torch.equal(out_half, out_fp32)  # the states were read from the same values
    touched = torch.cat([torch.tensor([1, 2]), dst.long()])
    assert torch.equal(half[touched], want_pool[touched].to(dtype))


def test_the_loop_compiles_and_writes_the_pool():
    """Under inductor the op is traced through its fake and called on the real pool."""
    hk, h, k_dim, v_dim = 2, 4, 16, 32
    inputs = _inputs(3, hk, h, k_dim, v_dim, seed=13)
    pool = _pool(5, h, k_dim, v_dim, seed=14)
    slots = torch.tensor([3, 1, 4], dtype=torch.int32)
    eager_pool, compiled_pool = pool.clone(), pool.clone()
    eager = gated_delta_rule(*inputs, eager_pool, RecurrentBatch.decode(slots))

    @torch.compile(fullgraph=True)
    def step(q, k, v, g, beta, states, slot_ids):
        return gated_delta_rule(q, k, v, g, beta, states, RecurrentBatch.decode(slot_ids)) * 2

    with torch.inference_mode():
        out = step(*inputs, compiled_pool, slots)
    torch.testing.assert_close(out, eager * 2, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(compiled_pool, eager_pool, rtol=1e-5, atol=1e-6)
    assert torch.equal(compiled_pool[2], pool[2])


def test_autograd_takes_the_reference():
    hk, h, k_dim, v_dim = 1, 2, 8, 8
    q, k, v, g, beta = _inputs(2, hk, h, k_dim, v_dim, seed=15)
    v.requires_grad_(True)
    pool = _pool(3, h, k_dim, v_dim, seed=16)
    seqs = RecurrentBatch.decode(torch.tensor([1, 2], dtype=torch.int32))
    out = gated_delta_rule(q, k, v, g, beta, pool, seqs)
    out.sum().backward()
    assert v.grad is not None and v.grad.abs().sum() > 0


def test_bad_shapes_are_refused_with_the_sizes():
    pool = _pool(4, 2, 8, 8, seed=17)
    q, k, v, g, beta = _inputs(3, 1, 2, 8, 8, seed=18)
    op = torch.ops.hybridserve_native.gdn_recurrent
    cu = torch.tensor([0, 1, 3])
    with pytest.raises(RuntimeError, match="must rise from 0 to the 3 rows"):
        op(pool, torch.tensor([0, 1, 2]), torch.tensor([1, 2]), None, None, q, k, v, g, beta)
    with pytest.raises(RuntimeError, match="slot 9 of 4"):
        op(pool, cu, torch.tensor([9, 1]), None, None, q, k, v, g, beta)
    with pytest.raises(RuntimeError, match="contiguous fp32"):
        op(pool, cu, torch.tensor([1, 2]), None, None, q.double(), k, v, g, beta)
    with pytest.raises(RuntimeError, match="dst sizes"):
        op(pool, cu, torch.tensor([1, 2]), None, torch.tensor([0, 3]), q, k, v, g, beta)
    with pytest.raises(RuntimeError, match="fp32 / bf16 / fp16"):
        op(pool.double(), cu, torch.tensor([1, 2]), None, None, q, k, v, g, beta)

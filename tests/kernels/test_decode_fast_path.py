"""The decode fast path: each one-step update op equals its varlen op on a batch of length-1
sequences that all have an initial state, outputs and whole pools (live slots, untouched
slots, the dummy slot 0); and the varlen driver's unpadded path for equal-length sequences."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kernels import backend, scan_varlen
from kernels.conv1d import causal_conv1d
from kernels.gdn import gated_delta_rule
from kernels.gdn.reference import gdn_recurrent
from kernels.recurrent_batch import RecurrentBatch
from kernels.ssd import ssd_scan

NUM_SEQS = 5


def decode_case(varlen_case, seed: int):
    """Five one-token sequences on random distinct live slots, every initial state present."""
    case = varlen_case([1] * NUM_SEQS, seed=seed, init_prob=1.0)
    assert bool(case.has_initial_state.all())
    return case


def strided(x: torch.Tensor) -> torch.Tensor:
    """The same values as a column slice of a wider tensor (as the models pass projections)."""
    wide = torch.cat([x, torch.randn_like(x)], dim=-1)
    return wide[..., : x.shape[-1]]


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("use_bias", [False, True])
@pytest.mark.parametrize("kernels", ["auto", "torch"])  # the C++ pass on CPU, the reference
def test_conv1d_update_equals_varlen(varlen_case, pool_dtype, use_bias, kernels):
    with backend.use_backend(kernels):
        _check_conv1d_update_equals_varlen(varlen_case, pool_dtype, use_bias)


def _check_conv1d_update_equals_varlen(varlen_case, pool_dtype, use_bias):
    case = decode_case(varlen_case, seed=1)
    gen = torch.Generator().manual_seed(1)
    dim, width = 12, 4
    x = strided(torch.randn(NUM_SEQS, dim, generator=gen))
    weight = torch.randn(dim, width, generator=gen)
    bias = torch.randn(dim, generator=gen) if use_bias else None
    pool = torch.randn(case.num_slots, dim, width - 1, generator=gen).to(pool_dtype)
    ref_pool, pool_fast = pool.clone(), pool.clone()
    ref = causal_conv1d(x, weight, bias, ref_pool, case.seqs())
    out = causal_conv1d(x, weight, bias, pool_fast, case.seqs(uniform_len=1))
    assert torch.equal(out, ref)
    assert torch.equal(pool_fast, ref_pool)
    assert not torch.equal(pool_fast, pool)  # the live slots did move


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k_heads", [2, 4])  # grouped and one key head per value head
@pytest.mark.parametrize("kernels", ["auto", "torch"])  # the C++ loop on CPU, the reference
def test_gdn_update_equals_varlen(varlen_case, pool_dtype, k_heads, kernels):
    with backend.use_backend(kernels):
        _check_gdn_update_equals_varlen(varlen_case, pool_dtype, k_heads)


def _check_gdn_update_equals_varlen(varlen_case, pool_dtype, k_heads):
    case = decode_case(varlen_case, seed=2)
    gen = torch.Generator().manual_seed(2)
    heads, k_dim, v_dim = 4, 8, 6
    q = strided(torch.randn(NUM_SEQS, k_heads, k_dim, generator=gen))
    k = strided(torch.randn(NUM_SEQS, k_heads, k_dim, generator=gen))
    v = strided(torch.randn(NUM_SEQS, heads, v_dim, generator=gen))
    g = -torch.rand(NUM_SEQS, heads, generator=gen)
    beta = torch.rand(NUM_SEQS, heads, generator=gen)
    pool = torch.randn(case.num_slots, heads, k_dim, v_dim, generator=gen).to(pool_dtype)
    ref_pool, pool_fast = pool.clone(), pool.clone()
    ref = gated_delta_rule(q, k, v, g, beta, ref_pool, case.seqs(), scale=0.3)
    out = gated_delta_rule(q, k, v, g, beta, pool_fast, case.seqs(uniform_len=1), scale=0.3)
    assert torch.equal(out, ref)
    assert torch.equal(pool_fast, ref_pool)
    assert not torch.equal(pool_fast, pool)


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dt_limit", [(0.0, float("inf")), (0.01, 0.5)])
@pytest.mark.parametrize("kernels", ["auto", "torch"])  # the C++ loop on CPU, the reference
def test_ssd_update_equals_varlen(varlen_case, pool_dtype, dt_limit, kernels):
    with backend.use_backend(kernels):
        _check_ssd_update_equals_varlen(varlen_case, pool_dtype, dt_limit)


def _check_ssd_update_equals_varlen(varlen_case, pool_dtype, dt_limit):
    case = decode_case(varlen_case, seed=3)
    gen = torch.Generator().manual_seed(3)
    heads, groups, p_dim, n_dim = 4, 2, 6, 8
    x = strided(torch.randn(NUM_SEQS, heads, p_dim, generator=gen))
    dt = strided(torch.randn(NUM_SEQS, heads, generator=gen))
    a = -torch.rand(heads, generator=gen) - 0.5
    b = strided(torch.randn(NUM_SEQS, groups, n_dim, generator=gen))
    c = strided(torch.randn(NUM_SEQS, groups, n_dim, generator=gen))
    d, dt_bias = torch.randn(heads, generator=gen), torch.randn(heads, generator=gen)
    pool = torch.randn(case.num_slots, heads, p_dim, n_dim, generator=gen).to(pool_dtype)
    ref_pool, pool_fast = pool.clone(), pool.clone()
    ref = ssd_scan(x, dt, a, b, c, d, dt_bias, ref_pool, case.seqs(), dt_limit=dt_limit)
    out = ssd_scan(x, dt, a, b, c, d, dt_bias, pool_fast, case.seqs(uniform_len=1), dt_limit=dt_limit)
    assert torch.equal(out, ref)
    assert torch.equal(pool_fast, ref_pool)
    assert not torch.equal(pool_fast, pool)


def test_update_of_no_sequences_is_a_no_op():
    pool = torch.randn(3, 2, 4, 4)
    empty = torch.zeros(0, dtype=torch.int32)
    out = gated_delta_rule(
        torch.randn(0, 2, 4),
        torch.randn(0, 2, 4),
        torch.randn(0, 2, 4),
        torch.zeros(0, 2),
        torch.zeros(0, 2),
        pool.clone(),
        RecurrentBatch.decode(empty),
    )
    assert out.shape == (0, 2, 4)


@pytest.mark.parametrize("snapshot_prob", [0.0, 0.5])
def test_equal_length_rows_skip_padding_with_the_same_result(varlen_case, snapshot_prob):
    """Verify-shaped batches (all sequences 3 tokens, adjacent) take the unpadded branch of
    ``scan_varlen``; one extra 1-token sequence forces the padded branch on the same data."""
    gen = torch.Generator().manual_seed(4)
    lens = [3, 3, 3, 1]
    case = varlen_case(lens, seed=4, snapshot_prob=snapshot_prob, init_prob=0.7)
    num_tokens, heads, dim = sum(lens), 2, 4
    inputs = (
        torch.randn(num_tokens, heads, dim, generator=gen),  # q
        torch.nn.functional.normalize(torch.randn(num_tokens, heads, dim, generator=gen), dim=-1),
        torch.randn(num_tokens, heads, dim, generator=gen),  # v
        -torch.rand(num_tokens, heads, generator=gen),  # g
        torch.rand(num_tokens, heads, generator=gen),
    )  # beta
    pool = torch.randn(case.num_slots, heads, dim, dim, generator=gen)

    def run(num_seqs: int) -> tuple[torch.Tensor, torch.Tensor, set[str]]:
        rows = int(case.cu_seqlens[num_seqs])
        dst = None if case.state_dst_slots is None else case.state_dst_slots[:rows]
        out, states = torch.zeros(rows, heads, dim), pool.clone()
        with OpNames() as ops:
            scan_varlen(
                tuple(x[:rows] for x in inputs),
                out,
                states,
                case.cu_seqlens[: num_seqs + 1],
                case.slot_ids[:num_seqs],
                case.has_initial_state[:num_seqs],
                dst,
                gdn_recurrent,
                _no_chunks,
                recurrent_max_len=16,
            )
        return out, states, ops.names

    uniform_out, uniform_pool, uniform_ops = run(3)
    padded_out, padded_pool, padded_ops = run(4)
    assert "aten.arange.default" in padded_ops and "aten.arange.default" not in uniform_ops
    torch.testing.assert_close(uniform_out, padded_out[:9], rtol=0, atol=1e-5)
    own = [int(case.slot_ids[3])]  # the 4th sequence's slots
    if case.state_dst_slots is not None:
        own.append(int(case.state_dst_slots[9]))
    padded_pool[own] = pool[own]
    torch.testing.assert_close(uniform_pool, padded_pool, rtol=0, atol=1e-5)


class OpNames(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func))
        return func(*args, **(kwargs or {}))


def _no_chunks(inputs, s):
    raise AssertionError("short sequences never take the chunked form")

"""The speculative-verify fast path (conv1d, GDN, SSD): B sequences of T tokens, each with
an initial state and a snapshot slot at every token. Each verify op equals its varlen op on
that batch, bitwise: outputs and whole pools (live slots, every snapshot slot, untouched
slots)."""

from __future__ import annotations

import pytest
import torch

from kernels import backend
from kernels.conv1d import causal_conv1d
from kernels.gdn import gated_delta_rule
from kernels.ssd import ssd_scan
from tests.kernels.varlen_cases import ssd_inputs
from workers.forward_batch import uniform_snapshot_len

NUM_SEQS = 3


def verify_case(varlen_case, seq_len: int, seed: int):
    case = varlen_case([seq_len] * NUM_SEQS, seed=seed, snapshot_prob=1.0, init_prob=1.0)
    assert bool(case.has_initial_state.all()) and bool((case.state_dst_slots != 0).all())
    return case


@pytest.mark.parametrize("seq_len", [1, 2, 4])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernels", ["auto", "torch"])  # the C++ pass on CPU, the reference
def test_conv1d_verify_equals_varlen(varlen_case, seq_len, pool_dtype, kernels):
    with backend.use_backend(kernels):
        _check_conv1d_verify_equals_varlen(varlen_case, seq_len, pool_dtype)


def _check_conv1d_verify_equals_varlen(varlen_case, seq_len, pool_dtype):
    case = verify_case(varlen_case, seq_len, seed=seq_len)
    gen = torch.Generator().manual_seed(seq_len)
    dim, width = 10, 4
    x = torch.randn(case.num_tokens, dim, generator=gen)
    weight, bias = torch.randn(dim, width, generator=gen), torch.randn(dim, generator=gen)
    pool = torch.randn(case.num_slots, dim, width - 1, generator=gen).to(pool_dtype)
    ref_pool, fast_pool = pool.clone(), pool.clone()
    ref = causal_conv1d(x, weight, bias, ref_pool, case.seqs())
    out = causal_conv1d(x, weight, bias, fast_pool, case.seqs(uniform_len=seq_len))
    assert torch.equal(out, ref) and torch.equal(fast_pool, ref_pool)
    assert not torch.equal(fast_pool, pool)


@pytest.mark.parametrize("seq_len", [1, 3, 4])
@pytest.mark.parametrize("k_heads", [2, 4])
@pytest.mark.parametrize("kernels", ["auto", "torch"])  # the C++ loop on CPU, the reference
def test_gdn_verify_equals_varlen(varlen_case, seq_len, k_heads, kernels):
    with backend.use_backend(kernels):
        _check_gdn_verify_equals_varlen(varlen_case, seq_len, k_heads)


def _check_gdn_verify_equals_varlen(varlen_case, seq_len, k_heads):
    case = verify_case(varlen_case, seq_len, seed=10 + seq_len)
    gen = torch.Generator().manual_seed(seq_len)
    heads, k_dim, v_dim, n = 4, 8, 6, case.num_tokens
    q, k = (torch.randn(n, k_heads, k_dim, generator=gen) for _ in range(2))
    v = torch.randn(n, heads, v_dim, generator=gen)
    g, beta = -torch.rand(n, heads, generator=gen), torch.rand(n, heads, generator=gen)
    pool = torch.randn(case.num_slots, heads, k_dim, v_dim, generator=gen)
    ref_pool, fast_pool = pool.clone(), pool.clone()
    ref = gated_delta_rule(q, k, v, g, beta, ref_pool, case.seqs())
    out = gated_delta_rule(q, k, v, g, beta, fast_pool, case.seqs(uniform_len=seq_len))
    assert torch.equal(out, ref) and torch.equal(fast_pool, ref_pool)


@pytest.mark.parametrize("seq_len", [1, 2, 4])
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("kernels", ["auto", "torch"])  # the C++ loop on CPU, the reference
def test_ssd_verify_equals_varlen(varlen_case, seq_len, groups, kernels):
    with backend.use_backend(kernels):
        _check_ssd_verify_equals_varlen(varlen_case, seq_len, groups)


def _check_ssd_verify_equals_varlen(varlen_case, seq_len, groups):
    case = verify_case(varlen_case, seq_len, seed=20 + seq_len)
    inp = ssd_inputs(case.num_tokens, case.num_slots, seed=seq_len, heads=4, groups=groups, p_dim=6, n_dim=8)
    args = [inp[k] for k in ("x", "dt", "A", "B", "C", "D", "dt_bias")]
    ref_pool, fast_pool = inp["states"].clone(), inp["states"].clone()
    ref = ssd_scan(*args, ref_pool, case.seqs(), dt_limit=(0.0, 5.0))
    out = ssd_scan(*args, fast_pool, case.seqs(uniform_len=seq_len), dt_limit=(0.0, 5.0))
    assert torch.equal(out, ref) and torch.equal(fast_pool, ref_pool)
    assert not torch.equal(fast_pool, inp["states"])


def test_the_rule_needs_equal_lengths_states_and_every_snapshot():
    assert uniform_snapshot_len([3, 3], [True, True], [5, 6, 7, 8, 9, 10]) == 3
    assert uniform_snapshot_len([3, 2], [True, True], [5] * 5) == 0  # lengths differ
    assert uniform_snapshot_len([3, 3], [True, False], [5] * 6) == 0  # a prefill
    assert uniform_snapshot_len([3, 3], [True, True], [5, 6, 0, 8, 9, 10]) == 0  # a token without
    assert uniform_snapshot_len([3, 3], [True, True], None) == 0
    assert uniform_snapshot_len([], [], []) == 0

"""Lightning attention (MiniMax) against a naive per-token loop in transformers' own layout."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.lightning import lightning_attention, state_shape
from kernels.recurrent_batch import RecurrentBatch
from tests.kernels.varlen_cases import lens_strategy, naive_varlen, poison_no_init_slot

H, K = 3, 8
TOL = 1e-4


def make_inputs(num_tokens: int, num_slots: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return dict(
        q=torch.randn(num_tokens, H, K, generator=gen),
        k=torch.randn(num_tokens, H, K, generator=gen),
        v=torch.randn(num_tokens, H, K, generator=gen),
        slope=torch.rand(H, generator=gen) * 0.9 + 0.05,
        states=torch.randn(num_slots, *state_shape(H, K), generator=gen),
    )


def naive_lightning(inp, case):
    """transformers' per-token rule on KV [K, V] (the pool holds KV^T): returns (o, pool)."""
    out = torch.zeros(inp["v"].shape)

    def step(t: int, s: torch.Tensor) -> None:  # s [H, V, K] = KV^T per head
        for h in range(H):
            kv = s[h].T * torch.exp(-inp["slope"][h]) + torch.outer(inp["k"][t, h], inp["v"][t, h])
            s[h] = kv.T
            out[t, h] = inp["q"][t, h] @ kv

    return out, naive_varlen(inp["states"], case, step)


def run_op(inp, case):
    states = inp["states"].clone()
    o = lightning_attention(inp["q"], inp["k"], inp["v"], inp["slope"], states, case.seqs())
    return o, states


@settings(max_examples=15, deadline=None)
@given(lens=lens_strategy(short_max=12, max_size=5), seed=st.integers(0, 2**16), snap=st.sampled_from([0.0, 0.15, 0.4]))
def test_matches_naive(lens, seed, snap, varlen_case, max_abs_diff):
    case = varlen_case(lens, seed, snapshot_prob=snap)
    inp = make_inputs(case.num_tokens, case.num_slots, seed)
    ref_o, ref_pool = naive_lightning(inp, case)
    o, pool = run_op(inp, case)
    assert max_abs_diff(o, ref_o) <= TOL
    assert max_abs_diff(pool, ref_pool) <= TOL


def test_long_prefill_and_nan_slot(varlen_case, max_abs_diff):
    """A 150-token sequence crosses the chunked form's chunks; a no-init NaN slot is not read."""
    case = varlen_case([150, 1, 7, 0, 33], seed=2, snapshot_prob=0.05)
    inp = make_inputs(case.num_tokens, case.num_slots, seed=2)
    poison_no_init_slot(case, inp["states"])
    ref_o, ref_pool = naive_lightning(inp, case)
    o, pool = run_op(inp, case)
    assert max_abs_diff(o, ref_o) <= TOL
    assert max_abs_diff(pool, ref_pool) <= TOL


def test_decode_fast_path_equals_varlen(varlen_case):
    case = varlen_case([1, 1, 1, 1], seed=5, init_prob=1.0)
    inp = make_inputs(4, case.num_slots, seed=5)
    want, want_pool = run_op(inp, case)
    pool = inp["states"].clone()
    got = lightning_attention(inp["q"], inp["k"], inp["v"], inp["slope"], pool, case.seqs(uniform_len=1))
    assert torch.equal(got, want) and torch.equal(pool, want_pool)


def test_shape_errors():
    inp = make_inputs(3, 2, seed=1)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="expected states"):
        lightning_attention(
            inp["q"],
            inp["k"],
            inp["v"],
            inp["slope"][:2],
            inp["states"],
            RecurrentBatch(cu, torch.tensor([1], dtype=torch.int32), torch.tensor([True])),
        )

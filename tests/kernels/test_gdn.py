"""Gated DeltaNet varlen op against a naive per-token loop, transformers, and itself."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.gdn import gated_delta_rule
from kernels.gdn import reference as gdn
from tests.kernels.delta_rule_cases import check_bf16_inputs_fp32_pool, check_matches_transformers
from tests.kernels.varlen_cases import gdn_inputs, lens_strategy, naive_varlen, poison_no_init_slot

H_K, H_V, K, V = 2, 4, 8, 6  # grouped value heads: each key head serves 2 value heads
TOL = 1e-4


def make_inputs(num_tokens: int, num_slots: int, seed: int) -> dict[str, torch.Tensor]:
    return gdn_inputs(num_tokens, num_slots, seed, H_K, H_V, K, V)


def naive_gdn(inp: dict[str, torch.Tensor], case, scale: float | None = None):
    """Token by token, head by head; returns (o [T, H, V], final pool)."""
    out = torch.zeros(inp["v"].shape)
    scale = K**-0.5 if scale is None else scale

    def step(t: int, s: torch.Tensor) -> None:
        for h in range(H_V):
            q = inp["q"][t, h // (H_V // H_K)]
            k = inp["k"][t, h // (H_V // H_K)]
            q = q / torch.sqrt((q * q).sum() + 1e-6) * scale
            k = k / torch.sqrt((k * k).sum() + 1e-6)
            s[h] = s[h] * torch.exp(inp["g"][t, h])
            u = inp["beta"][t, h] * (inp["v"][t, h] - s[h].T @ k)
            s[h] = s[h] + torch.outer(k, u)
            out[t, h] = s[h].T @ q

    pool = naive_varlen(inp["states"], case, step)
    return out, pool


def run_op(inp, case, chunk_size: int, **kw):
    states = inp["states"].clone()
    o = gated_delta_rule(
        inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], states, case.seqs(), chunk_size=chunk_size, **kw
    )
    return o, states


LENS = lens_strategy(short_max=12, max_size=5)


@pytest.mark.parametrize("recurrent_max_len", [0, 16, 10**6])
@settings(max_examples=12, deadline=None)
@given(lens=LENS, seed=st.integers(0, 2**16), snap=st.sampled_from([0.0, 0.15, 0.4]))
def test_matches_naive(recurrent_max_len, lens, seed, snap, varlen_case, max_abs_diff):
    case = varlen_case(lens, seed, snapshot_prob=snap)
    inp = make_inputs(case.num_tokens, case.num_slots, seed)
    ref_o, ref_pool = naive_gdn(inp, case)
    with mock.patch.object(gdn, "RECURRENT_MAX_LEN", recurrent_max_len):
        o, pool = run_op(inp, case, chunk_size=8)
    assert max_abs_diff(o, ref_o) <= TOL
    assert max_abs_diff(pool, ref_pool) <= TOL  # live, snapshot, dummy and spare slots


def test_fixed_mixed_batch(varlen_case, max_abs_diff):
    """Lengths 0/1/short/long with snapshots; a no-init slot holding NaN must not leak."""
    case = varlen_case([0, 1, 5, 37, 1, 20, 16, 17], seed=3, snapshot_prob=0.2)
    inp = make_inputs(case.num_tokens, case.num_slots, seed=3)
    poison_no_init_slot(case, inp["states"])
    ref_o, ref_pool = naive_gdn(inp, case, scale=0.3)
    o, pool = run_op(inp, case, chunk_size=16, scale=0.3)
    assert max_abs_diff(o, ref_o) <= TOL
    assert max_abs_diff(pool, ref_pool) <= TOL
    assert torch.equal(pool[0], inp["states"][0])


@pytest.mark.parametrize("chunk_size", [1, 5, 16, 64])
def test_chunked_equals_recurrent(chunk_size, max_abs_diff):
    inp = make_inputs(50, 1, seed=7)
    q, k = gdn.l2norm(inp["q"]) * K**-0.5, gdn.l2norm(inp["k"])
    seq = (q, k, inp["v"], inp["g"], inp["beta"])
    s0 = inp["states"][0]
    o_c, s_c = gdn.gdn_chunked(seq, s0, chunk_size=chunk_size)
    valid = torch.ones(1, 50, dtype=torch.bool)
    o_r, s_r = gdn.gdn_recurrent(tuple(x[None] for x in seq), valid, s0[None].clone())
    assert max_abs_diff(o_c, o_r[0]) <= TOL
    assert max_abs_diff(s_c, s_r[0]) <= TOL


def test_matches_transformers(max_abs_diff):
    """Pins l2norm eps, default scale, GVA head mapping and the [H, K, V] layout to HF."""
    hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    check_matches_transformers(
        gated_delta_rule,
        (hf.torch_chunk_gated_delta_rule, hf.torch_recurrent_gated_delta_rule),
        make_inputs(45, 2, seed=11),
        TOL,
        max_abs_diff,
    )


def test_dtypes_bf16_inputs_fp32_pool(varlen_case):
    check_bf16_inputs_fp32_pool(run_op, make_inputs, varlen_case)


def test_bf16_pool_rounds_states_once(varlen_case):
    """States carried between segments stay fp32; only the stored result is rounded."""
    case = varlen_case([3, 30, 1], seed=8, snapshot_prob=0.1, init_prob=1.0)
    inp = make_inputs(case.num_tokens, case.num_slots, seed=8)
    inp["states"] = inp["states"].bfloat16()
    o_low, pool_low = run_op(inp, case, chunk_size=8)
    o_ref, pool_ref = run_op({**inp, "states": inp["states"].float()}, case, chunk_size=8)
    assert pool_low.dtype == torch.bfloat16 and o_low.dtype == torch.float32
    assert torch.equal(o_low, o_ref)
    assert torch.equal(pool_low, pool_ref.bfloat16())

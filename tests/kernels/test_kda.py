"""KDA varlen op against a naive per-token loop, transformers (Kimi-Linear), and itself."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.kda import kimi_delta_attention
from kernels.kda import reference as kda_ref
from kernels.recurrent_batch import RecurrentBatch
from tests.kernels.delta_rule_cases import check_bf16_inputs_fp32_pool, check_matches_transformers
from tests.kernels.varlen_cases import (
    kda_inputs,
    lens_strategy,
    naive_varlen,
    poison_no_init_slot,
    with_snapshot_every_token,
)

H, K, V = 3, 8, 6
TOL = 1e-4


def make_inputs(num_tokens: int, num_slots: int, seed: int, g_min: float = -0.5):
    return kda_inputs(num_tokens, num_slots, seed, H, K, V, g_min)


def naive_kda(inp: dict[str, torch.Tensor], case, scale: float | None = None):
    """Token by token, head by head; returns (o [T, H, V], final pool)."""
    out = torch.zeros(inp["v"].shape)
    scale = K**-0.5 if scale is None else scale

    def step(t: int, s: torch.Tensor) -> None:
        for h in range(H):
            q, k = inp["q"][t, h], inp["k"][t, h]
            q = q / torch.sqrt((q * q).sum() + 1e-6) * scale
            k = k / torch.sqrt((k * k).sum() + 1e-6)
            s[h] = torch.exp(inp["g"][t, h])[:, None] * s[h]  # per key channel
            u = inp["beta"][t, h] * (inp["v"][t, h] - s[h].T @ k)
            s[h] = s[h] + torch.outer(k, u)
            out[t, h] = s[h].T @ q

    pool = naive_varlen(inp["states"], case, step)
    return out, pool


def run_op(inp, case, chunk_size: int = 8, **kw):
    states = inp["states"].clone()
    o = kimi_delta_attention(
        inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], states, case.seqs(), chunk_size=chunk_size, **kw
    )
    return o, states


LENS = lens_strategy(short_max=12, max_size=5)


@pytest.mark.parametrize("recurrent_max_len", [0, 16, 10**6])
@settings(max_examples=10, deadline=None)
@given(lens=LENS, seed=st.integers(0, 2**16), snap=st.sampled_from([0.0, 0.15, 0.4]))
def test_matches_naive(recurrent_max_len, lens, seed, snap, varlen_case, max_abs_diff):
    case = varlen_case(lens, seed, snapshot_prob=snap)
    inp = make_inputs(case.num_tokens, case.num_slots, seed)
    ref_o, ref_pool = naive_kda(inp, case)
    with mock.patch.object(kda_ref, "RECURRENT_MAX_LEN", recurrent_max_len):
        o, pool = run_op(inp, case)
    assert max_abs_diff(o, ref_o) <= TOL
    assert max_abs_diff(pool, ref_pool) <= TOL  # live, snapshot, dummy and spare slots


def test_fixed_mixed_batch(varlen_case, max_abs_diff):
    """Lengths 0/1/short/long with snapshots; a no-init slot holding NaN must not leak."""
    case = varlen_case([0, 1, 5, 37, 1, 20, 16, 17], seed=3, snapshot_prob=0.2)
    inp = make_inputs(case.num_tokens, case.num_slots, seed=3)
    poison_no_init_slot(case, inp["states"])
    ref_o, ref_pool = naive_kda(inp, case, scale=0.3)
    o, pool = run_op(inp, case, chunk_size=16, scale=0.3)
    assert max_abs_diff(o, ref_o) <= TOL
    assert max_abs_diff(pool, ref_pool) <= TOL
    assert torch.equal(pool[0], inp["states"][0])


@pytest.mark.parametrize("chunk_size", [1, 5, 16, 64])
def test_chunked_equals_recurrent(chunk_size, max_abs_diff):
    """Also with decays down to exp(-30) per token: the chunk's decays never overflow."""
    for g_min in (-0.5, -30.0):
        inp = make_inputs(50, 1, seed=7, g_min=g_min)
        q, k = kda_ref.normalized_qk(inp["q"], inp["k"], None, True)
        seq = (q, k, inp["v"], inp["g"], inp["beta"])
        s0 = inp["states"][0]
        o_c, s_c = kda_ref.kda_chunked(seq, s0, chunk_size=chunk_size)
        valid = torch.ones(1, 50, dtype=torch.bool)
        o_r, s_r = kda_ref.kda_recurrent(tuple(x[None] for x in seq), valid, s0[None].clone())
        assert bool(torch.isfinite(o_c).all())
        assert max_abs_diff(o_c, o_r[0]) <= TOL
        assert max_abs_diff(s_c, s_r[0]) <= TOL


def test_matches_transformers(max_abs_diff):
    """Pins l2norm eps, default scale, the per-channel decay and the [H, K, V] layout to HF."""
    hf = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    check_matches_transformers(
        kimi_delta_attention,
        (hf.chunk_kimi_delta_attention, hf.recurrent_kimi_delta_attention),
        make_inputs(45, 2, seed=11),
        TOL,
        max_abs_diff,
    )


def test_update_and_verify_fast_paths_equal_varlen(varlen_case):
    """Bitwise: the decode and verify paths run the varlen recurrence's own step."""
    decode = varlen_case([1, 1, 1], seed=4, init_prob=1.0)
    inp = make_inputs(3, decode.num_slots, seed=4)
    want, want_pool = run_op(inp, decode)
    pool = inp["states"].clone()
    got = kimi_delta_attention(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], pool, decode.seqs(uniform_len=1))
    assert torch.equal(got, want) and torch.equal(pool, want_pool)
    verify, dst = with_snapshot_every_token(varlen_case([4, 4], seed=6, init_prob=1.0))
    inp = make_inputs(8, verify.num_slots, seed=6)
    want, want_pool = run_op(inp, verify)
    pool = inp["states"].clone()
    got = kimi_delta_attention(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], pool, verify.seqs(uniform_len=4))
    assert torch.equal(got, want) and torch.equal(pool, want_pool)


def test_dtypes_bf16_inputs_fp32_pool(varlen_case):
    check_bf16_inputs_fp32_pool(run_op, make_inputs, varlen_case)


def test_shape_errors_name_the_shapes():
    inp = make_inputs(4, 2, seed=1)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"g \(4, 3\)"):
        kimi_delta_attention(
            inp["q"],
            inp["k"],
            inp["v"],
            inp["g"][..., 0],
            inp["beta"],
            inp["states"],
            RecurrentBatch(cu, torch.tensor([1], dtype=torch.int32), torch.tensor([False])),
        )

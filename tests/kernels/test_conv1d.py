"""Causal conv1d varlen / update against a naive per-token loop and transformers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.conv1d import causal_conv1d
from kernels.recurrent_batch import RecurrentBatch

D, W = 6, 4
TOL = 1e-5


def make_inputs(num_tokens: int, num_slots: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return dict(
        x=torch.randn(num_tokens, D, generator=gen),
        weight=torch.randn(D, W, generator=gen),
        bias=torch.randn(D, generator=gen),
        states=torch.randn(num_slots, D, W - 1, generator=gen),
    )


def naive_conv(inp, case, activation="silu", use_bias=True):
    """Per token: dot of the last W inputs (initial W-1 ++ tokens) with the taps."""
    pool = inp["states"].clone()
    out = torch.zeros(inp["x"].shape)
    dst = case.state_dst_slots
    for b, (start, end) in enumerate(case.bounds()):
        slot = int(case.slot_ids[b])
        init = pool[slot] if case.has_initial_state[b] else torch.zeros(D, W - 1)
        hist = list(init.T.clone())  # W-1 inputs, oldest first
        for t in range(start, end):
            hist.append(inp["x"][t])
            acc = sum(inp["weight"][:, w] * hist[-W + w] for w in range(W))
            if use_bias:
                acc = acc + inp["bias"]
            out[t] = F.silu(acc) if activation else acc
            if dst is not None and dst[t] != 0:
                pool[int(dst[t])] = torch.stack(hist[-(W - 1) :], dim=1)
        if end > start:
            pool[slot] = torch.stack(hist[-(W - 1) :], dim=1)
    return out, pool


def run_op(inp, case, activation="silu", use_bias=True):
    states = inp["states"].clone()
    out = causal_conv1d(
        inp["x"], inp["weight"], inp["bias"] if use_bias else None, states, case.seqs(), activation=activation
    )
    return out, states


@settings(max_examples=25, deadline=None)
@given(
    lens=st.lists(st.integers(0, 12), min_size=1, max_size=6),
    seed=st.integers(0, 2**16),
    snap=st.sampled_from([0.0, 0.2, 0.5]),
    activation=st.sampled_from(["silu", None]),
    use_bias=st.booleans(),
)
def test_matches_naive(lens, seed, snap, activation, use_bias, varlen_case, max_abs_diff):
    case = varlen_case(lens, seed, snapshot_prob=snap)
    inp = make_inputs(case.num_tokens, case.num_slots, seed)
    ref_out, ref_pool = naive_conv(inp, case, activation, use_bias)
    out, pool = run_op(inp, case, activation, use_bias)
    assert max_abs_diff(out, ref_out) <= TOL
    assert max_abs_diff(pool, ref_pool) <= TOL  # live, snapshot, dummy and spare slots


def test_no_initial_state_ignores_nan_slot(varlen_case, max_abs_diff):
    case = varlen_case([2, 0, 9, 1], seed=1, snapshot_prob=0.3, init_prob=0.0)
    inp = make_inputs(case.num_tokens, case.num_slots, seed=1)
    inp["states"][case.slot_ids.long()] = float("nan")
    ref_out, ref_pool = naive_conv(inp, case)
    out, pool = run_op(inp, case)
    assert max_abs_diff(out, ref_out) <= TOL
    assert torch.equal(pool.isnan(), ref_pool.isnan())  # only the empty sequence's slot
    assert max_abs_diff(pool.nan_to_num(), ref_pool.nan_to_num()) <= TOL


def test_update_equals_varlen_of_length_one(varlen_case):
    case = varlen_case([1] * 5, seed=2, init_prob=1.0)
    inp = make_inputs(5, case.num_slots, seed=2)
    ref_out, ref_pool = run_op(inp, case)
    states = inp["states"].clone()
    out = causal_conv1d(inp["x"], inp["weight"], inp["bias"], states, case.seqs(uniform_len=1))
    assert torch.equal(out, ref_out)
    assert torch.equal(states, ref_pool)


def test_matches_transformers_and_state_convention(max_abs_diff):
    """Prefill then decode against HF's conv fns; our state is HF's (last W inputs) minus the
    oldest."""
    hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    inp = make_inputs(10, 2, seed=3)
    states = torch.zeros(2, D, W - 1)
    slot, cu = torch.tensor([1], dtype=torch.int32), torch.tensor([0, 9], dtype=torch.int32)
    out = causal_conv1d(
        inp["x"][:9], inp["weight"], inp["bias"], states, RecurrentBatch(cu, slot, torch.tensor([False]))
    )
    ref = hf.causal_conv1d_fn(inp["x"][None, :9].transpose(1, 2), inp["weight"], inp["bias"], activation="silu")
    assert max_abs_diff(out, ref[0].T) <= TOL
    hf_state = inp["x"][5:9].T[None].clone()  # HF keeps the last W inputs
    assert torch.equal(states[1], hf_state[0, :, 1:])
    dec = causal_conv1d(inp["x"][9:], inp["weight"], inp["bias"], states, RecurrentBatch.decode(slot))
    ref_dec = hf.causal_conv1d_update(
        inp["x"][None, 9:].transpose(1, 2), hf_state, inp["weight"], inp["bias"], activation="silu"
    )
    assert max_abs_diff(dec, ref_dec[0].T) <= TOL
    assert torch.equal(states[1], hf_state[0, :, 1:])


def test_bad_activation_raises():
    inp = make_inputs(1, 2, seed=0)
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d(
            inp["x"],
            inp["weight"],
            None,
            inp["states"],
            RecurrentBatch.decode(torch.tensor([1], dtype=torch.int32)),
            activation="gelu",
        )

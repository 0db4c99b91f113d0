"""Triton causal conv1d (varlen + update) against the torch reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from kernels.conv1d.reference import causal_conv1d_update_torch, causal_conv1d_varlen_torch

D, W = 24, 4
# Shrinking re-runs interpreted kernels for minutes; a failure's example is printed as is.
NO_SHRINK = (Phase.explicit, Phase.reuse, Phase.generate)


def make_inputs(num_tokens: int, num_slots: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # x is a column slice of a wider projection, as in the mixers (row stride != D)
    wide = torch.randn(num_tokens, D + 8, generator=gen)
    return dict(
        x=wide[:, 3 : 3 + D],
        weight=torch.randn(D, W, generator=gen),
        bias=torch.randn(D, generator=gen),
        states=torch.randn(num_slots, D, W - 1, generator=gen),
    )


def run_both(inp, case, device, activation="silu", use_bias=True):
    from kernels.conv1d.triton_conv import causal_conv1d_varlen_triton

    meta = (case.cu_seqlens, case.slot_ids, case.has_initial_state)
    dst = case.state_dst_slots
    bias = inp["bias"] if use_bias else None
    ref_pool = inp["states"].clone()
    ref = causal_conv1d_varlen_torch(inp["x"], inp["weight"], bias, ref_pool, *meta, activation, dst)
    pool = inp["states"].to(device)
    out = causal_conv1d_varlen_triton(
        inp["x"].to(device),
        inp["weight"].to(device),
        bias.to(device) if bias is not None else None,
        pool,
        *(m.to(device) for m in meta),
        activation,
        dst.to(device) if dst is not None else None,
    )
    return (ref, ref_pool), (out.cpu(), pool.cpu())


def assert_same(got, want, tol, max_abs_diff):
    (out, pool), (ref, ref_pool) = got, want
    assert max_abs_diff(out, ref) <= tol
    assert torch.equal(pool.isnan(), ref_pool.isnan())
    assert max_abs_diff(pool.nan_to_num(), ref_pool.nan_to_num()) <= tol


def test_mixed_batch_with_snapshots(varlen_case, device, tol, max_abs_diff):
    """Lengths 0..21 (shorter and longer than the window) with snapshots; NaN no-init slots."""
    case = varlen_case([2, 0, 9, 1, 21, 3], seed=1, snapshot_prob=0.3, init_prob=0.5)
    inp = make_inputs(case.num_tokens, case.num_slots, seed=1)
    no_init = [b for b in range(len(case.lens)) if not case.has_initial_state[b]]
    inp["states"][case.slot_ids.long()[no_init]] = float("nan")
    want, got = run_both(inp, case, device)
    assert_same(got, want, tol, max_abs_diff)


@pytest.mark.parametrize("activation,use_bias", [(None, False), ("silu", False), (None, True)])
def test_activation_and_bias(activation, use_bias, varlen_case, device, tol, max_abs_diff):
    case = varlen_case([5, 1, 12], seed=2, snapshot_prob=0.2)
    inp = make_inputs(case.num_tokens, case.num_slots, seed=2)
    want, got = run_both(inp, case, device, activation, use_bias)
    assert_same(got, want, tol, max_abs_diff)


def test_update_matches_reference(varlen_case, device, tol, max_abs_diff):
    from kernels.conv1d.triton_conv import causal_conv1d_update_triton

    case = varlen_case([1] * 5, seed=3, init_prob=1.0)
    inp = make_inputs(5, case.num_slots, seed=3)
    ref_pool = inp["states"].clone()
    ref = causal_conv1d_update_torch(inp["x"], inp["weight"], inp["bias"], ref_pool, case.slot_ids, "silu")
    pool = inp["states"].to(device)
    out = causal_conv1d_update_triton(
        inp["x"].to(device), inp["weight"].to(device), inp["bias"].to(device), pool, case.slot_ids.to(device)
    )
    assert_same((out.cpu(), pool.cpu()), (ref, ref_pool), tol, max_abs_diff)


@settings(max_examples=8, deadline=None, phases=NO_SHRINK)
@given(
    lens=st.lists(st.integers(0, 12), min_size=1, max_size=5),
    seed=st.integers(0, 2**16),
    snap=st.sampled_from([0.0, 0.3]),
)
def test_random_batches(lens, seed, snap, varlen_case, device, tol, max_abs_diff):
    case = varlen_case(lens, seed, snapshot_prob=snap)
    inp = make_inputs(case.num_tokens, case.num_slots, seed)
    want, got = run_both(inp, case, device)
    assert_same(got, want, tol, max_abs_diff)

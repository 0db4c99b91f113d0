"""Triton Gated DeltaNet (fused recurrent + chunked) against the torch reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.gdn.reference import gated_delta_rule_varlen_torch
from tests.kernels.delta_rule_cases import (
    check_bf16_inputs_and_pool,
    check_no_l2norm_custom_scale,
    check_verify_writes_every_draft_state,
)
from tests.kernels.varlen_cases import NO_SHRINK, assert_same_result, gdn_inputs, lens_strategy, poison_no_init_slot

H_K, H_V = 2, 4  # grouped value heads: each key head serves 2 value heads


def make_inputs(
    num_tokens: int, num_slots: int, seed: int, k_dim: int = 16, v_dim: int = 16
) -> dict[str, torch.Tensor]:
    return gdn_inputs(num_tokens, num_slots, seed, H_K, H_V, k_dim, v_dim)


def run_both(inp, case, device, **kw):
    """(reference out, reference pool), (triton out, triton pool), all on the CPU."""
    from kernels.gdn.triton_varlen import gated_delta_rule_varlen_triton

    ref_pool = inp["states"].clone()
    names = ("q", "k", "v", "g", "beta")
    ref = gated_delta_rule_varlen_torch(
        *(inp[n] for n in names),
        ref_pool,
        case.cu_seqlens,
        case.slot_ids,
        case.has_initial_state,
        kw.get("scale"),
        kw.get("use_qk_l2norm", True),
        16,
        case.state_dst_slots,
    )
    pool = inp["states"].to(device)
    out = gated_delta_rule_varlen_triton(
        *(inp[n].to(device) for n in names), pool, case.seqs(device), chunk_size=16, **kw
    )
    return (ref, ref_pool), (out.cpu(), pool.cpu())


def test_mixed_batch_with_snapshots(varlen_case, device, tol, max_abs_diff):
    """Empty, decode, verify-sized, 16/17 (the path boundary) and chunked lengths; a no-init
    slot holding NaN must not leak."""
    case = varlen_case([0, 1, 4, 37, 1, 16, 17], seed=3, snapshot_prob=0.2)
    inp = make_inputs(case.num_tokens, case.num_slots, seed=3)
    poison_no_init_slot(case, inp["states"])
    want, got = run_both(inp, case, device)
    assert_same_result(got, want, tol, max_abs_diff)


@pytest.mark.parametrize("recurrent_max_len", [0, 1000])
def test_every_sequence_on_one_path(recurrent_max_len, varlen_case, device, tol, max_abs_diff):
    """0: even decodes take the chunked kernels; 1000: a 40-token prefill runs per token."""
    case = varlen_case([3, 40, 1], seed=5, snapshot_prob=0.15)
    inp = make_inputs(case.num_tokens, case.num_slots, seed=5, k_dim=8, v_dim=6)  # padded tiles
    want, got = run_both(inp, case, device, recurrent_max_len=recurrent_max_len)
    assert_same_result(got, want, tol, max_abs_diff)


def test_verify_writes_every_draft_state(varlen_case, device, tol, max_abs_diff):
    check_verify_writes_every_draft_state(run_both, make_inputs, varlen_case, device, tol, max_abs_diff)


def test_no_l2norm_custom_scale(varlen_case, device, tol, max_abs_diff):
    check_no_l2norm_custom_scale(run_both, make_inputs, varlen_case, device, tol, max_abs_diff)


def test_bf16_inputs_and_pool(varlen_case, device):
    check_bf16_inputs_and_pool(run_both, make_inputs, varlen_case, device)


LENS = lens_strategy(short_max=8, max_size=4)


@settings(max_examples=6, deadline=None, phases=NO_SHRINK)
@given(lens=LENS, seed=st.integers(0, 2**16), snap=st.sampled_from([0.0, 0.2]))
def test_random_batches(lens, seed, snap, varlen_case, device, tol, max_abs_diff):
    case = varlen_case(lens, seed, snapshot_prob=snap)
    inp = make_inputs(case.num_tokens, case.num_slots, seed)
    want, got = run_both(inp, case, device)
    assert_same_result(got, want, tol, max_abs_diff)

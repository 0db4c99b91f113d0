"""Triton RG-LRU (gates, decay and scan in one kernel) against the torch reference."""

from __future__ import annotations

import pytest

from kernels.rglru.reference import rglru_torch, softplus_scale
from tests.kernels.test_rglru import rglru_inputs
from tests.kernels.varlen_cases import assert_same_result, poison_no_init_slot, with_snapshot_every_token

NAMES = ("x", "gx", "ga")


def run_both(inp, case, device, uniform_len=0):
    from kernels.rglru.triton_scan import rglru_triton

    scale, reset = softplus_scale(inp["param"]), inp["positions"] == 0
    ref_pool = inp["states"].clone()
    ref = rglru_torch(*(inp[n] for n in NAMES), scale, reset, ref_pool, case.seqs(uniform_len=uniform_len))
    pool = inp["states"].to(device)
    args = (*(inp[n].to(device) for n in NAMES), scale.to(device), reset.to(device))
    y = rglru_triton(*args, pool, case.seqs(device, uniform_len))
    return (ref, ref_pool), (y.cpu(), pool.cpu())


@pytest.mark.parametrize("lens", [[0, 1, 4, 37, 1, 16, 17], [3, 1]])
def test_mixed_batch_with_snapshots(lens, varlen_case, device, tol, max_abs_diff):
    case = varlen_case(lens, seed=4, snapshot_prob=0.2)
    inp = rglru_inputs(case.num_tokens, case.num_slots, seed=4)
    poison_no_init_slot(case, inp["states"])
    want, got = run_both(inp, case, device)
    assert_same_result(got, want, tol, max_abs_diff)


def test_decode_and_verify(varlen_case, device, tol, max_abs_diff):
    case = varlen_case([1, 1, 1], seed=6, init_prob=1.0)
    inp = rglru_inputs(case.num_tokens, case.num_slots, seed=6)
    want, got = run_both(inp, case, device, uniform_len=1)
    assert_same_result(got, want, tol, max_abs_diff)
    case, _ = with_snapshot_every_token(varlen_case([3, 3], seed=7, init_prob=1.0))
    inp = rglru_inputs(case.num_tokens, case.num_slots, seed=7)
    want, got = run_both(inp, case, device, uniform_len=3)
    assert_same_result(got, want, tol, max_abs_diff)

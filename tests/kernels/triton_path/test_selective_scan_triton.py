"""Triton Mamba1 selective scan (per-token + chunked) against the torch reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.selective_scan.reference import selective_scan_varlen_torch
from tests.kernels.varlen_cases import (
    NO_SHRINK,
    assert_same_result,
    lens_strategy,
    poison_no_init_slot,
    selective_scan_inputs,
    with_snapshot_every_token,
)

NAMES = ("x", "dt", "A", "B", "C", "D", "dt_bias")


def make_inputs(
    num_tokens: int, num_slots: int, seed: int, channels: int = 24, n_dim: int = 16, groups: int | None = None
) -> dict[str, torch.Tensor]:
    return selective_scan_inputs(num_tokens, num_slots, seed, channels, n_dim, groups)


def run_both(inp, case, device, dt_softplus=True, **kw):
    """(reference y, reference pool), (triton y, triton pool), all on the CPU."""
    from kernels.selective_scan.triton_varlen import selective_scan_varlen_triton

    ref_pool = inp["states"].clone()
    ref = selective_scan_varlen_torch(
        *(inp[n] for n in NAMES),
        ref_pool,
        case.cu_seqlens,
        case.slot_ids,
        case.has_initial_state,
        dt_softplus,
        16,
        case.state_dst_slots,
    )
    pool = inp["states"].to(device)
    args = (None if inp[n] is None else inp[n].to(device) for n in NAMES)
    y = selective_scan_varlen_triton(*args, pool, case.seqs(device), dt_softplus, 16, **kw)
    return (ref, ref_pool), (y.cpu(), pool.cpu())


def test_mixed_batch_with_snapshots(varlen_case, device, tol, max_abs_diff):
    """Empty, decode, verify-sized, 16/17 and chunked lengths (several chunks, snapshots
    inside them) and a NaN no-init slot that must not leak."""
    case = varlen_case([0, 1, 4, 37, 1, 16, 17], seed=4, snapshot_prob=0.2)
    inp = make_inputs(case.num_tokens, case.num_slots, seed=4)
    poison_no_init_slot(case, inp["states"])
    want, got = run_both(inp, case, device)
    assert_same_result(got, want, tol, max_abs_diff)


@pytest.mark.parametrize("recurrent_max_len", [0, 1000])
def test_every_sequence_on_one_path(recurrent_max_len, varlen_case, device, tol, max_abs_diff):
    """Padded tiles: channels and states that are no powers of two."""
    case = varlen_case([3, 40, 1], seed=6, snapshot_prob=0.15)
    inp = make_inputs(case.num_tokens, case.num_slots, seed=6, channels=37, n_dim=5)
    want, got = run_both(inp, case, device, recurrent_max_len=recurrent_max_len)
    assert_same_result(got, want, tol, max_abs_diff)


@pytest.mark.parametrize("recurrent_max_len", [0, 1000])
def test_grouped_b_c(recurrent_max_len, varlen_case, device, tol, max_abs_diff):
    """B and C per group of channels (Zamba's Mamba heads); groups of 12 and 13 channels
    cross the channel blocks, and 5 states pad the state tile."""
    for channels, groups in ((24, 2), (39, 3)):
        case = varlen_case([1, 3, 40, 1], seed=7, snapshot_prob=0.15)
        inp = make_inputs(case.num_tokens, case.num_slots, seed=7, channels=channels, n_dim=5, groups=groups)
        want, got = run_both(inp, case, device, recurrent_max_len=recurrent_max_len)
        assert_same_result(got, want, tol, max_abs_diff)


def test_verify_writes_every_draft_state(varlen_case, device, tol, max_abs_diff):
    case, dst = with_snapshot_every_token(varlen_case([4, 4, 1], seed=8, init_prob=1.0))
    inp = make_inputs(case.num_tokens, case.num_slots, seed=8)
    want, got = run_both(inp, case, device)
    assert_same_result(got, want, tol, max_abs_diff)
    assert not torch.equal(got[1][dst[0]], got[1][dst[1]])


def test_without_softplus_skip_or_bias(varlen_case, device, tol, max_abs_diff):
    case = varlen_case([2, 20], seed=10, snapshot_prob=0.1)
    inp = make_inputs(case.num_tokens, case.num_slots, seed=10)
    inp.update(dt=inp["dt"].abs() * 0.3, D=None, dt_bias=None)
    want, got = run_both(inp, case, device, dt_softplus=False)
    assert_same_result(got, want, tol, max_abs_diff)


def test_bf16_activations(varlen_case, device):
    case = varlen_case([1, 3, 21], seed=12, snapshot_prob=0.1, init_prob=1.0)
    inp = make_inputs(case.num_tokens, case.num_slots, seed=12)
    inp.update({n: inp[n].bfloat16() for n in ("x", "dt", "B", "C")})
    (ref, ref_pool), (y, pool) = run_both(inp, case, device)
    assert y.dtype == torch.bfloat16 and pool.dtype == torch.float32
    torch.testing.assert_close(y.float(), ref.float(), rtol=2e-2, atol=2e-2)  # 1 bf16 ulp
    torch.testing.assert_close(pool, ref_pool, rtol=0, atol=1e-3)


LENS = lens_strategy(short_max=8, max_size=4)


@settings(max_examples=5, deadline=None, phases=NO_SHRINK)
@given(lens=LENS, seed=st.integers(0, 2**16), snap=st.sampled_from([0.0, 0.2]))
def test_random_batches(lens, seed, snap, varlen_case, device, tol, max_abs_diff):
    case = varlen_case(lens, seed, snapshot_prob=snap)
    inp = make_inputs(case.num_tokens, case.num_slots, seed, channels=16)
    want, got = run_both(inp, case, device)
    assert_same_result(got, want, tol, max_abs_diff)

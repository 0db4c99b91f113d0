"""Mamba1 selective scan varlen op against a naive per-token loop, transformers, and itself."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.recurrent_batch import RecurrentBatch
from kernels.selective_scan import mamba_selective_scan
from kernels.selective_scan import reference as scan
from tests.kernels.varlen_cases import lens_strategy, naive_varlen, poison_no_init_slot, selective_scan_inputs

H, N = 6, 5
TOL = 1e-4
NAMES = ("x", "dt", "A", "B", "C", "D", "dt_bias")


def make_inputs(num_tokens: int, num_slots: int, seed: int, groups: int | None = None) -> dict[str, torch.Tensor]:
    return selective_scan_inputs(num_tokens, num_slots, seed, H, N, groups)


def naive_scan(inp: dict[str, torch.Tensor], case, dt_softplus: bool = True):
    """Token by token, channel by channel (B, C [T, N] or grouped [T, G, N]); returns
    (y [T, H], final pool)."""
    out = torch.zeros(inp["x"].shape)
    groups = 1 if inp["B"].dim() == 2 else inp["B"].shape[1]

    def row(name: str, t: int, h: int) -> torch.Tensor:
        return inp[name][t] if inp[name].dim() == 2 else inp[name][t, h // (H // groups)]

    def token(t: int, s: torch.Tensor) -> None:
        for h in range(H):
            step = inp["dt"][t, h] + inp["dt_bias"][h]
            step = F.softplus(step) if dt_softplus else step
            s[h] = torch.exp(step * inp["A"][h]) * s[h] + step * inp["x"][t, h] * row("B", t, h)
            out[t, h] = s[h] @ row("C", t, h) + inp["D"][h] * inp["x"][t, h]

    pool = naive_varlen(inp["states"], case, token)
    return out, pool


def run_op(inp, case, chunk_size: int = 8, **kw):
    states = inp["states"].clone()
    y = mamba_selective_scan(*(inp[n] for n in NAMES), states, case.seqs(), chunk_size=chunk_size, **kw)
    return y, states


LENS = lens_strategy(short_max=12, max_size=5)


@pytest.mark.parametrize("recurrent_max_len", [0, 16, 10**6])
@settings(max_examples=12, deadline=None)
@given(lens=LENS, seed=st.integers(0, 2**16), snap=st.sampled_from([0.0, 0.15, 0.4]))
def test_matches_naive(recurrent_max_len, lens, seed, snap, varlen_case, max_abs_diff):
    case = varlen_case(lens, seed, snapshot_prob=snap)
    inp = make_inputs(case.num_tokens, case.num_slots, seed)
    ref_y, ref_pool = naive_scan(inp, case)
    with mock.patch.object(scan, "RECURRENT_MAX_LEN", recurrent_max_len):
        y, pool = run_op(inp, case)
    assert max_abs_diff(y, ref_y) <= TOL
    assert max_abs_diff(pool, ref_pool) <= TOL  # live, snapshot, dummy and spare slots


def test_fixed_mixed_batch_without_softplus_or_skip(varlen_case, max_abs_diff):
    """Lengths 0/1/short/long with snapshots, a NaN no-init slot, raw dt, no D and no bias."""
    case = varlen_case([0, 1, 5, 37, 1, 20, 16, 17], seed=4, snapshot_prob=0.2)
    inp = make_inputs(case.num_tokens, case.num_slots, seed=4)
    poison_no_init_slot(case, inp["states"])
    inp["dt"] = inp["dt"].abs() * 0.3
    plain = dict(inp, D=torch.zeros(H), dt_bias=torch.zeros(H))
    ref_y, ref_pool = naive_scan(plain, case, dt_softplus=False)
    for recurrent_max_len in (0, 16, 10**6):
        with mock.patch.object(scan, "RECURRENT_MAX_LEN", recurrent_max_len):
            y, pool = run_op(dict(inp, D=None, dt_bias=None), case, dt_softplus=False)
        assert max_abs_diff(y, ref_y) <= TOL
        assert max_abs_diff(pool, ref_pool) <= TOL


@pytest.mark.parametrize("groups", [2, 3])
def test_grouped_b_c_match_naive(groups, varlen_case, max_abs_diff):
    """B and C per group of H / G channels (Zamba's Mamba heads), on every path."""
    case = varlen_case([0, 1, 5, 37, 1, 20], seed=5, snapshot_prob=0.2)
    inp = make_inputs(case.num_tokens, case.num_slots, seed=5, groups=groups)
    ref_y, ref_pool = naive_scan(inp, case)
    for recurrent_max_len in (0, 16, 10**6):
        with mock.patch.object(scan, "RECURRENT_MAX_LEN", recurrent_max_len):
            y, pool = run_op(inp, case)
        assert max_abs_diff(y, ref_y) <= TOL
        assert max_abs_diff(pool, ref_pool) <= TOL
    dec_case = varlen_case([1] * 4, seed=2, init_prob=1.0)
    dec = make_inputs(4, dec_case.num_slots, seed=2, groups=groups)
    want_y, want_pool = naive_scan(dec, dec_case)
    pool = dec["states"].clone()
    y = mamba_selective_scan(*(dec[n] for n in NAMES), pool, dec_case.seqs(uniform_len=1))
    assert max_abs_diff(y, want_y) <= TOL
    assert max_abs_diff(pool, want_pool) <= TOL


@pytest.mark.parametrize("chunk_size", [1, 7, 16, 64])
def test_chunked_equals_recurrent(chunk_size, max_abs_diff):
    inp = make_inputs(50, 1, seed=9)
    step = scan.discretize_dt(inp["dt"], inp["dt_bias"], True)
    seq = (inp["x"], step, scan.grouped(inp["B"]), scan.grouped(inp["C"]))
    s0 = inp["states"][0]
    y_c, s_c = scan.scan_chunked(seq, s0, A=inp["A"], chunk_size=chunk_size)
    y_r, s_r = scan.scan_recurrent(
        tuple(t[None] for t in seq), torch.ones(1, 50, dtype=torch.bool), s0[None].clone(), A=inp["A"]
    )
    assert max_abs_diff(y_c, y_r[0]) <= TOL
    assert max_abs_diff(s_c, s_r[0]) <= TOL


def test_matches_transformers_jamba(max_abs_diff):
    """Pins the dt rule, the [H, N] layout, A per (channel, state) and the D skip to Jamba's
    torch scan (from a zero state) and to its one-token selective state update."""
    hf = pytest.importorskip("transformers.models.jamba.modeling_jamba")
    inp = make_inputs(41, 2, seed=12)
    states = inp["states"].clone()
    slot = torch.tensor([1], dtype=torch.int32)
    y = mamba_selective_scan(
        *(inp[n][:40] if inp[n].shape[0] == 41 else inp[n] for n in NAMES),
        states,
        RecurrentBatch(torch.tensor([0, 40], dtype=torch.int32), slot, torch.tensor([False])),
        chunk_size=16,
    )
    seq = {n: inp[n][None, :40].transpose(1, 2) for n in ("x", "dt", "B", "C")}  # [1, *, L]
    ref_y, ref_s = hf.mamba_selective_scan(
        seq["x"],
        seq["dt"],
        inp["A"],
        seq["B"],
        seq["C"],
        D=inp["D"],
        delta_bias=inp["dt_bias"],
        delta_softplus=True,
        return_last_state=True,
    )
    assert max_abs_diff(y, ref_y[0].T) <= TOL
    assert max_abs_diff(states[1], ref_s[0]) <= TOL
    hf_state = ref_s.clone()
    ref_dec = hf.mamba_selective_state_update(
        hf_state,
        inp["x"][40:],
        inp["dt"][40:],
        inp["A"],
        inp["B"][40:],
        inp["C"][40:],
        inp["D"],
        dt_bias=inp["dt_bias"],
        dt_softplus=True,
    )
    dec = mamba_selective_scan(
        *(inp[n][40:] if inp[n].shape[0] == 41 else inp[n] for n in NAMES), states, RecurrentBatch.decode(slot)
    )
    assert max_abs_diff(dec, ref_dec) <= TOL
    assert max_abs_diff(states[1], hf_state[0]) <= TOL


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_update_equals_varlen(varlen_case, pool_dtype):
    """The decode fast path: bitwise the varlen op's result on one-token sequences."""
    case = varlen_case([1] * 5, seed=3, init_prob=1.0)
    inp = make_inputs(5, case.num_slots, seed=3)
    pool = inp["states"].to(pool_dtype)
    ref_pool, fast_pool = pool.clone(), pool.clone()
    ref = mamba_selective_scan(*(inp[n] for n in NAMES), ref_pool, case.seqs())
    out = mamba_selective_scan(*(inp[n] for n in NAMES), fast_pool, case.seqs(uniform_len=1))
    assert torch.equal(out, ref)
    assert torch.equal(fast_pool, ref_pool)
    assert not torch.equal(fast_pool, pool)  # the live slots did move


def test_dtypes_bf16_inputs_fp32_pool(varlen_case):
    """Math in fp32: bf16 inputs give the fp32 result on the same values, rounded once."""
    case = varlen_case([3, 30, 1], seed=6, snapshot_prob=0.1)
    inp = make_inputs(case.num_tokens, case.num_slots, seed=6)
    low = {n: (t.bfloat16() if n in ("x", "dt", "B", "C") else t) for n, t in inp.items()}
    y_low, pool_low = run_op(low, case)
    y_ref, pool_ref = run_op({n: t.float() for n, t in low.items()}, case)
    assert y_low.dtype == torch.bfloat16 and pool_low.dtype == torch.float32
    assert torch.equal(y_low, y_ref.bfloat16())
    assert torch.equal(pool_low, pool_ref)


def test_bad_shapes_are_refused(varlen_case):
    case = varlen_case([4], seed=1)
    inp = make_inputs(4, case.num_slots, seed=1)
    with pytest.raises(ValueError, match=r"A \(6,\)"):
        run_op(dict(inp, A=inp["A"][:, 0]), case)

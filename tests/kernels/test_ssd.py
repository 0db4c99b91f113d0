"""Mamba2 SSD varlen op against a naive per-token loop, transformers, and itself."""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.recurrent_batch import RecurrentBatch
from kernels.ssd import reference as ssd_ref
from kernels.ssd import ssd_scan
from tests.kernels.varlen_cases import lens_strategy, naive_varlen, poison_no_init_slot, ssd_inputs

H, P, G, N = 4, 3, 2, 5  # two heads per group
TOL = 1e-4


def make_inputs(num_tokens: int, num_slots: int, seed: int) -> dict[str, torch.Tensor]:
    return ssd_inputs(num_tokens, num_slots, seed, H, G, P, N)


def naive_ssd(inp: dict[str, torch.Tensor], case, dt_limit=(0.0, math.inf)):
    """Token by token, head by head; returns (y [T, H, P], final pool)."""
    out = torch.zeros(inp["x"].shape)

    def token(t: int, s: torch.Tensor) -> None:
        for h in range(H):
            grp = h // (H // G)
            step = F.softplus(inp["dt"][t, h] + inp["dt_bias"][h]).clamp(*dt_limit)
            update = step * torch.outer(inp["x"][t, h], inp["B"][t, grp])
            s[h] = torch.exp(step * inp["A"][h]) * s[h] + update
            out[t, h] = s[h] @ inp["C"][t, grp] + inp["D"][h] * inp["x"][t, h]

    pool = naive_varlen(inp["states"], case, token)
    return out, pool


def run_op(inp, case, chunk_size: int, **kw):
    states = inp["states"].clone()
    y = ssd_scan(
        inp["x"],
        inp["dt"],
        inp["A"],
        inp["B"],
        inp["C"],
        inp["D"],
        inp["dt_bias"],
        states,
        case.seqs(),
        chunk_size=chunk_size,
        **kw,
    )
    return y, states


LENS = lens_strategy(short_max=12, max_size=5)


@pytest.mark.parametrize("recurrent_max_len", [0, 16, 10**6])
@settings(max_examples=12, deadline=None)
@given(lens=LENS, seed=st.integers(0, 2**16), snap=st.sampled_from([0.0, 0.15, 0.4]))
def test_matches_naive(recurrent_max_len, lens, seed, snap, varlen_case, max_abs_diff):
    case = varlen_case(lens, seed, snapshot_prob=snap)
    inp = make_inputs(case.num_tokens, case.num_slots, seed)
    ref_y, ref_pool = naive_ssd(inp, case)
    with mock.patch.object(ssd_ref, "RECURRENT_MAX_LEN", recurrent_max_len):
        y, pool = run_op(inp, case, chunk_size=8)
    assert max_abs_diff(y, ref_y) <= TOL
    assert max_abs_diff(pool, ref_pool) <= TOL  # live, snapshot, dummy and spare slots


def test_fixed_mixed_batch_with_dt_limit(varlen_case, max_abs_diff):
    """Lengths 0/1/short/long with snapshots and a binding dt clamp on every path."""
    case = varlen_case([0, 1, 5, 37, 1, 20, 16, 17], seed=4, snapshot_prob=0.2)
    inp = make_inputs(case.num_tokens, case.num_slots, seed=4)
    poison_no_init_slot(case, inp["states"])
    limit = (0.2, 0.9)
    ref_y, ref_pool = naive_ssd(inp, case, dt_limit=limit)
    unclamped, _ = naive_ssd(inp, case)
    assert max_abs_diff(unclamped, ref_y) > 1e-2  # the clamp matters in this case
    for recurrent_max_len in (0, 16, 10**6):
        with mock.patch.object(ssd_ref, "RECURRENT_MAX_LEN", recurrent_max_len):
            y, pool = run_op(inp, case, chunk_size=16, dt_limit=limit)
        assert max_abs_diff(y, ref_y) <= TOL
        assert max_abs_diff(pool, ref_pool) <= TOL


@pytest.mark.parametrize("chunk_size", [1, 7, 16, 64])
def test_chunked_equals_recurrent(chunk_size, max_abs_diff):
    inp = make_inputs(50, 1, seed=9)
    step = ssd_ref.discretize_dt(inp["dt"], inp["dt_bias"], True, (0.0, math.inf))
    seq = (inp["x"], step, inp["B"], inp["C"])
    s0 = inp["states"][0]
    y_c, s_c = ssd_ref.ssd_chunked(seq, s0, A=inp["A"], chunk_size=chunk_size)
    y_r, s_r = ssd_ref.ssd_recurrent(
        tuple(x[None] for x in seq), torch.ones(1, 50, dtype=torch.bool), s0[None].clone(), A=inp["A"]
    )
    assert max_abs_diff(y_c, y_r[0]) <= TOL
    assert max_abs_diff(s_c, s_r[0]) <= TOL


def test_matches_transformers(max_abs_diff):
    """Pins the dt rule, group mapping, D skip and the [H, P, N] layout to Granite's torch SSD."""
    hf = pytest.importorskip("transformers.models.granitemoehybrid.modeling_granitemoehybrid")
    inp = make_inputs(41, 2, seed=12)
    states = inp["states"].clone()
    slot, has_init = torch.tensor([1], dtype=torch.int32), torch.tensor([True])
    y = ssd_scan(
        inp["x"][:40],
        inp["dt"][:40],
        inp["A"],
        inp["B"][:40],
        inp["C"][:40],
        inp["D"],
        inp["dt_bias"],
        states,
        RecurrentBatch(torch.tensor([0, 40], dtype=torch.int32), slot, has_init),
        chunk_size=16,
    )
    pre = {n: inp[n][None, :40] for n in ("x", "dt", "B", "C")}
    ref_y, ref_s = hf.mamba2_chunk_scan(
        pre["x"],
        pre["dt"],
        inp["A"],
        pre["B"],
        pre["C"],
        chunk_size=16,
        D=inp["D"],
        dt_bias=inp["dt_bias"],
        initial_states=inp["states"][1:2].clone(),
        dt_softplus=True,
        return_final_states=True,
    )
    assert max_abs_diff(y, ref_y[0]) <= TOL
    assert max_abs_diff(states[1], ref_s[0]) <= TOL
    # one decode token from the state just written, against HF's selective_state_update
    hf_state = ref_s.clone()
    ref_dec = hf.mamba2_selective_state_update(
        hf_state,
        inp["x"][40:41],
        inp["dt"][40:41, :, None].expand(1, H, P),
        inp["A"][:, None, None].expand(H, P, N),
        inp["B"][40:41],
        inp["C"][40:41],
        inp["D"][:, None].expand(H, P),
        dt_bias=inp["dt_bias"][:, None].expand(H, P),
        dt_softplus=True,
    )
    dec = ssd_scan(
        inp["x"][40:],
        inp["dt"][40:],
        inp["A"],
        inp["B"][40:],
        inp["C"][40:],
        inp["D"],
        inp["dt_bias"],
        states,
        RecurrentBatch(torch.tensor([0, 1], dtype=torch.int32), slot, has_init),
    )
    assert max_abs_diff(dec, ref_dec) <= TOL
    assert max_abs_diff(states[1], hf_state[0]) <= TOL


def test_dtypes_bf16_inputs_fp32_pool(varlen_case):
    """Math in fp32: bf16 inputs give the fp32 result on the same values, rounded once."""
    case = varlen_case([3, 30, 1], seed=6, snapshot_prob=0.1)
    inp = make_inputs(case.num_tokens, case.num_slots, seed=6)
    low = {n: (x.bfloat16() if n in ("x", "dt", "B", "C") else x) for n, x in inp.items()}
    y_low, pool_low = run_op(low, case, chunk_size=8)
    y_ref, pool_ref = run_op({n: x.float() for n, x in low.items()}, case, chunk_size=8)
    assert y_low.dtype == torch.bfloat16 and pool_low.dtype == torch.float32
    assert torch.equal(y_low, y_ref.bfloat16())
    assert torch.equal(pool_low, pool_ref)

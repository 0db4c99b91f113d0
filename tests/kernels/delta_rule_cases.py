"""Test bodies shared by the two delta-rule ops, GDN (``kernels.gdn``) and KDA
(``kernels.kda``): both take ``q, k, v, g, beta, states`` and differ only in the decay's
shape. Each test module passes its own ``run_op`` / ``run_both`` / ``make_inputs``."""

from __future__ import annotations

from typing import Callable

import torch

from kernels.recurrent_batch import RecurrentBatch
from tests.kernels.varlen_cases import Inputs, Result, assert_same_result, with_snapshot_every_token

RunOp = Callable[..., Result]  # (inputs, case, **kw) -> (out, pool)
RunBoth = Callable[..., tuple[Result, Result]]  # (inputs, case, device, **kw) -> (want, got)
MakeInputs = Callable[..., Inputs]  # (num_tokens, num_slots, seed) -> inputs


def check_matches_transformers(
    op: Callable[..., torch.Tensor], hf_fns: tuple, inp: Inputs, tol: float, max_abs_diff
) -> None:
    """One 45-token sequence from slot 1's state: output and final state equal transformers'
    chunked and recurrent torch functions on the same inputs."""
    states = inp["states"].clone()
    o = op(
        inp["q"],
        inp["k"],
        inp["v"],
        inp["g"],
        inp["beta"],
        states,
        RecurrentBatch(
            torch.tensor([0, inp["v"].shape[0]], dtype=torch.int32),
            torch.tensor([1], dtype=torch.int32),
            torch.tensor([True]),
        ),
    )
    args = [inp[n][None] for n in ("q", "k", "v")]
    kw = dict(
        g=inp["g"][None],
        beta=inp["beta"][None],
        initial_state=inp["states"][1:2].clone(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    for fn in hf_fns:
        ref_o, ref_s = fn(*args, **kw)
        assert max_abs_diff(o, ref_o[0]) <= tol, fn.__name__
        assert max_abs_diff(states[1], ref_s[0]) <= tol, fn.__name__


def check_bf16_inputs_fp32_pool(run_op: RunOp, make_inputs: MakeInputs, varlen_case) -> None:
    """Math in fp32: bf16 inputs give the fp32 result on the same values, rounded once."""
    case = varlen_case([3, 30, 1], seed=5, snapshot_prob=0.1)
    inp = make_inputs(case.num_tokens, case.num_slots, seed=5)
    low = {n: (x.bfloat16() if n != "states" else x) for n, x in inp.items()}
    o_low, pool_low = run_op(low, case, chunk_size=8)
    o_ref, pool_ref = run_op({n: x.float() for n, x in low.items()}, case, chunk_size=8)
    assert o_low.dtype == torch.bfloat16 and pool_low.dtype == torch.float32
    assert torch.equal(o_low, o_ref.bfloat16())
    assert torch.equal(pool_low, pool_ref)


def check_verify_writes_every_draft_state(
    run_both: RunBoth, make_inputs: MakeInputs, varlen_case, device, tol: float, max_abs_diff
) -> None:
    """Speculative verify: 1 + 3 draft tokens per sequence, a snapshot after every token."""
    case, dst = with_snapshot_every_token(varlen_case([4, 4, 1], seed=7, init_prob=1.0))
    inp = make_inputs(case.num_tokens, case.num_slots, seed=7)
    want, got = run_both(inp, case, device)
    assert_same_result(got, want, tol, max_abs_diff)
    assert not torch.equal(got[1][dst[0]], got[1][dst[1]])  # distinct per-token states


def check_no_l2norm_custom_scale(
    run_both: RunBoth, make_inputs: MakeInputs, varlen_case, device, tol: float, max_abs_diff
) -> None:
    case = varlen_case([2, 20], seed=9, snapshot_prob=0.1)
    inp = make_inputs(case.num_tokens, case.num_slots, seed=9)
    for name in ("q", "k"):  # keep the unnormalised delta rule stable
        inp[name] = inp[name] / inp[name].norm(dim=-1, keepdim=True)
    want, got = run_both(inp, case, device, scale=0.3, use_qk_l2norm=False)
    assert_same_result(got, want, tol, max_abs_diff)


def check_bf16_inputs_and_pool(run_both: RunBoth, make_inputs: MakeInputs, varlen_case, device) -> None:
    """bf16 activations and a bf16 pool: fp32 math, rounded once on store, as the reference."""
    case = varlen_case([1, 3, 21], seed=11, snapshot_prob=0.1, init_prob=1.0)
    inp = {n: x.bfloat16() for n, x in make_inputs(case.num_tokens, case.num_slots, 11).items()}
    (ref, ref_pool), (out, pool) = run_both(inp, case, device)
    assert out.dtype == torch.bfloat16 and pool.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)  # 1 bf16 ulp
    torch.testing.assert_close(pool.float(), ref_pool.float(), rtol=2e-2, atol=2e-2)

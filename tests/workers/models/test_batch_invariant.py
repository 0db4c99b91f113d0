"""The ``deterministic`` switch (``kernels/dense.py``'s batch-invariant mode): on every MoE
family a prompt gets the same tokens and logprob bits alone and inside batches of 2, 5 and 9
prompts (decode steps of few and of many rows, experts of few and many rows, a long prefill),
and the kernels it rests on give a row the same bits at any row count."""

from __future__ import annotations

import pytest
import torch

from kernels import dense, native_ops
from tools.tiny_registry import TINY_FAMILIES
from workers.llm import LLM
from workers.sampling.params import SamplingParams

MOE_FAMILIES = sorted(n for n, f in TINY_FAMILIES.items() if any("expert" in k for k in f.config) or "moe" in n)
PROMPT = [151, 217, 76, 279, 63, 295, 160, 289, 151, 231, 259, 347, 94, 141]


def _others(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    lens = [9, 40, 3, 17, 25, 6, 31, 12]  # 40: a long prefill beside the prompt
    return [torch.randint(3, 400, (lens[i],), generator=gen).tolist() for i in range(n)]


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_a_prompt_gets_the_same_bits_in_any_batch(family, tiny_checkpoint):
    llm = LLM(
        model=str(tiny_checkpoint(family)),
        cache={"enable_prefix_cache": False},
        scheduler={"overlap": False},
        deterministic=True,
    )
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=0, ignore_eos=True)

    def run(prompts: list[list[int]], at: int) -> tuple[list[int], list[float]]:
        out = llm.generate_ids(prompts, [params] * len(prompts))[at]
        return out.token_ids, [lp.logprob for lp in out.logprobs]

    alone = run([PROMPT], 0)
    for n in (1, 4, 8):
        others = _others(n)
        assert run([PROMPT, *others], 0) == alone, n
        assert run([*others, PROMPT], n) == alone, n  # the prompt's rows last


@pytest.mark.skipif(not native_ops.load(), reason="the native ops did not build")
def test_the_kernels_give_a_row_its_bits_at_any_row_count():
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(45, 96, generator=gen), torch.randn(80, 96, generator=gen)
    e, h, i, k = 4, 64, 48, 2
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(45)])
    weights = torch.rand(45, k, generator=gen)
    w_gate, w_up, w_down = (
        torch.randn(e, i, h, generator=gen),
        torch.randn(e, i, h, generator=gen),
        torch.randn(e, h, i, generator=gen),
    )
    xe = torch.randn(45, h, generator=gen)
    with torch.inference_mode(), dense.batch_invariant():
        whole = dense.linear(x, w)
        experts = torch.ops.hybridserve_native.moe_experts(xe, weights, ids, w_gate, w_up, w_down, "silu", 0.0, True)
        for lo, hi in ((0, 1), (3, 11), (5, 22), (20, 45)):
            assert torch.equal(dense.linear(x[lo:hi], w), whole[lo:hi])
            part = torch.ops.hybridserve_native.moe_experts(
                xe[lo:hi], weights[lo:hi], ids[lo:hi], w_gate, w_up, w_down, "silu", 0.0, True
            )
            assert torch.equal(part, experts[lo:hi]), (lo, hi)
    torch.testing.assert_close(whole, x @ w.T, rtol=1e-4, atol=1e-4)


def test_a_one_wide_gate_gets_a_row_its_bits_at_any_row_count():
    """The shared expert's [T, 1] gate is one flat run of T floats: ATen's scalar tail for it
    (other bits than its vector formula) must not depend on T."""
    x = torch.randn(256, 1, generator=torch.Generator().manual_seed(0)) * 4
    with dense.batch_invariant():
        whole = dense.pointwise(torch.sigmoid, x)
        for i in range(x.shape[0]):
            assert torch.equal(dense.pointwise(torch.sigmoid, x[i : i + 1]), whole[i : i + 1]), i


def test_the_switch_is_refused_where_it_cannot_hold():
    with pytest.raises(ValueError, match="fp32 model on CPU"):
        dense.check_invariant_mode(torch.device("cpu"), {torch.bfloat16})

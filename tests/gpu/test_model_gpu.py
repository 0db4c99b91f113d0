"""Whole models on CUDA: greedy tokens with the GPU kernels equal the torch path.

``auto`` on CUDA runs every recurrent op and norm in Triton and, in bf16, attention in
FlashInfer; ``torch`` runs the references on the same GPU. Two different kernels may split a
near-tie differently, so a divergence is accepted only where the reference's top-2 logprobs
are within ``TIE`` of each other; the sequence is not compared after that point.
"""
from __future__ import annotations

import pytest

import kernels.attention
from kernels import backend
from tests.gpu.common import has_flashinfer

PROMPTS = ["Hello there", "a",
           "The quick brown fox jumps over the lazy dog while the cat sleeps on a warm mat. " * 6]
MAX_TOKENS = 16


def run(model_dir, dtype: str):
    LLM = pytest.importorskip("workers.llm").LLM     # the engine's deps may be missing
    from workers.sampling_params import SamplingParams

    llm = LLM(model=str(model_dir), device="cuda", dtype=dtype,
              cache={"page_size": 16, "max_kv_tokens": 8192})
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)
    return llm.generate(PROMPTS, params)


def assert_greedy_equal(got, want, tie: float) -> None:
    for g, w in zip(got, want):
        for i, (a, b) in enumerate(zip(g.token_ids, w.token_ids)):
            if a == b:
                continue
            top = w.logprobs[i].top
            gap = top[0][1] - top[1][1]
            assert gap <= tie, (f"token {i} of {w.prompt!r}: {a} vs reference {b}, reference "
                                f"top-2 gap {gap:.4f} > {tie}")
            break


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    from workers.models.tiny import make_tiny_checkpoint

    # head_dim 64: a size FlashInfer ships kernels for (the CPU tiny model uses 32)
    return make_tiny_checkpoint("qwen3_next", tmp_path_factory.mktemp("qwen_gpu"), seed=0,
                                head_dim=64)


def test_fp32_triton_recurrent_path(tiny_model_dir):
    """fp32: Triton for the recurrent ops and norms, torch attention (FlashInfer is bf16)."""
    with backend.use_backend("torch"):
        want = run(tiny_model_dir, "float32")
    with backend.use_backend("auto"):
        got = run(tiny_model_dir, "float32")
    assert_greedy_equal(got, want, tie=1e-2)     # tf32 dots in the chunked kernels


@pytest.mark.skipif(not has_flashinfer(), reason="flashinfer is not installed")
def test_bf16_triton_and_flashinfer(qwen_dir, monkeypatch):
    with backend.use_backend("torch"):
        want = run(qwen_dir, "bfloat16")

    def boom(*args, **kwargs):
        raise AssertionError("the torch attention ran on the FlashInfer path")

    monkeypatch.setattr(kernels.attention, "paged_attention_torch", boom)
    with backend.use_backend("auto"):
        got = run(qwen_dir, "bfloat16")
    assert_greedy_equal(got, want, tie=0.1)

"""FP8 checkpoints through the whole engine: each layout of ``tools.quantize`` (block-wise
fp8, ModelOpt, compressed-tensors channel) of Qwen3-Next, Qwen3.5-MoE (experts fused) and
Nemotron-H, all with MTP, generates greedily exactly what the same model does from its
dequantized weights saved as a plain fp32 checkpoint, with the prefix cache (the second
pass hits it), MTP speculation and the overlap scheduler on.

transformers' own FP8 loading is the second reference where it runs here: its fine-grained
FP8 loader needs ``accelerate`` (then dequantizes on CPU), compressed-tensors needs the
``compressed_tensors`` package, and it has no ModelOpt loader at all.
"""

from __future__ import annotations

import shutil

import pytest

from tests.workers.engine.helpers import greedy_tokens, make_llm, random_prompts
from tools.quantize import quantize_checkpoint
from tools.tiny_qwen3_5 import fuse_experts
from workers.sampling.params import SamplingParams

P = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
FAMILIES = ("qwen3_next", "qwen3_5_moe", "nemotron_h")
LAYOUTS = ("block", "modelopt", "channel")
BLOCK = (32, 32)  # smaller than the tiny dims, and not dividing every one of them


@pytest.fixture(scope="module")
def sources(tiny_checkpoint, tmp_path_factory):
    """family -> its tiny checkpoint with MTP (Qwen3.5-MoE's experts fused, as released)."""
    fused = tmp_path_factory.mktemp("qwen3_5_moe_fused")
    shutil.copytree(tiny_checkpoint("qwen3_5_moe"), fused, dirs_exist_ok=True)
    fuse_experts(fused)
    return {
        "qwen3_next": tiny_checkpoint("qwen3_next"),
        "qwen3_5_moe": fused,
        "nemotron_h": tiny_checkpoint("nemotron_h"),
    }


@pytest.fixture(scope="module")
def quantized(sources, tmp_path_factory):
    """(family, layout) -> (FP8 dir, dequantized fp32 dir), built on first use."""
    built = {}

    def get(family, layout):
        if (family, layout) not in built:
            root = tmp_path_factory.mktemp(f"{family}_{layout}")
            quantize_checkpoint(sources[family], root / "fp8", layout, block=BLOCK, dequantized=root / "ref")
            built[family, layout] = (root / "fp8", root / "ref")
        return built[family, layout]

    return get


def prompts(vocab: int) -> list[list[int]]:
    base = random_prompts(vocab, [3, 9, 17, 26], seed=5)
    return base + [base[3][:20] + [11, 12]]


def everything_on(path):
    llm = make_llm(
        path,
        spec={"method": "mtp", "num_draft_tokens": 2},
        scheduler={"overlap": True},
        debug={"check_invariants": True},
    )
    llm.engine.raise_on_violation = True
    return llm


def two_passes(llm) -> list[list[list[int]]]:
    ps = prompts(llm.engine.vocab_size)
    return [greedy_tokens(llm, ps, P) for _ in range(2)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_greedy_equals_its_dequantized_fp32_checkpoint(quantized, family, layout):
    fp8_dir, ref_dir = quantized(family, layout)
    expected = two_passes(everything_on(ref_dir))
    llm = everything_on(fp8_dir)
    got = two_passes(llm)
    assert got == expected
    assert got[0] == got[1]
    stats = llm.stats()
    assert stats["hybridserve_prefix_hit_tokens_total"] > 0
    assert stats["hybridserve_spec_draft_tokens_total"] > 0


def test_transformers_fp8_loader_agrees(quantized):
    """transformers dequantizes a block-wise checkpoint on CPU (it needs accelerate for it)."""
    pytest.importorskip("accelerate", reason="transformers' FP8 loader needs accelerate, not installed here")
    from tests.workers.engine.test_vs_transformers import hf_greedy

    fp8_dir, ref_dir = quantized("qwen3_next", "block")
    llm = make_llm(fp8_dir)
    ps = prompts(llm.engine.vocab_size)
    ours = greedy_tokens(llm, ps, P)
    assert hf_greedy(ref_dir, ps, P.max_tokens) == ours
    assert hf_greedy(fp8_dir, ps, P.max_tokens) == ours


def test_transformers_compressed_tensors_loader_agrees(quantized):
    pytest.importorskip("compressed_tensors", reason="transformers' loader needs compressed_tensors, not installed")
    from tests.workers.engine.test_vs_transformers import hf_greedy

    fp8_dir, _ = quantized("qwen3_next", "channel")
    llm = make_llm(fp8_dir)
    ps = prompts(llm.engine.vocab_size)
    assert hf_greedy(fp8_dir, ps, P.max_tokens) == greedy_tokens(llm, ps, P)

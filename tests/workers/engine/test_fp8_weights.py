"""FP8 checkpoints kept FP8 (``fp8_weights``): the projections hold e4m3 weights and their
scales and multiply through ``kernels.fp8``; greedy output with the prefix cache, MTP and the
overlap scheduler on equals the same model with all of them off; the logits stay near the
dequantized model's (what FP8 activations cost); refusals name the fields."""

from __future__ import annotations

import pytest
import torch

from kernels import dense
from tests.workers.engine.helpers import greedy_tokens, make_llm
from tests.workers.engine.test_fp8_checkpoints import BLOCK, P, prompts
from tools.quantize import quantize_checkpoint

LAYOUTS = ("block", "modelopt", "channel")


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint, tmp_path_factory):
    """layout -> (FP8 Qwen3-Next with MTP, its dequantized fp32 twin)."""
    built = {}

    def get(layout):
        if layout not in built:
            root = tmp_path_factory.mktemp(f"fp8w_{layout}")
            quantize_checkpoint(
                tiny_checkpoint("qwen3_next"), root / "fp8", layout, block=BLOCK, dequantized=root / "ref"
            )
            built[layout] = (root / "fp8", root / "ref")
        return built[layout]

    return get


def fp8_modules(llm) -> list[str]:
    return [
        n
        for n, m in llm.engine.model.named_modules()
        if isinstance(m, dense.Linear) and m.weight.dtype == torch.float8_e4m3fn
    ]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_kept_fp8_greedy_is_the_same_with_cache_mtp_and_overlap_on_and_off(checkpoints, layout):
    fp8_dir, _ = checkpoints(layout)
    llm = make_llm(
        fp8_dir,
        fp8_weights=True,
        spec={"method": "mtp", "num_draft_tokens": 2},
        scheduler={"overlap": True},
        debug={"check_invariants": True},
    )
    llm.engine.raise_on_violation = True
    llm_kept = fp8_modules(llm)
    assert any(".self_attn." in n for n in llm_kept) and any(".linear_attn." in n for n in llm_kept)
    ps = prompts(llm.engine.vocab_size)
    got = [greedy_tokens(llm, ps, P) for _ in range(2)]
    plain = make_llm(fp8_dir, fp8_weights=True, cache={"enable_prefix_cache": False}, scheduler={"overlap": False})
    assert got[0] == got[1] == greedy_tokens(plain, ps, P)
    stats = llm.stats()
    assert stats["hybridserve_prefix_hit_tokens_total"] > 0 and stats["hybridserve_spec_draft_tokens_total"] > 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_kept_projections_hold_the_checkpoint_and_multiply_within_fp8s_rounding(checkpoints, layout):
    """Each kept projection's weight and scale dequantize to the fp32 twin's weight exactly;
    its product with FP8 activations stays within a few percent of the dequantized one (the
    random tiny model's near-flat logits would turn that into large logprob moves, so the
    bound is checked where it holds, per projection)."""
    from kernels.fp8.reference import dequantize_weight

    fp8_dir, ref_dir = checkpoints(layout)
    kept, ref = make_llm(fp8_dir, fp8_weights=True), make_llm(ref_dir)
    twins = dict(ref.engine.model.named_modules())
    names = fp8_modules(kept)
    for name, module in kept.engine.model.named_modules():
        if name not in names:
            continue
        twin = twins[name]
        assert torch.equal(dequantize_weight(module.weight, module.weight_scale, module.fp8_block), twin.weight)
        x = torch.randn(5, module.weight.shape[1], generator=torch.Generator().manual_seed(len(name)))
        want = twin(x)
        assert (module(x) - want).abs().max() <= 0.05 * want.abs().max()
    held = sum(m.weight.numel() for n, m in kept.engine.model.named_modules() if n in names)
    assert held > 0 and all(twins[n].weight.element_size() == 4 for n in names)  # 1 byte a weight, not 4


def test_fp8_weights_are_refused_where_they_cannot_apply(tiny_checkpoint, checkpoints):
    with pytest.raises(ValueError, match="fp8_weights: true needs an FP8 checkpoint"):
        make_llm(tiny_checkpoint("qwen3_next"), fp8_weights=True)
    from configs.schema import load_config

    with pytest.raises(ValueError, match="fp8_weights needs parallel.tensor_parallel_size=1"):
        load_config(overrides={"fp8_weights": True, "parallel": {"tensor_parallel_size": 2}})

"""TP = 2 on a block-wise FP8 checkpoint equals TP = 1 (greedy, prefix cache, MTP, overlap).

Weights are dequantized as they load, before ``shard_model`` narrows them, so a 32 x 32 block
may straddle two ranks (the experts' 32 intermediate rows split 16 / 16): no block is ever
sharded in FP8, and none needs refusing.
"""

from __future__ import annotations

from tests.workers.engine.helpers import make_llm
from tests.workers.tp.test_local_engine import GREEDY, SPEC, prompts_with_shared_prefix, reference
from tools.quantize import quantize_checkpoint


def test_tp2_equals_tp1_on_a_block_fp8_checkpoint(tiny_qwen_dir, tmp_path):
    fp8 = tmp_path / "fp8"
    quantize_checkpoint(tiny_qwen_dir, fp8, "block", block=(32, 32))
    expected = reference(fp8)
    options = {"spec": SPEC, "debug": {"check_invariants": True}}
    llm = make_llm(fp8, parallel={"tensor_parallel_size": 2}, **options)
    llm.engine.raise_on_violation = True
    prompts = prompts_with_shared_prefix()
    try:
        for _ in range(2):  # the second pass hits the cache
            assert [o.token_ids for o in llm.generate_ids(prompts, [GREEDY] * len(prompts))] == expected
        stats = llm.stats()
        assert stats["hybridserve_prefix_hit_tokens_total"] > 0
        assert stats["hybridserve_spec_draft_tokens_total"] > 0
    finally:
        llm.shutdown()

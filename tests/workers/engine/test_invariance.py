"""Greedy output must not depend on how the engine slices the work."""

from __future__ import annotations

import random

import pytest

from tests.workers.engine.helpers import greedy_tokens, make_llm, random_prompts

LENGTHS = [5, 17, 33, 9, 26, 12, 40, 3]


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    llm = make_llm(tiny_model_dir, scheduler={"chunked_prefill_size": 512})
    prompts = random_prompts(llm.engine.vocab_size, LENGTHS)
    return prompts, greedy_tokens(llm, prompts)


@pytest.mark.core_families(all_families_for={"chunk": 7})
@pytest.mark.parametrize("chunk", [1, 7, 16, 4096])
def test_chunked_prefill_invariance(tiny_model_dir, reference, chunk):
    prompts, expected = reference
    llm = make_llm(tiny_model_dir, scheduler={"chunked_prefill_size": chunk, "max_batch_tokens": max(chunk, 64)})
    assert greedy_tokens(llm, prompts) == expected


@pytest.mark.core_families
def test_batch_size_and_position_invariance(tiny_model_dir, reference):
    prompts, expected = reference
    llm = make_llm(tiny_model_dir)
    rng = random.Random(1)
    target, target_out = prompts[1], expected[1]
    for batch_size in range(1, 9):
        others = [p for i, p in enumerate(prompts) if i != 1][: batch_size - 1]
        pos = rng.randrange(batch_size)
        batch = others[:pos] + [target] + others[pos:]
        assert greedy_tokens(llm, batch)[pos] == target_out, (batch_size, pos)


def test_preemption_by_recompute_is_invisible(tiny_model_dir, reference):
    prompts, expected = reference
    # 40 usable KV tokens per... a pool far too small for 8 requests of up to 72 tokens.
    llm = make_llm(tiny_model_dir, cache={"page_size": 4, "max_kv_tokens": 96})
    assert greedy_tokens(llm, prompts) == expected
    assert llm.stats()["hybridserve_preemptions_total"] > 0
    engine = llm.engine
    engine.flush_cache()
    assert engine.page_allocator.num_free == engine.page_allocator.num_usable
    assert engine.slot_ledger.num_free == engine.slot_ledger.num_usable

"""Pools sized from a memory budget (``workers.sizing``): the slots first, the KV pool whole
pages of the rest; a model whose weights leave more memory gets more KV; refusals name the
budget's source and the bytes."""

from __future__ import annotations

import logging

import pytest
import torch

from configs.schema import load_config
from workers.sizing import MemoryBudget, device_budget, fraction_budget, plan_pools
from workers.state_spec import CacheSpec, StateGroup, attention_kind, conv_ssm_kind

HYBRID = CacheSpec((StateGroup(conv_ssm_kind("gdn", 8, 4, (2, 4, 4)), 3), StateGroup(attention_kind(2, 8), 2)))
MAMBA_ONLY = CacheSpec((StateGroup(conv_ssm_kind("mamba2", 8, 4, (2, 4, 4)), 2),))
CPU = torch.device("cpu")


def budgeted(pool_bytes: int, spec: CacheSpec = HYBRID, scratch: int = 0, **cache):
    config = load_config(overrides={"cache": {"kv_cache_memory_bytes": pool_bytes, **cache}})
    budget = device_budget(config.cache, CPU)
    assert budget == MemoryBudget(pool_bytes, f"cache.kv_cache_memory_bytes={pool_bytes}")
    return plan_pools(config, spec, 1 << 20, budget=budget, scratch_slots=scratch)


@pytest.mark.parametrize("scratch", [0, 40])
def test_the_kv_pool_takes_whole_pages_of_what_the_slots_leave(scratch: int) -> None:
    budget = 3_000_000
    sizes = budgeted(budget, scratch=scratch)
    slot_bytes = (sizes.num_slots + scratch) * sizes.bytes_per_slot
    page_bytes = 16 * sizes.bytes_per_token
    assert sizes.num_slots == plan_pools(load_config(), HYBRID, 1 << 20).num_slots  # as without a budget
    assert slot_bytes + sizes.kv_bytes <= budget < slot_bytes + sizes.kv_bytes + page_bytes
    assert sizes.max_model_len == (sizes.num_pages - 1) * 16


def test_fewer_bytes_in_use_after_loading_give_more_kv() -> None:
    """What an FP8 checkpoint kept in FP8 frees (half the weight bytes) goes to the KV pool."""
    total = 80 << 30
    bf16, fp8 = fraction_budget(0.85, total, 16 << 30), fraction_budget(0.85, total, 8 << 30)
    assert fp8.pool_bytes - bf16.pool_bytes == 8 << 30
    config = load_config()
    small, large = (plan_pools(config, HYBRID, 1 << 30, budget=b) for b in (bf16, fp8))
    assert large.num_pages > small.num_pages and large.num_slots == small.num_slots
    assert "cache.memory_fraction=0.85 of 85899345920 device bytes, less 8589934592 in use" in fp8.source


def test_budgets_that_cannot_hold_the_pools_are_refused_with_the_bytes_named() -> None:
    with pytest.raises(ValueError, match=r"cache.kv_cache_memory_bytes=1000 leaves no KV page: 1000 bytes"):
        budgeted(1000)
    with pytest.raises(ValueError, match=r"memory_fraction=0.5 of 100 device bytes, less 60 .* leaves nothing"):
        fraction_budget(0.5, 100, 60)
    with pytest.raises(ValueError, match=r"both size the KV pool: set one"):
        load_config(overrides={"cache": {"kv_cache_memory_bytes": 10**6, "max_kv_tokens": 64}})


def test_explicit_counts_win_and_a_cpu_without_a_budget_keeps_the_defaults() -> None:
    config = load_config(overrides={"cache": {"max_kv_tokens": 640}})
    assert device_budget(config.cache, CPU) is None
    assert plan_pools(config, HYBRID, 1 << 20).num_pages == 41
    assert device_budget(load_config().cache, CPU) is None  # CPU: default counts


def test_a_model_without_paged_state_spends_the_budget_on_slots() -> None:
    sizes = budgeted(1_000_000, MAMBA_ONLY, scratch=8)
    assert (sizes.num_slots + 8) * sizes.bytes_per_slot <= 1_000_000 < (sizes.num_slots + 9) * sizes.bytes_per_slot
    assert sizes.kv_bytes == 0
    with pytest.raises(ValueError, match=r"holds no recurrent slot"):
        budgeted(100, MAMBA_ONLY)


def test_an_engine_sized_by_bytes_stays_within_them_and_logs_its_pools(tiny_checkpoint, caplog) -> None:
    """Qwen3-Next with MTP: the head's KV layers and the verify scratch slots are paid from
    the same budget; the pools' real tensors fit it."""
    from tests.workers.engine.helpers import GREEDY, greedy_tokens, make_llm, random_prompts

    budget = 3_000_000
    with caplog.at_level(logging.INFO, logger="workers.engine"):
        llm = make_llm(
            tiny_checkpoint("qwen3_next"),
            cache={"kv_cache_memory_bytes": budget, "max_kv_tokens": None},
            spec={"method": "mtp", "num_draft_tokens": 2},
            scheduler={"max_running_requests": 8},
        )
    pools = llm.engine.pools
    used = sum(t.numel() * t.element_size() for t in [*pools.kv.tensors(), *pools.mamba.tensors()])
    page_bytes = llm.engine.config.cache.page_size * llm.engine.pool_sizes.bytes_per_token
    assert budget - page_bytes < used <= budget
    assert any("sized from cache.kv_cache_memory_bytes=3000000" in r.message for r in caplog.records)
    prompts = random_prompts(llm.engine.vocab_size, [5, 40, 17])
    assert all(len(t) == GREEDY.max_tokens for t in greedy_tokens(llm, prompts))

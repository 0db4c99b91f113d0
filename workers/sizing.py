"""Pool sizes from the config, the model's state description (``CacheSpec``) and a memory
budget.

Counts come from the config (``cache.max_kv_tokens``, ``cache.max_mamba_slots``); bytes from
the description alone, so a model of any kinds of state is sized the same way. Where the KV
count is null, a ``MemoryBudget`` sizes the pools (``device_budget``: bytes the config gives,
or on CUDA a fraction of the device less what loading left in use, so a model whose weights
take fewer bytes gets more KV): the recurrent slots first (their count follows the
scheduler), then the KV pool takes whole pages of what is left. Without a budget (a CPU
with neither set) the KV pool gets a default count. A model with no paged state (pure
Mamba2) has no KV tensors, but the radix tree still keys its nodes by page ids: it gets
page bookkeeping only, with a larger default page count (ids cost no device memory), and a
budget sizes its slots instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from configs.schema import CacheConfig, HybridServeConfig
from workers.state_spec import CacheSpec

# Default budgets when the config leaves sizes open (null).
_DEFAULT_KV_TOKENS = 32768
_DEFAULT_BOOKKEEPING_TOKENS = 8 * _DEFAULT_KV_TOKENS  # no paged state: page ids only
_SLOTS_PER_REQUEST = {"no_buffer": 1, "extra_buffer": 3, "extra_buffer_lazy": 2}


@dataclass(frozen=True)
class PoolSizes:
    num_pages: int  # including the dummy page 0
    num_slots: int  # including the dummy slot 0
    max_model_len: int
    bytes_per_token: int = 0  # KV bytes of one token over every paged layer
    bytes_per_slot: int = 0  # bytes of one slot over every recurrent layer
    kv_bytes: int = 0  # the KV pool (0 without paged state)
    slot_bytes: int = 0  # the slot pool (speculation scratch slots not included)


class MemoryBudget(NamedTuple):
    """Bytes the device pools may take (KV pages, recurrent slots, speculation scratch), and
    where that figure came from (named in the startup log and in refusals)."""

    pool_bytes: int
    source: str


def device_budget(cache: CacheConfig, device: torch.device) -> MemoryBudget | None:
    """The pools' budget when ``cache.max_kv_tokens`` is null (see the module docstring);
    None: default counts. Call it after the weights are loaded: on CUDA what is in use then
    (weights, the CUDA context, other processes) comes off the fraction."""
    if cache.max_kv_tokens is not None:
        return None
    if cache.kv_cache_memory_bytes is not None:
        return MemoryBudget(cache.kv_cache_memory_bytes, f"cache.kv_cache_memory_bytes={cache.kv_cache_memory_bytes}")
    if device.type != "cuda":
        return None
    torch.cuda.empty_cache()  # blocks the allocator caches are free for the pools
    free, total = torch.cuda.mem_get_info(device)
    return fraction_budget(cache.memory_fraction, total, total - free)


def fraction_budget(fraction: float, total: int, in_use: int) -> MemoryBudget:
    source = f"cache.memory_fraction={fraction} of {total} device bytes, less {in_use} in use after loading"
    pool_bytes = int(fraction * total) - in_use
    if pool_bytes <= 0:
        raise ValueError(f"{source} leaves nothing for the pools: raise it, or set cache.max_kv_tokens")
    return MemoryBudget(pool_bytes, source)


def plan_pools(
    config: HybridServeConfig,
    spec: CacheSpec,
    model_max_len: int,
    dtype: torch.dtype = torch.float32,
    budget: MemoryBudget | None = None,
    scratch_slots: int = 0,
) -> PoolSizes:
    """``spec``: every paged layer the pools hold (the MTP head's included); ``scratch_slots``:
    speculation scratch slots beside the ledger's, which the budget pays for too."""
    page_size = config.cache.page_size
    per_token, per_slot = spec.bytes_per_token(dtype), spec.bytes_per_slot(dtype)
    usable_slots = _usable_slots(config, spec, budget, per_slot, scratch_slots)
    num_slots = usable_slots + 1
    kv_tokens = _kv_tokens(config, spec, budget, per_token, (num_slots + scratch_slots) * per_slot)
    usable_pages = max(kv_tokens // page_size, 1)
    max_model_len = _max_model_len(config.max_model_len, model_max_len, usable_pages * page_size)
    num_pages = usable_pages + 1
    return PoolSizes(
        num_pages,
        num_slots,
        max_model_len,
        per_token,
        per_slot,
        num_pages * page_size * per_token,
        num_slots * per_slot,
    )


def _usable_slots(
    config: HybridServeConfig, spec: CacheSpec, budget: MemoryBudget | None, per_slot: int, scratch_slots: int
) -> int:
    if config.cache.max_mamba_slots is not None:
        return config.cache.max_mamba_slots
    if budget is not None and not spec.has_paged_state and per_slot:
        usable = budget.pool_bytes // per_slot - 1 - scratch_slots  # slot 0 is the dummy
        if usable < 1:
            raise ValueError(
                f"{budget.source} holds no recurrent slot: {budget.pool_bytes} bytes for slots of {per_slot} "
                f"bytes, {scratch_slots} of them speculation scratch"
            )
        return usable
    per_req = _SLOTS_PER_REQUEST[config.cache.mamba_strategy] if config.cache.enable_prefix_cache else 1
    # Room for every running request plus as many again for cached checkpoints.
    return 2 * per_req * config.scheduler.max_running_requests


def _kv_tokens(
    config: HybridServeConfig, spec: CacheSpec, budget: MemoryBudget | None, per_token: int, slot_bytes: int
) -> int:
    """Usable KV tokens: the config's, what the budget leaves after ``slot_bytes`` (whole
    pages, past the dummy page 0), or the default."""
    if config.cache.max_kv_tokens is not None:
        return config.cache.max_kv_tokens
    if not spec.has_paged_state:
        return _DEFAULT_BOOKKEEPING_TOKENS
    if budget is None:
        return _DEFAULT_KV_TOKENS
    page_bytes = config.cache.page_size * per_token
    pages = (budget.pool_bytes - slot_bytes) // page_bytes - 1
    if pages < 1:
        raise ValueError(
            f"{budget.source} leaves no KV page: {budget.pool_bytes} bytes, of which the recurrent slots take "
            f"{slot_bytes} and a page of {config.cache.page_size} tokens {page_bytes}; raise it, or lower "
            "cache.max_mamba_slots / scheduler.max_running_requests"
        )
    return pages * config.cache.page_size


def _max_model_len(wanted: int | None, model_max_len: int, pool_tokens: int) -> int:
    """The config's ``max_model_len`` (vLLM's), which must fit the model's positions and the
    KV pool; when it is null, the smaller of those two."""
    bound = min(model_max_len, pool_tokens)
    if wanted is None:
        return bound
    if wanted > bound:
        raise ValueError(
            f"max_model_len={wanted} exceeds what the model ({model_max_len} positions) and "
            f"the KV pool ({pool_tokens} tokens, cache.max_kv_tokens) allow"
        )
    return wanted


def describe_pools(sizes: PoolSizes, page_size: int, scratch_slots: int, budget: MemoryBudget | None) -> str:
    """The startup line about the pools."""
    source = budget.source if budget is not None else "the config's counts"
    scratch_bytes = scratch_slots * sizes.bytes_per_slot
    return (
        f"pools: {(sizes.num_pages - 1) * page_size} KV tokens ({sizes.kv_bytes} bytes, {sizes.bytes_per_token} "
        f"a token), {sizes.num_slots - 1} recurrent slots + {scratch_slots} scratch "
        f"({sizes.slot_bytes + scratch_bytes} bytes), sized from {source}"
    )

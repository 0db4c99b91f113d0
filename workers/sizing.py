"""Pool sizes from the config and the model's state description (``CacheSpec``).

Counts come from the config (``cache.max_kv_tokens``, ``cache.max_mamba_slots``) or, when
those are null, from defaults; bytes come from the description alone, so a model of any
kinds of state is sized the same way. A model with no paged state (pure Mamba2) has no KV
tensors, but the radix tree still keys its nodes by page ids: it gets page bookkeeping
only, with a larger default page count (ids cost no device memory).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from configs.schema import HybridServeConfig
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


def plan_pools(
    config: HybridServeConfig, spec: CacheSpec, model_max_len: int, dtype: torch.dtype = torch.float32
) -> PoolSizes:
    page_size = config.cache.page_size
    default_tokens = _DEFAULT_KV_TOKENS if spec.has_paged_state else _DEFAULT_BOOKKEEPING_TOKENS
    kv_tokens = config.cache.max_kv_tokens or default_tokens
    usable_pages = max(kv_tokens // page_size, 1)
    if config.cache.max_mamba_slots is not None:
        usable_slots = config.cache.max_mamba_slots
    else:
        per_req = _SLOTS_PER_REQUEST[config.cache.mamba_strategy] if config.cache.enable_prefix_cache else 1
        # Room for every running request plus as many again for cached checkpoints.
        usable_slots = 2 * per_req * config.scheduler.max_running_requests
    max_model_len = _max_model_len(config.max_model_len, model_max_len, usable_pages * page_size)
    per_token, per_slot = spec.bytes_per_token(dtype), spec.bytes_per_slot(dtype)
    num_pages, num_slots = usable_pages + 1, usable_slots + 1
    return PoolSizes(
        num_pages,
        num_slots,
        max_model_len,
        per_token,
        per_slot,
        num_pages * page_size * per_token,
        num_slots * per_slot,
    )


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

"""Pool sizes from the config and the model's cache spec."""
from __future__ import annotations

from dataclasses import dataclass

from configs.schema import HybridServeConfig
from workers.device_pools import CacheSpec

# Default budgets when the config leaves sizes open (null).
_DEFAULT_KV_TOKENS = 32768
_SLOTS_PER_REQUEST = {"no_buffer": 1, "extra_buffer": 3, "extra_buffer_lazy": 2}


@dataclass(frozen=True)
class PoolSizes:
    num_pages: int        # including the dummy page 0
    num_slots: int        # including the dummy slot 0
    max_model_len: int


def plan_pools(config: HybridServeConfig, spec: CacheSpec, model_max_len: int) -> PoolSizes:
    page_size = config.cache.page_size
    kv_tokens = config.cache.max_kv_tokens or _DEFAULT_KV_TOKENS
    usable_pages = max(kv_tokens // page_size, 1)
    if config.cache.max_mamba_slots is not None:
        usable_slots = config.cache.max_mamba_slots
    else:
        per_req = _SLOTS_PER_REQUEST[config.cache.mamba_strategy] if config.cache.enable_prefix_cache else 1
        # Room for every running request plus as many again for cached checkpoints.
        usable_slots = 2 * per_req * config.scheduler.max_running_requests
    max_model_len = min(model_max_len, usable_pages * page_size)
    return PoolSizes(usable_pages + 1, usable_slots + 1, max_model_len)

"""The engine's side of the cluster store and its pool gauges (``Engine`` inherits them).

The store (``cluster/store``) calls these on the engine thread: what depth of a prompt this
engine holds, a fetched checkpoint placed in the host tier, the host tier's demotions to
publish. ``pool_counts`` and the gauges read the pools for health checks and metrics.
"""

from __future__ import annotations

from workers.cache.allocators import IdAllocator
from workers.cache.ledger import SlotLedger
from workers.cache.manager import CacheManager
from workers.scheduler import Scheduler
from workers.stats import EngineStats
from workers.tiers.payload import CheckpointPayload


class StoreEndpoints:
    """Mixed into ``Engine``, which sets these attributes."""

    cache: CacheManager
    scheduler: Scheduler
    stats: EngineStats
    page_allocator: IdAllocator
    slot_ledger: SlotLedger
    fingerprint: str
    _gauge_steps: int

    def local_depth(self, token_ids: list[int]) -> int:
        """The deepest checkpoint this engine holds (device or host) usable for a prompt."""
        usable = token_ids[: len(token_ids) - 1]
        tree, host = self.cache.tree, self.cache.host
        device = tree.peek(usable).depth if tree is not None else 0
        return max(device, host.peek(usable).depth if host is not None else 0)

    def import_checkpoint(self, payload: CheckpointPayload, expected_hash: bytes | None = None) -> str:
        """Validate a checkpoint fetched from the store and place it in the host tier, where
        admission promotes it: ``imported``, ``present``, ``host_full`` or ``invalid``."""
        host = self.cache.host
        if host is None:
            raise ValueError("import_checkpoint needs the host tier (cache.host_mamba_slots > 0)")
        if expected_hash is not None and getattr(payload, "prefix_hash", None) != expected_hash:
            return "invalid"
        return host.import_payload(payload, self.fingerprint)

    def export_prompt(self, token_ids: list[int]) -> CheckpointPayload | None:
        """The deepest checkpoint usable for ``token_ids`` (as ``local_depth`` finds it) with
        the KV of its path, copied for a prefill/decode hand-off; a device checkpoint is first
        copied into the host tier. None without a host tier or a checkpoint."""
        host, tree = self.cache.host, self.cache.tree
        if host is None:
            return None
        usable = token_ids[: len(token_ids) - 1]
        hit = host.peek(usable)
        device = tree.peek(usable) if tree is not None else None
        if device is not None and device.checkpoint is not None and device.depth > hit.depth:
            if host.demote(tree, device.node, evicting=False) in ("copied", "present"):
                hit = host.peek(usable)
        if hit.checkpoint is None:
            return None
        return host.export(usable[: hit.depth], self.fingerprint)

    def export_store_commits(self) -> list[CheckpointPayload]:
        """Copies of the checkpoints demoted since the last call that the host still holds."""
        host = self.cache.host
        if host is None:
            return []
        out = [host.export(tokens, self.fingerprint) for tokens in host.take_commits()]
        return [p for p in out if p is not None]

    def pool_counts(self) -> dict[str, int]:
        tree, host = self.cache.tree, self.cache.host
        counts = {
            "kv_pages_free": self.page_allocator.num_free,
            "kv_pages_usable": self.page_allocator.num_usable,
            "kv_pages_cached": tree.num_cached_pages if tree else 0,
            "mamba_slots_free": self.slot_ledger.num_free,
            "mamba_slots_usable": self.slot_ledger.num_usable,
            "mamba_slots_cached": self.slot_ledger.num_tree_owned,
        }
        if host is not None:
            counts.update(
                host_pages_free=host.pages.num_free,
                host_pages_usable=host.pages.num_usable,
                host_slots_free=host.ledger.num_free,
                host_slots_usable=host.ledger.num_usable,
            )
        return counts

    def _update_gauges(self) -> None:
        g = self.stats.gauges
        g["hybridserve_num_running_requests"] = len(self.scheduler.running)
        g["hybridserve_num_waiting_requests"] = len(self.scheduler.waiting)
        g["hybridserve_kv_pool_usage_ratio"] = self.page_allocator.usage_ratio()
        g["hybridserve_mamba_pool_usage_ratio"] = self.slot_ledger.usage_ratio()
        host = self.cache.host
        if host is not None:
            g["hybridserve_host_mamba_slots_used"] = host.ledger.num_tree_owned
            g["hybridserve_host_kv_tokens_used"] = host.tree.num_cached_pages * host.page_size
            self._gauge_steps += 1
            if self._gauge_steps % 16 == 1:  # a walk of the host tree: not every step
                g["hybridserve_host_kv_dead_tokens"] = host.dead_tokens()

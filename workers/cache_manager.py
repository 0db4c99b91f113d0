"""Pools and the prefix cache as the scheduler sees them: admission, pages, release.

One object owns the KV page free list, the Mamba slot ledger and (when
``cache.enable_prefix_cache``) the hybrid radix cache. Pure bookkeeping, no tensors.

Rules held here (checked by ``check_invariants``):
- Conservation: free pages + tree pages + every request's own pages + pages waiting for
  a deferred free == usable pages; the ledger accounts for every slot (I2).
- A running request owns exactly one live slot (mandatory); every other slot it holds is
  optional and its absence only skips a checkpoint (DESIGN §4 rule 4).
- A request's tree prefix ``page_ids[:num_tree_pages]`` is protected by its lock.
- Pages are freed only when no launched, unprocessed batch can read them: frees made
  while batches are in flight wait until those batches complete.
"""
from __future__ import annotations

import random
from collections.abc import Sequence

from configs.schema import CacheConfig, DebugConfig
from workers.allocators import IdAllocator
from workers.cache import CacheEvent, RadixCache, RequestOwner, SlotLedger, SlotRole, Violation
from workers.checkpoints import CheckpointTracker, StepPlan
from workers.request import Request, RequestCacheState
from workers.scheduler_types import ScheduledBatch
from workers.stats import EngineStats


class CacheManager:
    def __init__(self, cache: CacheConfig, debug: DebugConfig, num_pages: int, num_slots: int,
                 stats: EngineStats, seed: int = 0) -> None:
        self.config = cache
        self.page_size = cache.page_size
        self.stats = stats
        self.pages = IdAllocator(num_pages, "KV page")
        self.ledger = SlotLedger(num_slots, guard_writers=not debug.disable_alias_guard)
        self.events: list[CacheEvent] = []
        self.tree: RadixCache | None = None
        if cache.enable_prefix_cache:
            self.tree = RadixCache(self.page_size, self.pages, self.ledger, on_event=self._on_event)
        self.tracker = CheckpointTracker(self, cache, debug, random.Random(seed))
        self._deferred_pages: list[tuple[int, list[int]]] = []   # (free after batch id, pages)
        self._deferred_releases: list[tuple[Request, bool]] = []  # (request, finished)
        self._inflight: set[int] = set()

    # -- events, sizes ----------------------------------------------------------------------
    def _on_event(self, event: CacheEvent) -> None:
        from workers.cache import CheckpointEvicted

        if isinstance(event, CheckpointEvicted):
            self.stats.inc("hybridserve_mamba_checkpoints_evicted_total")
        self.events.append(event)

    def drain_events(self) -> list[CacheEvent]:
        events, self.events = self.events, []
        return events

    # -- pages ------------------------------------------------------------------------------
    def can_alloc_pages(self, n: int) -> bool:
        if self.pages.can_alloc(n):
            return True
        return self.tree is not None and self.pages.num_free + self.tree.num_evictable_pages >= n

    def alloc_pages(self, n: int) -> list[int] | None:
        if n == 0:
            return []
        return self.tree.alloc_pages(n) if self.tree is not None else self.pages.alloc(n)

    def free_pages(self, page_ids: Sequence[int]) -> None:
        """Free now, or after the newest in-flight batch completes if any batch is in flight."""
        if not page_ids:
            return
        if self._inflight:
            self._deferred_pages.append((max(self._inflight), list(page_ids)))
        else:
            self.pages.free(list(page_ids))

    # -- admission ----------------------------------------------------------------------------
    def admit(self, req: Request) -> bool:
        """Give a waiting request its live slot and, on a prefix hit, the cached prefix.

        Atomic: on False nothing is held. Track slots are optional (may stay None).
        """
        match = None
        if self.tree is not None and not req.page_ids and req.num_tokens > 1:
            match = self.tree.match(req.all_token_ids[: req.num_tokens - 1])
            if match.depth > 0:
                self.tree.lock(match.node)
        live = self._alloc_slot(RequestOwner(req.request_id, SlotRole.LIVE), evict=True)
        if live is None:
            if match is not None and match.depth > 0:
                self.tree.unlock(match.node)  # type: ignore[union-attr]
            return False
        req.mamba_slot = live
        req.cache = RequestCacheState()
        if match is not None:
            self._record_lookup(req, match)
        self.tracker.on_admit(req, match.kv_depth if match is not None else 0)
        return True

    def _record_lookup(self, req: Request, match) -> None:
        if not req.lookup_counted:
            req.lookup_counted = True
            self.stats.inc("hybridserve_prefix_query_tokens_total", req.num_prompt_tokens)
            self.stats.inc("hybridserve_prefix_hit_tokens_total", match.depth)
            req.num_cached_tokens = match.depth
        if match.depth > 0:
            req.page_ids = list(match.page_ids)
            req.num_computed_tokens = match.depth
            req.cache.num_tree_pages = len(match.page_ids)
            req.cache.locked_node = match.node
            req.cache.cow_src = match.checkpoint.slot

    def _alloc_slot(self, owner: RequestOwner, evict: bool) -> int | None:
        if evict and self.tree is not None:
            return self.tree.alloc_slot_evicting(owner)
        return self.ledger.alloc(owner)

    # -- steps ----------------------------------------------------------------------------------
    def plan_step(self, batch: ScheduledBatch) -> StepPlan:
        """Called right before launch: copy-on-write sources, track writes, pending writers."""
        plan = self.tracker.plan(batch)
        for slot in plan.written_slots():
            self.ledger.add_writer(slot, batch.batch_id)
        self._inflight.add(batch.batch_id)
        return plan

    def complete_step(self, batch: ScheduledBatch, plan: StepPlan,
                      rows_committed: dict[int, int] | None = None) -> None:
        """The batch's result is in: writers cleared, labels updated (no donation yet)."""
        self.ledger.complete_batch(batch.batch_id)
        self._inflight.discard(batch.batch_id)
        self.tracker.on_complete(plan, rows_committed or {})
        pending, self._deferred_releases = self._deferred_releases, []
        for req, finished in pending:
            self.release(req, finished, deferred=True)
        self._release_deferred()

    def donate_unfinished(self, batch: ScheduledBatch) -> None:
        for seq in batch.seqs:
            if not seq.request.is_finished:
                self.tracker.donate(seq.request, finished=False)

    def _release_deferred(self) -> None:
        oldest = min(self._inflight, default=None)
        keep = []
        for after, pages in self._deferred_pages:
            if oldest is None or after < oldest:
                self.pages.free(pages)
            else:
                keep.append((after, pages))
        self._deferred_pages = keep

    # -- release ----------------------------------------------------------------------------------
    def release(self, req: Request, finished: bool, deferred: bool = False) -> None:
        """Return a request's resources; a normal finish first publishes its checkpoint.

        A request that a launched, unprocessed batch still writes (the overlap lag) is
        released when that batch completes: its slots may not change owner before (I3).
        """
        if any(self.ledger.has_writers(s) for s in self.ledger.slots_of(req.request_id)):
            self._deferred_releases.append((req, finished))
            return
        if finished and self.tree is not None:
            # After a deferred release the live slot holds what a discarded batch wrote.
            self.tracker.donate(req, finished=True, live_is_exact=not deferred)
        self.free_pages(req.page_ids[req.cache.num_tree_pages:])
        req.page_ids = []
        self.ledger.free_request(req.request_id)
        req.mamba_slot = None
        if req.cache.locked_node is not None:
            self.tree.unlock(req.cache.locked_node)  # type: ignore[union-attr, arg-type]
        req.cache = RequestCacheState()

    def flush(self) -> int:
        """Drop every unlocked cached prefix; returns the number of checkpoints freed."""
        if self.tree is None:
            return 0
        return self.tree.flush().num_checkpoints

    # -- checks ----------------------------------------------------------------------------------
    def check_invariants(self, running: Sequence[Request]) -> list[Violation]:
        out = list(self.ledger.check())
        if self.tree is not None:
            out += [v for v in self.tree.check_invariants() if v.invariant not in ("I2",) or v not in out]
        held = list(running) + [r for r, _ in self._deferred_releases]
        own = sum(len(r.page_ids) - r.cache.num_tree_pages for r in held)
        tree_pages = self.tree.num_cached_pages if self.tree is not None else 0
        deferred = sum(len(p) for _, p in self._deferred_pages)
        if self.pages.num_free + tree_pages + own + deferred != self.pages.num_usable:
            out.append(Violation("I2", f"KV pages: free {self.pages.num_free} + tree {tree_pages} + "
                                       f"requests {own} + deferred {deferred} != {self.pages.num_usable}"))
        for r in running:
            roles = self.ledger.slots_of(r.request_id)
            if list(roles.values()).count(SlotRole.LIVE) != 1 or roles.get(r.mamba_slot) is not SlotRole.LIVE:
                out.append(Violation("I2", f"request {r.request_id}: live slot {r.mamba_slot}, ledger {roles}"))
        return out

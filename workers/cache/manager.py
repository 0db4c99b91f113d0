"""Pools and the prefix cache as the scheduler sees them: admission, pages, release.

One object owns the KV page free list, the Mamba slot ledger and (when
``cache.enable_prefix_cache``) the hybrid radix cache. Pure bookkeeping, no tensors.

Rules held here (checked by ``check_invariants``):
- Conservation: free pages + tree pages + every request's own pages + pages waiting for
  a deferred free == usable pages; the ledger accounts for every slot (I2).
- A running request owns exactly one live slot (mandatory); every other slot it holds is
  optional and its absence only skips a checkpoint (DESIGN §4 rule 4).
- A request's tree prefix ``page_ids[:num_tree_pages]`` is protected by its lock.
- Pages are freed only when no launched, unprocessed batch can read them: a request's own
  pages are read only by batches holding that request, so they wait for the newest such
  batch (``Request.inflight_batch``) and are freed at once when none is in flight.
- Labels (I4): the ledger's content records come from what the runner reports it wrote
  (``complete_step``); keep depths, tree checkpoints and live slots must agree with them.
- Liveness (DESIGN §4 rule 6): admission never waits on the checkpoint it matched: when
  the live slot can only be had by evicting it, the request is admitted without the hit.
- Tiers (``cache.host_mamba_slots``, ``workers/tiers``): a device checkpoint that eviction
  frees is first demoted into the host tier (``HostTier.demote``, a reader of its slot);
  a prompt whose deepest checkpoint is on the host is admitted with a promotion, a pending
  writer of its live and keep slots, and gets no work until the copy completes
  (``poll_transfers``, at the start of every step); a completed promotion publishes the
  checkpoint into the device tree through the ordinary donation. With the cluster store
  on, a device hit is also written through to the host tier (and so committed).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from configs.schema import CacheConfig, DebugConfig
from workers.cache import (
    CacheEvent,
    CheckpointEvicted,
    MatchResult,
    RadixCache,
    RequestOwner,
    SlotLedger,
    SlotRole,
    TreeNode,
    Violation,
)
from workers.cache.allocators import IdAllocator
from workers.cache.checkpoints import CheckpointTracker, StepPlan
from workers.cache.checks import check_pools
from workers.request import Request, RequestCacheState
from workers.scheduler_types import ScheduledBatch, StateWrite
from workers.stats import EngineStats
from workers.tiers.host_tier import HostTier
from workers.tiers.promotion import PendingPromotion, PromotionPlan, Promotions
from workers.tiers.write_policy import WritePolicy


class CacheManager:
    def __init__(
        self, cache: CacheConfig, debug: DebugConfig, num_pages: int, num_slots: int, stats: EngineStats, seed: int = 0
    ) -> None:
        self.config = cache
        self.page_size = cache.page_size
        self.stats = stats
        self.pages = IdAllocator(num_pages, "KV page")
        self.ledger = SlotLedger(num_slots, guard_writers=not debug.disable_alias_guard)
        # None until a consumer asks (``record_events``: a replica's publisher, a bench): an
        # engine nobody drains (an offline ``LLM``) would hold every event of its life.
        self.events: list[CacheEvent] | None = None
        self.tree: RadixCache | None = None
        self.host: HostTier | None = None
        self.promotions: Promotions | None = None
        self.write_policy = WritePolicy(cache.store_write_policy, store_on=cache.cluster_store_bytes > 0)
        if cache.host_tier:
            self.host = HostTier(
                self.page_size,
                cache.host_kv_tokens // self.page_size + 1,
                cache.host_mamba_slots + 1,
                stats,
                on_event=self._on_event,
                fail_prob=debug.fail_transfer_prob,
                seed=seed,
                keep_commits=cache.cluster_store_bytes > 0,
            )
            self.promotions = Promotions(self.host, self.ledger)
        if cache.enable_prefix_cache:
            self.tree = RadixCache(
                self.page_size,
                self.pages,
                self.ledger,
                on_event=self._on_event,
                on_drop=self._demote if self.host is not None else None,
            )
        self.checks = debug.check_invariants
        self.label_violations: list[Violation] = []  # found while processing (checks on)
        self.record_published = debug.state_oracle_sample > 0
        self.published: list[tuple[int, list[int]]] = []  # (slot, path tokens), for the oracle
        self.tracker = CheckpointTracker(self, cache, debug, random.Random(seed))
        self._deferred_pages: list[tuple[int, list[int]]] = []  # (free after batch id, pages)
        self._deferred_releases: list[tuple[Request, bool]] = []  # (request, finished)
        self._inflight: set[int] = set()

    # -- events, sizes ----------------------------------------------------------------------
    def _on_event(self, event: CacheEvent) -> None:
        if isinstance(event, CheckpointEvicted) and event.tier == "device":
            self.stats.inc("hybridserve_mamba_checkpoints_evicted_total")
        if self.events is not None:
            self.events.append(event)

    def _demote(self, node: TreeNode) -> None:
        assert self.host is not None and self.tree is not None
        self.host.demote(self.tree, node)

    def record_events(self) -> None:
        """Keep cache events from now on, for ``drain_events``."""
        if self.events is None:
            self.events = []

    def drain_events(self) -> list[CacheEvent]:
        """The events since the last drain ([] while not recording)."""
        if self.events is None:
            return []
        events, self.events = self.events, []
        return events

    def report(self, invariant: str, message: str) -> None:
        """A label disagreed with a write while processing; kept for ``check_invariants``."""
        if self.checks:
            self.label_violations.append(Violation(invariant, message))

    def on_publish(self, slot: int, token_ids: list[int], phase: str) -> None:
        if self.record_published:
            self.published.append((slot, token_ids))
        if self.write_policy.on_publish(phase):
            self._copy_to_host(token_ids)

    def drain_published(self) -> list[tuple[int, list[int]]]:
        out, self.published = self.published, []
        return out

    # -- pages ------------------------------------------------------------------------------
    def alloc_pages(self, n: int) -> list[int] | None:
        if n == 0:
            return []
        return self.tree.alloc_pages(n) if self.tree is not None else self.pages.alloc(n)

    def free_pages(self, page_ids: Sequence[int], reader: int | None) -> None:
        """Free pages that batch ``reader`` (the newest that may read them) or older read.

        Now when that batch is not in flight, else once it completes.
        """
        if not page_ids:
            return
        if reader is not None and reader in self._inflight:
            self._deferred_pages.append((reader, list(page_ids)))
        else:
            self.pages.free(list(page_ids))

    def reader_of(self, req: Request) -> int | None:
        """The newest in-flight batch that reads ``req``'s own pages, if any."""
        batch = req.inflight_batch
        return batch if batch is not None and batch in self._inflight else None

    # -- admission ----------------------------------------------------------------------------
    def admit(self, req: Request) -> bool:
        """Give a waiting request its live slot and, on a prefix hit, the cached prefix.

        Atomic: on False nothing is held. Track slots are optional (may stay None). When
        the only way to a live slot is to evict the matched checkpoint itself (a tiny
        pool), the hit is dropped and the request recomputes its prefix.
        """
        match = self._match(req)
        if match is not None and match.depth > 0:
            self.tree.lock(match.node)  # type: ignore[union-attr]
        live = self.alloc_slot(RequestOwner(req.handle, SlotRole.LIVE), evict=True)
        if live is None and match is not None and match.depth > 0:
            self.tree.unlock(match.node)  # type: ignore[union-attr]
            match = match._replace(
                node=self.tree.root,
                depth=0,
                page_ids=[],  # type: ignore[union-attr]
                checkpoint=None,
            )
            live = self.alloc_slot(RequestOwner(req.handle, SlotRole.LIVE), evict=True)
        if live is None:
            return False
        req.mamba_slot = live
        req.page_epoch += 1  # its pages are set anew below
        req.cache = RequestCacheState()
        first_lookup = not req.lookup_counted
        promotion = self._plan_promotion(req, match)
        if promotion is None and match is not None and match.depth > 0:
            self._write_through(match)
        if match is not None:
            self._record_lookup(req, match, count_hit=promotion is None)
        resume = max(req.num_computed_tokens, promotion.depth if promotion is not None else 0)
        self.tracker.on_admit(req, match.kv_depth if match is not None else 0, resume)
        if promotion is not None:
            assert self.promotions is not None
            req.page_ids.extend(promotion.page_ids)
            if self.promotions.start(req, promotion, first_lookup).job.done():
                self.poll_transfers()  # a synchronous copy: the request runs this step
        return True

    def _write_through(self, match: MatchResult) -> None:
        """With the cluster store, a device checkpoint that is hit (a shared prefix, say) is
        also copied to the host tier, from where it is committed: other replicas can fetch it."""
        if self.write_policy.on_hit() and self.tree is not None:
            self._copy_to_host(self.tree.path_tokens(match.node))

    def _copy_to_host(self, token_ids: Sequence[int]) -> None:
        """Copy the device checkpoint of exactly ``token_ids`` to the host tier (for the store),
        unless the host already holds it; it stays on the device (``store_write_policy``)."""
        host, tree = self.host, self.tree
        if host is None or host.commits is None or tree is None:
            return
        hit = tree.peek(token_ids)
        if hit.checkpoint is not None and hit.depth == len(token_ids) and host.peek(token_ids).depth < hit.depth:
            host.demote(tree, hit.node, evicting=False)

    def _plan_promotion(self, req: Request, match: MatchResult | None) -> PromotionPlan | None:
        if self.promotions is None or match is None:
            return None
        return self.promotions.plan(req.all_token_ids[: req.max_cached_prefix], match, self.alloc_pages)

    def cached_depth(self, req: Request) -> int:
        """The deepest checkpoint (device or host tier) a waiting request could resume from
        if admitted now; read-only (no LRU order moves), for the scheduler's ``lpm`` policy."""
        limit = req.max_cached_prefix
        if self.tree is None or limit <= 0:
            return 0
        usable = req.all_token_ids[:limit]
        device = self.tree.peek(usable).depth
        return max(device, self.host.peek(usable).depth) if self.host is not None else device

    def _match(self, req: Request) -> MatchResult | None:
        limit = req.max_cached_prefix  # prompt logprobs still missing cap the hit
        if self.tree is None or req.page_ids or limit <= 0:
            return None
        return self.tree.match(req.all_token_ids[:limit])

    def _record_lookup(self, req: Request, match: MatchResult, count_hit: bool) -> None:
        """Count the first lookup (its hit now, or when its promotion completes)."""
        if not req.lookup_counted:
            req.lookup_counted = True
            self.stats.inc("hybridserve_prefix_query_tokens_total", req.num_prompt_tokens)
            if count_hit:
                self._count_hit(req, match.depth, "device")
        if match.depth > 0:
            assert match.checkpoint is not None
            req.page_ids = list(match.page_ids)
            req.num_computed_tokens = match.depth
            req.cache.num_tree_pages = len(match.page_ids)
            req.cache.locked_node = match.node
            req.cache.cow_src = match.checkpoint.slot

    def _count_hit(self, req: Request, depth: int, tier: str) -> None:
        self.stats.inc("hybridserve_prefix_hit_tokens_total", depth)
        req.num_cached_tokens = depth
        if depth > 0:
            self.stats.inc("hybridserve_cache_hits_total", label=tier)
            self.stats.inc("hybridserve_cache_hit_tokens_total", depth, label=tier)

    # -- transfers between tiers ---------------------------------------------------------------
    def has_transfers(self) -> bool:
        return self.promotions is not None and bool(self.promotions.pending)

    def poll_transfers(self, wait: bool = False) -> int:
        """Apply every finished promotion (waiting for the oldest when ``wait``); returns how many."""
        if self.promotions is None:
            return 0
        done = self.promotions.take_done(wait)
        for pending, ok in done:
            self._promoted(pending, ok)
        if done:
            self._retry_releases()
        return len(done)

    def _promoted(self, p: PendingPromotion, ok: bool) -> None:
        req, plan, host = p.request, p.plan, self.host
        assert host is not None and host.storage is not None
        self.stats.inc("hybridserve_tier_promotions_total", label="promoted" if ok else "failed")
        if ok:
            self.stats.inc(
                "hybridserve_tier_bytes_total",
                host.storage.nbytes(len(p.slots), len(plan.page_ids)),
                label="host_to_device",
            )
            host.from_store.discard(plan.host_node.node_id)
        if p.first_lookup:
            self._count_hit(req, plan.depth if ok else plan.from_depth, plan.origin if ok else "device")
        if not ok or req.mamba_slot is None or req.is_finished:
            return  # recomputes from its device hit / is released next
        c = req.cache
        req.num_computed_tokens = plan.depth
        c.cow_src = None  # the live slot holds H(depth) already
        c.targets = [t for t in c.targets if t > plan.depth]
        if c.keep_slot in p.slots:  # publish the promoted checkpoint on the device
            c.keep_depth, c.keep_phase, c.keep_batch = plan.depth, "prefill", plan.transfer_id
            self.tracker.donate(req, finished=False)

    def alloc_slot(self, owner: RequestOwner, evict: bool) -> int | None:
        if evict and self.tree is not None:
            return self.tree.alloc_slot_evicting(owner)
        return self.ledger.alloc(owner)

    # -- steps ----------------------------------------------------------------------------------
    def plan_step(self, batch: ScheduledBatch) -> StepPlan:
        """Called right before launch: copy-on-write sources, track writes, pending writers."""
        plan = self.tracker.plan(batch)
        if self.checks:
            self._check_cow(plan)
        self.ledger.add_writers(plan.written_slots(), batch.batch_id)
        self._inflight.add(batch.batch_id)
        return plan

    def _check_cow(self, plan: StepPlan) -> None:
        """I4 at a hit: the checkpoint copied into a live slot is the state at the seq's start."""
        starts = {s.request.mamba_slot: s.start for s in plan.batch.seqs}
        for src, dst in plan.cow:
            content = self.ledger.content_of(src)
            if content is None or content.depth != starts[dst]:
                self.report(
                    "I4",
                    f"copy of slot {src} ({content}) into live slot {dst} for a sequence starting at {starts[dst]}",
                )

    def complete_step(self, batch: ScheduledBatch, plan: StepPlan, writes: Sequence[StateWrite]) -> None:
        """The batch's result is in: contents recorded, writers cleared, labels updated (no
        donation yet)."""
        self.ledger.record_owned_writes(((w.slot, w.depth) for w in writes), batch.batch_id)
        self.ledger.complete_batch(batch.batch_id)
        self._inflight.discard(batch.batch_id)
        self.tracker.on_complete(plan, writes)
        self._retry_releases()

    def abandon_step(self, batch_id: int) -> None:
        """A launched batch failed: drop it as a writer without recording any content (its
        requests are ended by the caller; nothing it wrote is labelled or published)."""
        self.ledger.complete_batch(batch_id)
        self._inflight.discard(batch_id)
        self._retry_releases()

    def _retry_releases(self) -> None:
        pending, self._deferred_releases = self._deferred_releases, []
        for req, finished in pending:
            self.release(req, finished)
        self._release_deferred()

    def donate_unfinished(self, batch: ScheduledBatch) -> None:
        for seq in batch.seqs:
            req = seq.request
            if req.cache.keep_depth is not None and not req.is_finished:  # something to publish
                self.tracker.donate(req, finished=False)

    def _release_deferred(self) -> None:
        keep = []
        for after, pages in self._deferred_pages:
            if after in self._inflight:
                keep.append((after, pages))
            else:
                self.pages.free(pages)
        self._deferred_pages = keep

    # -- release ----------------------------------------------------------------------------------
    def release(self, req: Request, finished: bool) -> None:
        """Return a request's resources; a normal finish first publishes its checkpoint.

        A request that a launched, unprocessed batch still writes (the overlap lag) is
        released when that batch completes: its slots may not change owner before (I3).
        """
        if any(self.ledger.has_writers(s) for s in self.ledger.slots_of(req.handle)):
            self._deferred_releases.append((req, finished))
            return
        if finished and self.tree is not None:
            self.tracker.donate(req, finished=True)
        self.free_pages(req.page_ids[req.cache.num_tree_pages :], self.reader_of(req))
        req.page_ids = []
        req.page_epoch += 1
        self.ledger.free_request(req.handle)
        req.mamba_slot = None
        if req.cache.locked_node is not None:
            self.tree.unlock(req.cache.locked_node)  # type: ignore[union-attr, arg-type]
        req.cache = RequestCacheState()

    def flush(self) -> int:
        """Drop every unlocked cached prefix, host tier included (nothing is demoted);
        returns the number of checkpoints freed."""
        if self.tree is None:
            return 0
        freed = self.tree.flush().num_checkpoints
        return freed + (self.host.flush() if self.host is not None else 0)

    # -- checks ----------------------------------------------------------------------------------
    def check_invariants(self, running: Sequence[Request]) -> list[Violation]:
        out, self.label_violations = self.label_violations, []
        held = list(running) + [r for r, _ in self._deferred_releases]
        deferred = sum(len(p) for _, p in self._deferred_pages)
        out += check_pools(self.ledger, self.tree, self.pages, running, held, deferred)
        if self.host is not None and self.promotions is not None:
            out += self.host.check() + self.promotions.check()
        return out

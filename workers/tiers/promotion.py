"""Promotion: a prompt whose deepest checkpoint is on the host is copied back before it runs.

At admission (``plan``, then ``start`` once the request holds its slots) the cache manager
offers a request whose device match is at depth m; when the host tier holds a deeper
checkpoint at d (at least one page deeper), the request gets device pages for [m, d) and
the copy is started: the host checkpoint into the request's live slot (and into its keep
slot, when it has one, so that the checkpoint is published into the device tree again),
and the host KV of [m, d) into the new pages.

Ledger rules held here (DESIGN §4 rule 5):
- the host node is locked and its slot has the copy as a *reader* from ``plan`` until the
  copy completes, so host eviction can neither free nor reuse the source;
- every device destination slot has the copy as a *pending writer* until it completes
  (its content record then comes from the completed copy, never from the plan), so the
  request cannot be released, published or preempted under it; the scheduler gives a
  promoting request no work until then;
- destinations are fresh (free slots and pages have no in-flight reader or writer).
A failed copy (``debug.fail_transfer_prob``, or a storage error) leaves the request at its
device hit m (the checkpoint copied into its live slot at its first step, as for any hit):
the node stays absent from the device. Nothing waits on anything the request holds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from workers.cache import MatchResult, SlotLedger, TreeNode, Violation
from workers.request import Request
from workers.tiers.host_tier import HostTier
from workers.tiers.storage import TransferJob


class PromotionPlan(NamedTuple):
    host_node: TreeNode
    depth: int  # d: the host checkpoint's depth
    from_depth: int  # m: the device hit the request keeps if the copy fails
    host_slot: int
    host_page_ids: list[int]  # host pages of [m, d)
    page_ids: list[int]  # fresh device pages of [m, d), the request's own
    transfer_id: int
    origin: str  # "host", or "store" for a checkpoint imported from the store


@dataclass
class PendingPromotion:
    plan: PromotionPlan
    request: Request
    slots: tuple[int, ...]  # device destinations of the state (live, keep)
    job: TransferJob
    first_lookup: bool  # the request's first lookup: its hit is counted at completion


class Promotions:
    """Pending host -> device copies of one engine, oldest first."""

    def __init__(self, host: HostTier, ledger: SlotLedger) -> None:
        self.host = host
        self.ledger = ledger
        self.pending: list[PendingPromotion] = []

    def plan(
        self, tokens: list[int], device: MatchResult, alloc_pages: Callable[[int], list[int] | None]
    ) -> PromotionPlan | None:
        """Lock the deepest host checkpoint on ``tokens`` and give the request device pages
        for what it adds over the device hit; None when it adds nothing or pages are short."""
        hit = self.host.peek(tokens)
        ps = self.host.page_size
        if hit.checkpoint is None or hit.depth < device.depth + ps:
            return None
        hit = self.host.tree.match(tokens)  # now touch its LRU stamps
        assert hit.checkpoint is not None
        self.host.tree.lock(hit.node)  # before alloc_pages: a demotion may evict
        transfer = self.host.next_transfer_id()
        self.host.ledger.add_reader(hit.checkpoint.slot, transfer)
        pages = alloc_pages((hit.depth - device.depth) // ps)
        if pages is None:
            self._release_source(hit.node, transfer)
            return None
        origin = "store" if hit.node.node_id in self.host.from_store else "host"
        return PromotionPlan(
            hit.node,
            hit.depth,
            device.depth,
            hit.checkpoint.slot,
            hit.page_ids[device.depth // ps :],
            pages,
            transfer,
            origin,
        )

    def start(self, req: Request, plan: PromotionPlan, first_lookup: bool) -> PendingPromotion:
        storage = self.host.storage
        assert storage is not None and req.mamba_slot is not None
        slots = (req.mamba_slot,) + ((req.cache.keep_slot,) if req.cache.keep_slot is not None else ())
        for slot in slots:
            self.ledger.add_writer(slot, plan.transfer_id)
        job = storage.copy_in(plan.host_slot, plan.host_page_ids, slots, plan.page_ids, corrupt=self.host.fails())
        pending = PendingPromotion(plan, req, slots, job, first_lookup)
        req.cache.promotion = pending
        self.pending.append(pending)
        return pending

    def cancel(self, plan: PromotionPlan) -> None:
        """Undo ``plan`` before ``start`` (admission gave up); the caller frees the pages."""
        self._release_source(plan.host_node, plan.transfer_id)

    def take_done(self, wait: bool = False) -> list[tuple[PendingPromotion, bool]]:
        """Finished copies in start order (the oldest is waited for when ``wait``), with
        their ledger entries closed: writers dropped, contents recorded on success, the
        host source released."""
        out: list[tuple[PendingPromotion, bool]] = []
        while self.pending and (self.pending[0].job.done() or (wait and not out)):
            p = self.pending.pop(0)
            ok = p.job.result()
            self.ledger.complete_batch(p.plan.transfer_id)
            if ok:
                for slot in p.slots:
                    self.ledger.record_write(slot, p.plan.depth, p.plan.transfer_id)
            self._release_source(p.plan.host_node, p.plan.transfer_id)
            p.request.cache.promotion = None
            out.append((p, ok))
        return out

    def _release_source(self, node: TreeNode, transfer: int) -> None:
        self.host.ledger.complete_reader(transfer)
        self.host.tree.unlock(node)

    def check(self) -> list[Violation]:
        """I3 for the copies in flight: each is the pending writer of its destinations and
        the reader of its host source, whose node is locked and still holds that slot."""
        out: list[Violation] = []
        for p in self.pending:
            tid, node = p.plan.transfer_id, p.plan.host_node
            ckpt = node.checkpoint
            if not node.alive or ckpt is None or ckpt.slot != p.plan.host_slot or node.mamba_lock < 1:
                out.append(Violation("I3", f"promotion {tid}: host source {node} gone, changed or unlocked"))
            if tid not in self.host.ledger.readers_of(p.plan.host_slot):
                out.append(Violation("I3", f"promotion {tid}: not a reader of host slot {p.plan.host_slot}"))
            missing = [s for s in p.slots if tid not in self.ledger.writers_of(s)]
            if missing or p.request.cache.promotion is not p:
                out.append(
                    Violation(
                        "I3",
                        f"promotion {tid}: not the pending writer of slots {missing} or not its request's promotion",
                    )
                )
        return out

"""The host tier of one engine: checkpoints that outlive their device slot (pure bookkeeping).

A second ``RadixCache`` over host page ids and a second ``SlotLedger`` over host slots, so
the host side keeps exactly the device side's invariants (I1-I9, checked by ``check``).
Host entries are self-contained: a host checkpoint at depth d has host KV for the whole
path [0, d) under it (pages shared between paths are stored once, as on the device), so a
promotion never depends on what the device still holds, and I6 (every leaf holds a
checkpoint) means no host KV is ever held without a checkpoint under it (SGLang's "dead
memory"; ``dead_tokens`` recounts it for the gauge).

Entries arrive two ways, both through ``_place`` (lock what is already there, allocate a
host slot and the missing pages -- evicting the host tier's own LRU, never blocking --
write them, record the content, insert):
- ``demote``: the device tree is about to free a checkpoint (``RadixCache.on_drop``). The
  copy-out registers itself as a *reader* of the device slot for its whole duration, so
  the ledger refuses to free the slot until it is done; storage copies out synchronously.
  A full host tier (no slot or pages even after host eviction) drops the checkpoint, and
  a failed copy leaves the node absent from the host tree; neither waits.
- ``import_payload``: a checkpoint fetched from the cluster store, validated first.
Promotions (host -> device) read entries under a host-tree lock (``promotion.py``).
"""

from __future__ import annotations

import itertools
import random
from collections import deque
from collections.abc import Callable, Sequence

from workers.cache import (
    CacheEvent,
    Checkpoint,
    MatchResult,
    RadixCache,
    RequestOwner,
    SlotLedger,
    SlotRole,
    TreeNode,
    Violation,
)
from workers.cache.allocators import IdAllocator
from workers.stats import EngineStats
from workers.tiers.payload import CheckpointPayload, payload_problem
from workers.tiers.storage import TierStorage

TRANSFER_ID_BASE = 1 << 40  # transfer ids share the ledgers' writer/reader maps with batch ids
WriteFn = Callable[[int, list[int], int], bool]  # (host slot, host pages, first page index) -> ok


class HostTier:
    def __init__(
        self,
        page_size: int,
        num_pages: int,
        num_slots: int,
        stats: EngineStats,
        on_event: Callable[[CacheEvent], None] | None = None,
        fail_prob: float = 0.0,
        seed: int = 0,
        keep_commits: bool = False,
    ) -> None:
        self.page_size = page_size
        self.stats = stats
        self.pages = IdAllocator(num_pages, "host KV page")
        self.ledger = SlotLedger(num_slots)
        self.tree = RadixCache(page_size, self.pages, self.ledger, on_event=on_event, tier="host")
        self.storage: TierStorage | None = None  # attached by the engine once pools exist
        self.fail_prob = fail_prob
        self.rng = random.Random(seed ^ 0x7135)
        self._ids = itertools.count(TRANSFER_ID_BASE)
        self._handles = itertools.count(1)
        self.from_store: set[int] = set()  # host node ids imported from the store
        # Paths demoted since the last ``take_commits`` (for the cluster store), newest last.
        self.commits: deque[tuple[int, ...]] | None = deque(maxlen=256) if keep_commits else None

    # -- ids, faults -----------------------------------------------------------------------
    def next_transfer_id(self) -> int:
        return next(self._ids)

    def fails(self) -> bool:
        """Draw a forced transfer failure (``debug.fail_transfer_prob``)."""
        return self.fail_prob > 0 and self.rng.random() < self.fail_prob

    # -- lookups ---------------------------------------------------------------------------
    def peek(self, token_ids: Sequence[int]) -> MatchResult:
        return self.tree.peek(token_ids)

    @property
    def num_checkpoints(self) -> int:
        return self.tree.num_checkpoints

    # -- demotion --------------------------------------------------------------------------
    def demote(self, device_tree: RadixCache, node: TreeNode, evicting: bool = True) -> str:
        """Copy ``node``'s checkpoint and the KV of its path to the host (see module doc).

        Returns the outcome counted in ``hybridserve_tier_demotions_total{outcome}``:
        ``demoted``, ``present`` (the host already holds it), ``host_full``, ``failed``;
        ``copied`` for a copy of a checkpoint that stays on the device (``evicting=False``:
        the write-through of a shared prefix, so that the cluster store gets it).
        """
        ckpt, storage = node.checkpoint, self.storage
        assert ckpt is not None and storage is not None
        tokens = device_tree.path_tokens(node)
        pages = device_tree.path_page_ids(node)
        device_ledger = device_tree.ledger

        def write(host_slot: int, host_pages: list[int], first: int) -> bool:
            transfer = self.next_transfer_id()
            device_ledger.add_reader(ckpt.slot, transfer)
            try:
                ok = storage.copy_out(ckpt.slot, pages[first:], host_slot, host_pages, corrupt=self.fails())
            finally:
                device_ledger.complete_reader(transfer)
            if ok:
                self.stats.inc(
                    "hybridserve_tier_bytes_total", storage.nbytes(1, len(host_pages)), label="device_to_host"
                )
            return ok

        outcome = self._place(tokens, write)
        if outcome == "demoted" and self.commits is not None:
            self.commits.append(tokens)
        if outcome == "demoted" and not evicting:
            outcome = "copied"
        self.stats.inc("hybridserve_tier_demotions_total", label=outcome)
        return outcome

    def import_payload(self, payload: CheckpointPayload, fingerprint: str) -> str:
        """Place a checkpoint fetched from the cluster store: ``imported``, ``present``,
        ``host_full`` or ``invalid`` (``payload_problem`` names what is wrong)."""
        storage = self.storage
        assert storage is not None
        if payload_problem(payload, self.page_size, fingerprint, storage.layout()) is not None:
            return "invalid"
        tensors = payload.tensors()

        def write(host_slot: int, host_pages: list[int], first: int) -> bool:
            storage.write_host(host_slot, host_pages, tensors, first)
            return True

        outcome = self._place(payload.token_ids, write)
        if outcome == "demoted":
            node = self.tree.peek(payload.token_ids).node
            self.from_store.add(node.node_id)
            return "imported"
        return outcome

    def _place(self, tokens: tuple[int, ...], write: WriteFn) -> str:
        have = self.tree.match(tokens)  # refreshes what is already there
        if have.depth == len(tokens):
            return "present"
        self.tree.lock(have.node)  # host eviction below must spare it
        try:
            handle = next(self._handles)
            host_slot = self.tree.alloc_slot_evicting(RequestOwner(handle, SlotRole.PENDING))
            if host_slot is None:
                return "host_full"
            first = have.depth // self.page_size
            host_pages = self.tree.alloc_pages(len(tokens) // self.page_size - first)
            if host_pages is None:
                self.ledger.free(host_slot)
                return "host_full"
            batch = self.next_transfer_id()
            if not write(host_slot, host_pages, first):
                self.ledger.free(host_slot)
                self.pages.free(host_pages)
                return "failed"
            self.ledger.record_write(host_slot, len(tokens), batch)
            result = self.tree.insert(
                tokens, have.page_ids + host_pages, Checkpoint.for_tokens(host_slot, tokens, self.page_size, batch)
            )
            self.pages.free(result.duplicate_page_ids)
            assert result.checkpoint_inserted, result
            return "demoted"
        finally:
            self.tree.unlock(have.node)

    # -- the cluster store -------------------------------------------------------------------
    def take_commits(self) -> list[tuple[int, ...]]:
        if not self.commits:
            return []
        out = list(self.commits)
        self.commits.clear()
        return out

    def export(self, token_ids: Sequence[int], fingerprint: str) -> CheckpointPayload | None:
        """The host checkpoint of exactly ``token_ids`` (state + the KV of its path), copied."""
        storage = self.storage
        assert storage is not None
        hit = self.tree.peek(token_ids)
        if hit.checkpoint is None or hit.depth != len(token_ids):
            return None
        entry = storage.read_host(hit.checkpoint.slot, hit.page_ids)
        return CheckpointPayload.build(tuple(token_ids), self.page_size, hit.checkpoint.prefix_hash, fingerprint, entry)

    # -- housekeeping ------------------------------------------------------------------------
    def flush(self) -> int:
        self.from_store.clear()
        return self.tree.flush().num_checkpoints

    def dead_tokens(self) -> int:
        """Host KV tokens with no host checkpoint at or below them (0 by I6; recounted)."""
        dead = 0
        alive: dict[int, bool] = {}
        for node in reversed(list(self.tree.iter_nodes())):  # children before parents
            has = node.checkpoint is not None or any(alive[c.node_id] for c in node.children.values())
            alive[node.node_id] = has
            dead += 0 if has else len(node.key)
        return dead

    def check(self) -> list[Violation]:
        """The host tree's own invariants, its labels (I4) and its page conservation (I2)."""
        out = [Violation(v.invariant, f"host tier: {v.message}") for v in self.tree.check_invariants()]
        for node in self.tree.iter_nodes():
            ckpt = node.checkpoint
            if ckpt is None or self.ledger.has_writers(ckpt.slot):
                continue
            content = self.ledger.content_of(ckpt.slot)
            if content is None or content.depth != ckpt.depth:
                out.append(Violation("I4", f"host tier: node at depth {node.depth}: slot {ckpt.slot} holds {content}"))
        if self.pages.num_free + self.tree.num_cached_pages != self.pages.num_usable:
            out.append(
                Violation(
                    "I2",
                    f"host tier: pages free {self.pages.num_free} + tree "
                    f"{self.tree.num_cached_pages} != {self.pages.num_usable}",
                )
            )
        if self.ledger.num_request_owned:
            out.append(Violation("I2", f"host tier: {self.ledger.num_request_owned} slots held between transfers"))
        return out

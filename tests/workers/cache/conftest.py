from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from workers.cache import CacheEvent, Checkpoint, InsertResult, RadixCache, RequestOwner, SlotLedger, SlotRole, TreeNode
from workers.cache.allocators import IdAllocator


class Harness:
    """A cache over small pools, plus helpers that play the engine's part exactly."""

    def __init__(self, page_size: int = 1, num_pages: int = 64, num_slots: int = 16) -> None:
        self.pages = IdAllocator(num_pages, "kv")
        self.ledger = SlotLedger(num_slots)
        self.events: list[CacheEvent] = []
        self.cache = RadixCache(page_size, self.pages, self.ledger, on_event=self.events.append)
        self.page_size = page_size
        self._batch = 0

    def keep_slot(self, request_id: str = "r") -> int:
        slot = self.ledger.alloc(RequestOwner(request_id, SlotRole.KEEP))
        assert slot is not None
        return slot

    def checkpoint(self, token_ids: Sequence[int], slot: int | None = None) -> Checkpoint:
        self._batch += 1
        slot = self.keep_slot() if slot is None else slot
        return Checkpoint.for_tokens(slot, token_ids, self.page_size, self._batch)

    def put(self, token_ids: Sequence[int], with_checkpoint: bool = True) -> InsertResult:
        """Insert ``token_ids`` with fresh pages (and a fresh checkpoint), then free what
        the tree did not take, as the engine would."""
        page_ids = self.pages.alloc(len(token_ids) // self.page_size)
        assert page_ids is not None
        ckpt = self.checkpoint(token_ids) if with_checkpoint else None
        result = self.cache.insert(token_ids, page_ids, ckpt)
        self.pages.free(result.duplicate_page_ids)
        if ckpt is not None and result.duplicate_checkpoint:
            self.ledger.free(ckpt.slot)
        assert self.cache.check_invariants() == []
        return result

    def node_at(self, token_ids: Sequence[int]) -> TreeNode:
        for node in self.cache.iter_nodes():
            if self.cache.path_tokens(node) == tuple(token_ids):
                return node
        raise AssertionError(f"no node at {token_ids}")

    def no_leaks(self) -> bool:
        """Every page is free or the tree's; every slot is free or the tree's."""
        usable_pages = self.pages.num_usable
        return (
            self.pages.num_free + self.cache.num_cached_pages == usable_pages
            and self.ledger.num_free + self.cache.num_checkpoints == self.ledger.num_usable
        )


@pytest.fixture
def h() -> Harness:
    return Harness()


@pytest.fixture
def h2() -> Harness:
    return Harness(page_size=2)


@pytest.fixture
def make_harness() -> Callable[..., Harness]:
    return Harness

"""RadixCache: splits make tombstones, match stops at the deepest checkpoint, duplicate inserts,
both evictions, conservation and optional-slot exhaustion, pinned exactly."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest

from workers.cache import (
    Checkpoint,
    CheckpointEvicted,
    CheckpointInserted,
    EvictResult,
    OwnershipError,
    RequestOwner,
    SlotRole,
    TreeOwner,
    prefix_hash,
)

if TYPE_CHECKING:  # the harness reaches tests only as fixtures (conftest.py)
    from conftest import Harness


def test_split_makes_a_tombstone_parent_and_the_child_keeps_its_state(h: Harness) -> None:
    a = h.put([1, 2, 3, 4]).node
    h.put([1, 2, 5, 6])
    mid = h.node_at([1, 2])
    assert mid.is_tombstone and len(mid.children) == 2 and a.parent is mid
    assert h.node_at([1, 2, 3, 4]) is a and a.key == (3, 4)  # same node, id and checkpoint
    assert a.checkpoint is not None and h.ledger.owner_of(a.checkpoint.slot) == TreeOwner(a.node_id)
    assert h.cache.num_checkpoints == 2 and h.cache.num_cached_pages == 6


def test_split_happens_on_page_boundaries_only(h2: Harness) -> None:
    h2.put([1, 2, 3, 4])
    h2.put([1, 2, 3, 5])  # diverges inside page 2: the shared part is page 1 only
    mid = h2.node_at([1, 2])
    assert mid.is_tombstone and sorted(mid.children) == [(3, 4), (3, 5)]
    assert h2.cache.num_cached_pages == 3


def test_insert_ending_inside_an_edge_splits_and_fills_the_new_node(h: Harness) -> None:
    first = h.put([1, 2, 3, 4])
    pages = h.pages.alloc(2)
    assert pages is not None
    result = h.cache.insert([1, 2], pages, h.checkpoint([1, 2]))
    assert result.checkpoint_inserted and not result.node.is_tombstone and result.node.depth == 2
    assert result.page_ids == first.page_ids[:2] and result.duplicate_page_ids == pages
    assert result.num_new_pages == 0 and h.cache.check_invariants() == []


def test_match_stops_at_the_deepest_checkpoint_and_walks_through_tombstones(h: Harness) -> None:
    h.put([1, 2, 3, 4])
    deep = h.put([1, 2, 3, 4, 5, 6])
    assert h.cache.evict_checkpoints(1) == EvictResult(0, 1)  # the older, inner one
    assert h.node_at([1, 2, 3, 4]).is_tombstone
    num_nodes = h.cache.num_nodes
    hit = h.cache.match([1, 2, 3, 4, 5, 6, 7])
    assert (hit.node, hit.depth, hit.kv_depth) == (deep.node, 6, 6)
    assert hit.page_ids == deep.page_ids and hit.checkpoint is deep.node.checkpoint
    miss = h.cache.match([1, 2, 3, 4, 5, 9])
    got = (miss.node, miss.depth, miss.page_ids, miss.checkpoint, miss.kv_depth)
    assert got == (h.cache.root, 0, [], None, 5)
    assert h.cache.num_nodes == num_nodes  # match never splits
    assert h.cache.check_invariants() == []


def test_match_and_insert_ignore_a_trailing_partial_page(h2: Harness) -> None:
    h2.put([1, 2, 3, 4])
    assert h2.cache.match([1, 2, 3, 4, 5]).depth == 4
    assert (h2.cache.match([1, 2, 3]).depth, h2.cache.match([1, 2, 3]).kv_depth) == (0, 2)
    pages = h2.pages.alloc(2)
    assert pages is not None
    with pytest.raises(ValueError, match="page_size"):  # a checkpoint must sit on a page boundary
        h2.cache.insert([1, 2, 3, 4, 5], pages, h2.checkpoint([1, 2, 3, 4]))
    result = h2.cache.insert([1, 2, 3, 4, 5], pages, None)  # KV only, along the existing path
    assert result.duplicate_page_ids == pages and result.node.depth == 4


def test_duplicate_insert_is_reported_and_the_slot_is_not_taken(h: Harness) -> None:
    first = h.put([1, 2, 3])
    pages = h.pages.alloc(3)
    slot = h.keep_slot()
    assert pages is not None
    again = h.cache.insert([1, 2, 3], pages, h.checkpoint([1, 2, 3], slot))
    assert again.duplicate_checkpoint and not again.checkpoint_inserted and again.node is first.node
    assert h.ledger.owner_of(slot) == RequestOwner("r", SlotRole.KEEP)  # still the caller's to free
    assert again.duplicate_page_ids == pages and again.page_ids == first.page_ids
    # Re-inserting the tree's own pages (taken from a match) reports no duplicates.
    same = h.cache.insert([1, 2, 3], h.cache.match([1, 2, 3]).page_ids, None)
    assert same.duplicate_page_ids == [] and same.num_new_pages == 0


def test_insert_adopts_only_the_pages_past_the_tree(h: Harness) -> None:
    h.put([1, 2])
    hit = h.cache.match([1, 2])
    new = h.pages.alloc(2)
    assert new is not None
    result = h.cache.insert([1, 2, 3, 4], hit.page_ids + new, h.checkpoint([1, 2, 3, 4]))
    assert result.num_new_pages == 2 and result.duplicate_page_ids == []
    assert result.page_ids == hit.page_ids + new and h.no_leaks()


def _fork(h: Harness) -> None:
    """X = [1,2,3] (inner, checkpoint) with leaves A = X+[4,5] and B = X+[6,7], oldest first."""
    h.put([1, 2, 3])
    h.put([1, 2, 3, 4, 5])
    h.put([1, 2, 3, 6, 7])


def test_checkpoint_eviction_tombstones_inner_nodes_and_deletes_leaves(h: Harness) -> None:
    _fork(h)
    assert h.cache.evict_checkpoints(1) == EvictResult(0, 1)
    x = h.node_at([1, 2, 3])
    assert x.is_tombstone and h.cache.num_cached_pages == 7  # KV kept
    assert h.cache.evict_checkpoints(1) == EvictResult(2, 1)  # leaf A deleted with its KV
    assert x.alive and list(x.children) == [(6,)]
    assert h.cache.evict_checkpoints(1) == EvictResult(5, 1)  # B, then X became a tombstone leaf
    assert h.cache.num_nodes == 0 and h.no_leaks() and h.cache.check_invariants() == []


def test_kv_eviction_takes_least_recent_leaves_only(h: Harness) -> None:
    _fork(h)
    h.cache.match([1, 2, 3, 4, 5])  # A is now more recent than B
    assert h.cache.evict_kv(1) == EvictResult(2, 1)  # B, though X is older: X is no leaf
    assert h.node_at([1, 2, 3, 4, 5]).alive
    assert h.cache.evict_kv(1) == EvictResult(2, 1)  # A; X becomes a leaf with a checkpoint
    assert h.node_at([1, 2, 3]).is_leaf
    assert h.cache.evict_kv(1) == EvictResult(3, 1)
    assert h.cache.num_nodes == 0 and h.no_leaks()


def test_kv_eviction_deletes_the_tombstone_ancestors_it_exposes(h: Harness) -> None:
    h.put([1, 2, 3, 4])
    h.put([1, 2, 5, 6])
    assert h.cache.evict_kv(3) == EvictResult(6, 2)
    assert h.cache.num_nodes == 0 and h.no_leaks()


def test_match_refreshes_the_checkpoint_lru_for_the_returned_node_only(h: Harness) -> None:
    h.put([1, 2, 3, 4])
    h.put([1, 2])  # split, filled
    h.put([5, 6])
    h.cache.match([1, 2, 3, 4])  # order now: [1,2], [5,6], [1,2,3,4]
    h.cache.evict_checkpoints(1)
    assert h.node_at([1, 2]).is_tombstone and h.node_at([5, 6]).checkpoint is not None


def test_locks_protect_the_path_kv_and_the_node_checkpoint(h: Harness) -> None:
    _fork(h)
    hit = h.cache.match([1, 2, 3, 4, 5])
    h.cache.lock(hit.node)
    assert (h.cache.num_protected_pages, h.cache.num_evictable_pages) == (5, 2)
    assert (h.cache.num_protected_checkpoints, h.cache.num_evictable_checkpoints) == (1, 2)
    assert h.cache.evict_kv(100) == EvictResult(2, 1)  # only B
    assert h.cache.evict_checkpoints(100) == EvictResult(0, 1)  # X tombstoned: not itself locked
    assert h.cache.flush() == EvictResult(0, 0)
    assert hit.node.checkpoint is hit.checkpoint and h.cache.match([1, 2, 3, 4, 5]).node is hit.node
    assert h.cache.check_invariants() == []
    h.cache.unlock(hit.node)
    assert h.cache.flush() == EvictResult(5, 1)
    assert h.cache.num_nodes == 0 and h.no_leaks()


def test_lock_rules(h: Harness) -> None:
    h.put([1, 2, 3, 4])
    h.put([1, 2, 5, 6])
    tombstone = h.node_at([1, 2])
    with pytest.raises(ValueError, match="tombstone"):
        h.cache.lock(tombstone)
    with pytest.raises(ValueError, match="no lock"):
        h.cache.unlock(h.node_at([1, 2, 3, 4]))
    gone = h.node_at([1, 2, 5, 6])
    h.cache.evict_kv(100)
    with pytest.raises(ValueError, match="not a node"):
        h.cache.lock(gone)
    h.cache.lock(h.cache.root)  # a miss returns the root; locking it is harmless
    h.cache.unlock(h.cache.root)
    assert h.cache.check_invariants() == []


@pytest.mark.parametrize("target", ["new_leaf", "split_below_checkpoint", "tombstone"])
def test_insert_with_a_pending_writer_is_refused_and_changes_nothing(h: Harness, target: str) -> None:
    for toks in ([1, 2, 3, 4], [1, 2, 5, 6], [1, 2, 3, 4, 7, 8]):
        h.put(toks)  # [1, 2] is a split tombstone; [1, 2, 3, 4] holds a checkpoint above edge [7, 8]
    toks = {"new_leaf": [1, 2, 3, 4, 5], "split_below_checkpoint": [1, 2, 3, 4, 7], "tombstone": [1, 2]}[target]
    covered = h.cache.peek(toks).kv_depth
    pages = h.cache.peek([1, 2, 3, 4, 7, 8]).page_ids[:covered] + (h.pages.alloc(len(toks) - covered) or [])
    slot = h.keep_slot()
    h.ledger.add_writer(slot, batch_id=40)
    ckpt = h.checkpoint(toks, slot)
    assert not h.ledger.may_move(slot)
    before = (h.cache.num_nodes, h.cache.num_cached_pages, h.cache.num_checkpoints)
    with pytest.raises(OwnershipError, match="pending writers"):
        h.cache.insert(toks, pages, ckpt)
    assert (h.cache.num_nodes, h.cache.num_cached_pages, h.cache.num_checkpoints) == before
    assert h.cache.check_invariants() == []
    h.ledger.complete_batch(40)
    assert h.cache.insert(toks, pages, ckpt).checkpoint_inserted


def test_a_duplicate_is_not_refused_for_a_writer_since_the_slot_stays(h: Harness) -> None:
    h.put([1, 2])
    slot = h.keep_slot()
    h.ledger.add_writer(slot, batch_id=1)
    result = h.cache.insert([1, 2], h.cache.match([1, 2]).page_ids, h.checkpoint([1, 2], slot))
    assert result.duplicate_checkpoint and h.ledger.owner_of(slot) == RequestOwner("r", SlotRole.KEEP)


@pytest.mark.parametrize(
    "case",
    [
        "page_count",
        "depth",
        "depth0",
        "hash",
        "tree_slot",
        "free_slot",
        "tree_page",
        "free_page",
        "repeat_page",
        "leaf_without_checkpoint",
    ],
)
def test_insert_rejects_bad_input_before_mutating(h: Harness, case: str) -> None:
    h.put([1, 2])
    tree_ckpt = h.node_at([1, 2]).checkpoint
    assert tree_ckpt is not None
    tree_slot = tree_ckpt.slot
    pages = h.pages.alloc(3)
    assert pages is not None
    toks = [1, 2, 3, 4, 5]
    ckpt = h.checkpoint(toks[:3])
    bad = {
        "page_count": ([1, 2, 3], pages[:2], ckpt, ValueError),
        "depth": (toks, pages + h.pages.alloc(2), ckpt, ValueError),  # type: ignore[operator]
        "depth0": ([], [], Checkpoint(ckpt.slot, 0, prefix_hash([], 1), 0), ValueError),
        "hash": ([1, 2, 3], pages, Checkpoint(ckpt.slot, 3, prefix_hash([1, 2, 4], 1), 0), ValueError),
        "tree_slot": ([1, 2, 3], pages, Checkpoint(tree_slot, 3, ckpt.prefix_hash, 0), OwnershipError),
        "free_slot": ([1, 2, 3], pages, Checkpoint(15, 3, ckpt.prefix_hash, 0), OwnershipError),
        "tree_page": ([1, 2, 3], pages[:2] + h.node_at([1, 2]).page_ids[:1], ckpt, ValueError),
        "free_page": ([1, 2, 3], pages[:2] + [63], ckpt, ValueError),
        "repeat_page": ([1, 2, 3], [pages[0]] * 3, ckpt, ValueError),
        "leaf_without_checkpoint": ([1, 2, 3], pages, None, ValueError),
    }[case]
    token_ids, page_ids, checkpoint, error = bad
    with pytest.raises(error):
        h.cache.insert(token_ids, page_ids, checkpoint)
    assert h.cache.num_nodes == 1 and h.cache.num_cached_pages == 2 and h.cache.num_checkpoints == 1
    assert h.ledger.owner_of(ckpt.slot) == RequestOwner("r", SlotRole.KEEP)
    assert h.cache.check_invariants() == []


def test_insert_without_checkpoint_inside_the_tree_may_split(h: Harness) -> None:
    h.put([1, 2, 3, 4])
    result = h.cache.insert([1, 2], h.cache.peek([1, 2, 3, 4]).page_ids[:2], None)
    assert result.node.is_tombstone and result.node.depth == 2 and not result.checkpoint_inserted
    assert h.cache.check_invariants() == []


def test_optional_allocation_never_evicts_but_the_mandatory_one_does(make_harness: Callable[..., Harness]) -> None:
    h = make_harness(num_slots=4)
    for toks in ([1], [2], [3]):
        h.put(toks)
    assert h.ledger.num_free == 0
    assert h.ledger.alloc(RequestOwner("q", SlotRole.PENDING)) is None  # skip, never raise
    assert h.cache.num_checkpoints == 3
    hits = [h.cache.match([t]) for t in (1, 2)]
    for hit in hits:
        h.cache.lock(hit.node)
    live = h.cache.alloc_slot_evicting(RequestOwner("q", SlotRole.LIVE))
    assert live is not None and h.ledger.slots_of("q") == {live: SlotRole.LIVE}
    assert sorted(h.cache.path_tokens(n) for n in h.cache.iter_nodes()) == [(1,), (2,)]  # [3] went
    assert h.cache.alloc_slot_evicting(RequestOwner("q", SlotRole.KEEP)) is None  # all locked
    assert all(hit.node.checkpoint is hit.checkpoint for hit in hits)


def test_alloc_pages_evicts_unlocked_kv(make_harness: Callable[..., Harness]) -> None:
    h = make_harness(num_pages=7)
    h.put([1, 2, 3])
    h.put([4, 5, 6])
    h.cache.match([1, 2, 3])
    got = h.cache.alloc_pages(2)
    assert got is not None and h.node_at([1, 2, 3]).alive and h.cache.num_cached_pages == 3
    assert h.cache.alloc_pages(5) is None and h.cache.num_nodes == 0  # evicted what it could


def test_flush_empties_an_unlocked_tree_and_frees_everything(h: Harness) -> None:
    _fork(h)
    h.put([1, 9, 9])  # splits [1] off X
    h.put([1, 9])  # splits [9] off [9, 9]; its page is a duplicate
    assert h.cache.flush() == EvictResult(9, 5)
    assert h.cache.num_nodes == 0 and h.cache.num_checkpoints == 0 and h.no_leaks()
    assert h.pages.num_free == h.pages.num_usable and h.ledger.num_free == h.ledger.num_usable
    assert h.cache.check_invariants() == []


def test_events_name_the_token_path_of_each_checkpoint(h: Harness) -> None:
    _fork(h)
    h.cache.evict_checkpoints(1)
    inserted = [e for e in h.events if isinstance(e, CheckpointInserted)]
    evicted = [e for e in h.events if isinstance(e, CheckpointEvicted)]
    assert [e.token_ids for e in inserted] == [(1, 2, 3), (1, 2, 3, 4, 5), (1, 2, 3, 6, 7)]
    assert evicted == [CheckpointEvicted(3, prefix_hash([1, 2, 3], 1), (1, 2, 3))]


def test_prefix_hash_chains_per_page() -> None:
    from workers.cache import extend_prefix_hash

    assert extend_prefix_hash(prefix_hash([1, 2], 2), [3, 4], 2) == prefix_hash([1, 2, 3, 4], 2)
    assert prefix_hash([1, 2, 3, 4], 2) != prefix_hash([1, 2, 3, 4], 1)
    assert prefix_hash([1, 2], 1) != prefix_hash([2, 1], 1)
    with pytest.raises(ValueError, match="whole pages"):
        prefix_hash([1, 2, 3], 2)


def test_check_invariants_catches_corruption(h: Harness) -> None:
    _fork(h)
    x, a = h.node_at([1, 2, 3]), h.node_at([1, 2, 3, 4, 5])
    x.checkpoint, a.checkpoint = a.checkpoint, x.checkpoint  # states at the wrong depths
    found = {v.invariant for v in h.cache.check_invariants()}
    assert {"I1", "I2"} <= found
    x.checkpoint, a.checkpoint = a.checkpoint, x.checkpoint
    a.full_lock += 1
    assert {v.invariant for v in h.cache.check_invariants()} >= {"I7", "I8"}
    a.full_lock -= 1
    saved, a.checkpoint = a.checkpoint, None  # a tombstone leaf, and an LRU that disagrees
    assert {v.invariant for v in h.cache.check_invariants()} >= {"I6", "I8"}
    a.checkpoint = saved
    assert h.cache.check_invariants() == []


def test_the_kv_eviction_heap_stays_bounded_and_exact(h: Harness) -> None:
    h.put([1, 2])
    h.put([3, 4])
    for _ in range(500):  # every touch of a leaf pushes a heap entry
        h.cache.match([1, 2])
    assert len(h.cache._leaves) <= 2 * h.cache.num_nodes + 64 + 1
    assert h.cache.check_invariants() == []
    assert h.cache.evict_kv(1) == EvictResult(2, 1) and h.node_at([1, 2]).alive  # [3, 4] was older

"""The store's index: keyed by the prefix-hash chain, a byte budget, LRU eviction."""

from __future__ import annotations

import pytest

from cluster.store.checkpoint_store import CheckpointStore, StoreEntry
from workers.cache.prefix_hash import prefix_hash_chain

PAGE = 4


def entry(tokens: list[int], nbytes: int = 10, owner: str = "a") -> StoreEntry:
    return StoreEntry(prefix_hash_chain(tokens, PAGE)[-1], len(tokens), tuple(tokens), nbytes, object(), owner)


def test_lookup_returns_the_deepest_entry_on_the_chain():
    store = CheckpointStore(100)
    a, b, other = list(range(8)), list(range(16)), [9] * 8
    for e in (entry(a), entry(b), entry(other)):
        assert store.commit(e).outcome == "committed"
    prompt = list(range(20))
    hit = store.lookup(prefix_hash_chain(prompt, PAGE))
    assert hit is not None and hit.depth == 16
    assert store.lookup(prefix_hash_chain(prompt, PAGE)[:3]).depth == 8  # only the first 12 tokens
    assert store.lookup(prefix_hash_chain(prompt, PAGE), min_depth=16) is None  # nothing deeper than local
    assert store.lookup(prefix_hash_chain([5] * 12, PAGE)) is None


def test_budget_evicts_least_recently_used_and_refuses_the_oversized():
    store = CheckpointStore(30)
    e1, e2, e3 = entry([1] * 4), entry([2] * 4), entry([3] * 4)
    store.commit(e1)
    store.commit(e2)
    store.lookup(prefix_hash_chain([1] * 4, PAGE))  # e1 is now the newer one
    result = store.commit(entry([3] * 4, nbytes=15))
    assert result.outcome == "committed" and [e.key for e in result.evicted] == [e2.key]
    assert store.num_bytes == 25 and store.num_objects == 2 and store.num_evictions == 1
    assert store.commit(entry([4] * 4, nbytes=31)).outcome == "too_big"
    assert store.commit(e3).outcome == "duplicate"
    assert store.missing([e1.key, e2.key, e3.key]) == [e2.key]


def test_drop_and_clear_release_bytes():
    store = CheckpointStore(100)
    e = entry([1] * 8, nbytes=40)
    store.commit(e)
    assert store.drop(e.key) is e and store.drop(e.key) is None and store.num_bytes == 0
    store.commit(e)
    assert len(store.clear()) == 1 and store.num_objects == 0
    assert store.stats() == {
        "hybridserve_store_objects": 0,
        "hybridserve_store_bytes": 0,
        "hybridserve_store_evictions_total": 0,
    }
    with pytest.raises(ValueError, match="cluster_store_bytes"):
        CheckpointStore(0)

"""PrefixIndex: exact answers on small cases, and a randomized comparison with brute force."""

from __future__ import annotations

import random

from cluster.routing.prefix_index import PrefixIndex
from workers.cache.records import CheckpointEvicted, CheckpointInserted


def test_deepest_checkpoint_at_or_below_the_match_per_replica():
    idx = PrefixIndex()
    idx.insert("a", [1, 2, 3, 4])
    idx.insert("a", [1, 2, 3, 4, 5, 6, 7, 8])
    idx.insert("b", [1, 2, 3, 4, 5, 6])
    prompt = [1, 2, 3, 4, 5, 6, 7, 9, 9]
    # a's depth-8 checkpoint diverges at token 8 -> its usable depth is 4, not 7 (the KV match)
    assert idx.match(prompt) == {"a": 4, "b": 6}
    assert idx.match([1, 2, 3, 4, 5, 6, 7, 8, 0]) == {"a": 8, "b": 6}


def test_max_depth_caps_the_match_and_asked_replicas_default_to_zero():
    idx = PrefixIndex()
    idx.insert("a", [1, 2, 3, 4])
    idx.insert("a", [1, 2, 3, 4, 5, 6, 7, 8])
    # the whole prompt is cached, but the last token must be computed: cap at len - 1
    assert idx.match([1, 2, 3, 4, 5, 6, 7, 8], max_depth=7) == {"a": 4}
    assert idx.match([9, 9], replicas=["a", "c"]) == {"a": 0, "c": 0}
    assert idx.match([1, 2, 3, 4, 5], replicas=["c"]) == {"c": 0}


def test_evict_and_forget_prune_the_tree():
    idx = PrefixIndex()
    idx.insert("a", [1, 2, 3, 4])
    idx.insert("a", [1, 2, 3, 4, 5, 6])
    idx.insert("b", [1, 2, 7, 7])
    assert idx.summary().num_nodes == 5  # root, [1,2] branch, [3,4], [5,6], [7,7]
    idx.evict("a", [1, 2, 3, 4])
    assert idx.match([1, 2, 3, 4, 5, 6, 0]) == {"a": 6}
    assert idx.summary().num_nodes == 4  # [3,4] merged into [5,6]
    idx.evict("a", [1, 2, 3, 4])  # unknown: no-op
    idx.forget("a")
    assert idx.match([1, 2, 3, 4, 5, 6, 0]) == {}
    assert idx.summary().num_nodes == 2  # root and b's path, merged back into one edge
    assert idx.match([1, 2, 7, 7, 1]) == {"b": 4}
    idx.forget("b")
    assert idx.summary() == (1, {})


def test_apply_reads_engine_events_in_order():
    idx = PrefixIndex()
    ids = (5, 6, 7, 8)
    n = idx.apply(
        "r",
        [
            CheckpointInserted(4, b"h", ids),
            CheckpointEvicted(4, b"h", ids),
            CheckpointInserted(4, b"h", ids),
            "not an event",
        ],
    )
    assert n == 3
    assert idx.match([5, 6, 7, 8, 9]) == {"r": 4}
    idx.clear("r")
    assert idx.replicas() == ["r"] and idx.num_checkpoints("r") == 0


def test_per_replica_cap_drops_the_oldest():
    idx = PrefixIndex(max_checkpoints_per_replica=2)
    idx.insert("r", [1, 1])
    idx.insert("r", [2, 2])
    idx.insert("r", [1, 1])  # refreshed: now the newest
    idx.insert("r", [3, 3])
    assert idx.num_checkpoints("r") == 2
    assert idx.match([2, 2, 0]) == {} and idx.match([1, 1, 0]) == {"r": 2}


def _brute(held: dict[str, set[tuple[int, ...]]], prompt: list[int], limit: int) -> dict[str, int]:
    out = {}
    for replica, paths in held.items():
        depths = [len(p) for p in paths if len(p) <= limit and tuple(prompt[: len(p)]) == p]
        if depths:
            out[replica] = max(depths)
    return out


def test_random_operations_match_brute_force():
    rng = random.Random(7)
    idx = PrefixIndex()
    held: dict[str, set[tuple[int, ...]]] = {}
    for step in range(3000):
        replica = rng.choice("abc")
        path = tuple(rng.choice([0, 1]) for _ in range(rng.randint(1, 8)))
        op = rng.random()
        if op < 0.5:
            idx.insert(replica, path)
            held.setdefault(replica, set()).add(path)
        elif op < 0.85:
            idx.evict(replica, path)
            held.get(replica, set()).discard(path)
        elif op < 0.87:
            idx.forget(replica)
            held.pop(replica, None)
        prompt = [rng.choice([0, 1]) for _ in range(rng.randint(1, 10))]
        limit = rng.randint(0, len(prompt))
        expected = {r: d for r, d in _brute(held, prompt, limit).items()}
        assert idx.match(prompt, max_depth=limit) == expected, step
    # every node is a checkpoint, a branch point or the root
    num_paths = len({p for paths in held.values() for p in paths})
    assert idx.summary().num_nodes <= 2 * num_paths + 1

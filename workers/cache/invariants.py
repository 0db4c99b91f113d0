"""``check_cache`` (``RadixCache.check_invariants``): recount everything from scratch and compare.

Meant for tests and ``debug.check_invariants`` (it is O(sum of path lengths)); it reads
the cache's private fields on purpose, because the point is to distrust them.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

from workers.cache.allocators import IdAllocator
from workers.cache.ledger import SlotLedger, TreeOwner
from workers.cache.lru import CheckpointLru, LeafHeap
from workers.cache.node import TreeNode
from workers.cache.prefix_hash import ROOT_PREFIX_HASH, extend_prefix_hash
from workers.cache.records import Violation


class CheckedTree(Protocol):
    """What the recount reads of the tree (``RadixCache``), private fields included."""

    page_size: int
    root: TreeNode
    ledger: SlotLedger
    page_allocator: IdAllocator
    num_evictable_pages: int
    num_protected_pages: int
    num_evictable_checkpoints: int
    num_protected_checkpoints: int
    _tree_pages: set[int]
    _nodes: dict[int, TreeNode]
    _checkpoints: CheckpointLru
    _leaves: LeafHeap

    def peek(self, token_ids: Any) -> Any: ...


class _Visit(NamedTuple):
    node: TreeNode
    token_ids: tuple[int, ...]  # the node's path [0, depth)
    page_ids: list[int]  # the tree's pages for [0, depth)
    best: TreeNode  # deepest ancestor-or-self with a checkpoint, or the root


def check_cache(cache: CheckedTree) -> list[Violation]:
    visits, out = _collect(cache)
    out += cache.ledger.check()
    out += _check_shape(cache, visits)
    out += _check_ownership(cache, visits)
    out += _check_locks(visits)
    out += _check_accounting(cache, visits)
    out += _check_match(cache, visits)
    return out


def _collect(cache: CheckedTree) -> tuple[list[_Visit], list[Violation]]:
    """Every node (root first) with its path; reports broken links instead of looping."""
    root, out = cache.root, []
    visits = [_Visit(root, (), [], root)]
    seen = {root.node_id}
    stack = [visits[0]]
    while stack:
        parent = stack.pop()
        for first_page, node in parent.node.children.items():
            if node.node_id in seen or node.parent is not parent.node or node.key[: cache.page_size] != first_page:
                out.append(Violation("I1", f"{node}: bad link under {parent.node} (key page {first_page})"))
                continue
            seen.add(node.node_id)
            best = node if node.checkpoint is not None else parent.best
            visit = _Visit(node, parent.token_ids + node.key, parent.page_ids + node.page_ids, best)
            visits.append(visit)
            stack.append(visit)
    return visits, out


def _check_shape(cache: CheckedTree, visits: list[_Visit]) -> list[Violation]:
    """I1 (depth and prefix hash of every node and checkpoint) and I6 (no tombstone leaves)."""
    out: list[Violation] = []
    root, ps = cache.root, cache.page_size
    if root.key or root.page_ids or root.checkpoint is not None or root.depth or root.prefix_hash != ROOT_PREFIX_HASH:
        out.append(Violation("I6", f"root was modified: {root}"))
    for node, token_ids, _, _ in visits[1:]:
        parent = node.parent
        assert parent is not None
        if not node.key or len(node.key) % ps or len(node.page_ids) != len(node.key) // ps:
            out.append(Violation("I1", f"{node}: edge of {len(node.key)} tokens, {len(node.page_ids)} pages"))
            continue
        if node.depth != len(token_ids) or node.prefix_hash != extend_prefix_hash(parent.prefix_hash, node.key, ps):
            out.append(Violation("I1", f"{node}: depth/hash do not match its path of {len(token_ids)} tokens"))
        ckpt = node.checkpoint
        if ckpt is not None and (ckpt.depth != node.depth or ckpt.prefix_hash != node.prefix_hash):
            out.append(Violation("I1", f"{node}: holds checkpoint of depth {ckpt.depth} with another prefix hash"))
        if node.is_leaf and ckpt is None:
            out.append(Violation("I6", f"{node}: leaf without a checkpoint (tombstone leaf)"))
        if not node.alive:
            out.append(Violation("I6", f"{node}: deleted node still linked"))
    return out


def _check_ownership(cache: CheckedTree, visits: list[_Visit]) -> list[Violation]:
    """I2 on the tree side: checkpoint slots owned by their node, pages in one node only."""
    out: list[Violation] = []
    slots: set[int] = set()
    pages: list[int] = []
    for node, *_ in visits[1:]:
        pages += node.page_ids
        if node.checkpoint is None:
            continue
        slot = node.checkpoint.slot
        owner = cache.ledger.owner_of(slot) if 0 < slot < cache.ledger.num_slots else None
        if slot in slots or owner != TreeOwner(node.node_id):
            out.append(Violation("I2", f"{node}: checkpoint slot {slot} owned by {owner} (or held twice)"))
        slots.add(slot)
    if cache.ledger.num_tree_owned != len(slots):
        out.append(
            Violation("I2", f"ledger has {cache.ledger.num_tree_owned} tree-owned slots, tree holds {len(slots)}")
        )
    if len(set(pages)) != len(pages) or set(pages) != cache._tree_pages:
        out.append(
            Violation(
                "I2",
                f"tree pages repeat or disagree with the page set ({len(pages)} listed, "
                f"{len(cache._tree_pages)} in the set)",
            )
        )
    free = [p for p in pages if not 0 < p < cache.page_allocator.size or cache.page_allocator.is_free(p)]
    if free:
        out.append(Violation("I2", f"tree holds pages that are free or out of range: {free}"))
    return out


def _check_locks(visits: list[_Visit]) -> list[Violation]:
    """I7: full lock = own locks + children's full locks; locked nodes hold checkpoints."""
    out: list[Violation] = []
    for node, *_ in visits:
        below = sum(child.full_lock for child in node.children.values())
        if node.mamba_lock < 0 or node.full_lock != node.mamba_lock + below:
            out.append(
                Violation("I7", f"{node}: full lock {node.full_lock} != own {node.mamba_lock} + children {below}")
            )
        if node.mamba_lock > 0 and node.is_tombstone:
            out.append(Violation("I7", f"{node}: locked but its checkpoint is gone"))
    return out


def _check_accounting(cache: CheckedTree, visits: list[_Visit]) -> list[Violation]:
    """I8: LRU membership and the evictable/protected sizes."""
    out: list[Violation] = []
    nodes = [v.node for v in visits[1:]]
    if {n.node_id: n for n in nodes} != cache._nodes:
        out.append(Violation("I8", f"node index has {len(cache._nodes)} entries, tree has {len(nodes)} nodes"))
    lru = list(cache._checkpoints)
    if {n.node_id for n in lru} != {n.node_id for n in nodes if n.checkpoint is not None}:
        out.append(Violation("I8", "checkpoint LRU is not exactly the nodes holding checkpoints"))
    if any(a.mamba_stamp > b.mamba_stamp for a, b in zip(lru, lru[1:])):
        out.append(Violation("I8", "checkpoint LRU is out of stamp order"))
    heap = {(stamp, node.node_id) for stamp, _, node in cache._leaves._heap}
    missing = [n for n in nodes if n.is_leaf and (n.full_stamp, n.node_id) not in heap]
    if missing:
        out.append(Violation("I8", f"leaves missing from the KV eviction heap: {missing}"))
    expected = (
        sum(len(n.page_ids) for n in nodes if n.full_lock == 0),
        sum(len(n.page_ids) for n in nodes if n.full_lock > 0),
        sum(1 for n in nodes if n.checkpoint is not None and n.mamba_lock == 0),
        sum(1 for n in nodes if n.checkpoint is not None and n.mamba_lock > 0),
    )
    actual = (
        cache.num_evictable_pages,
        cache.num_protected_pages,
        cache.num_evictable_checkpoints,
        cache.num_protected_checkpoints,
    )
    if expected != actual:
        out.append(Violation("I8", f"(evictable, protected) pages and checkpoints {actual} != recount {expected}"))
    return out


def _check_match(cache: CheckedTree, visits: list[_Visit]) -> list[Violation]:
    """I9: matching each node's path returns the deepest checkpoint on it, with its KV."""
    out: list[Violation] = []
    for node, token_ids, page_ids, best in visits[1:]:
        result = cache.peek(token_ids)
        good = (
            result.node is best
            and result.depth == best.depth
            and result.checkpoint is best.checkpoint
            and result.page_ids == page_ids[: best.depth // cache.page_size]
            and result.kv_depth == node.depth
        )
        if not good:
            out.append(
                Violation(
                    "I9",
                    f"match of {node}'s path returned {result.node} at depth {result.depth} "
                    f"(kv_depth {result.kv_depth}); expected {best}",
                )
            )
    return out

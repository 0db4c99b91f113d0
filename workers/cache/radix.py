"""The hybrid radix cache: KV pages per token page, Mamba checkpoints on some nodes."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from workers.cache.allocators import IdAllocator
from workers.cache.invariants import check_cache
from workers.cache.ledger import Owner, SlotLedger, TreeOwner
from workers.cache.lookup import find_path, plan_insert
from workers.cache.lru import CheckpointLru, LeafHeap
from workers.cache.node import ROOT_NODE_ID, TreeNode
from workers.cache.prefix_hash import ROOT_PREFIX_HASH
from workers.cache.records import (
    NOTHING_EVICTED,
    CacheEvent,
    Checkpoint,
    CheckpointEvicted,
    CheckpointInserted,
    EvictResult,
    Violation,
)
from workers.cache.results import InsertResult, MatchResult


class RadixCache:
    """Prefix tree over whole token pages for hybrid models. Pure bookkeeping: ints only.

    Keys. Only whole pages are cached: every method reads ``token_ids`` up to the last
    full page and ignores a trailing partial page (its KV page stays the caller's).
    Depths are therefore multiples of ``page_size``, and so are checkpoint depths.

    State (checked by ``check_invariants``):
    - I1: a node at depth d holds no checkpoint or one with ``depth == d`` and
      ``prefix_hash == H(path tokens)``.
    - I2: each checkpoint slot is ledger-owned by ``TreeOwner(node_id)`` of its node; each
      tree page is in exactly one node and not free in ``page_allocator``.
    - I6: every non-root leaf holds a checkpoint (a split leaves a tombstone *parent*;
      deleting a leaf deletes the tombstone ancestors it exposes); the root is never evicted.
    - I7: ``lock(node)`` adds a mamba lock on node and a full lock on it and every
      ancestor. Only the root or a node with a checkpoint may be locked, and a mamba-locked
      checkpoint is never dropped, so locked nodes are never tombstones.
    - I8: the checkpoint LRU holds exactly the non-root nodes with a checkpoint; the
      evictable/protected counters equal their recounts.
    - I9: ``match`` of any node's path returns the deepest checkpoint node on it.

    Methods and what they mutate:
    - ``match`` : LRU stamps only (full LRU on root..node, mamba LRU on the node). It never
      splits. ``peek`` is the same lookup without the stamps.
    - ``insert``: the tree (split, new leaf, a checkpoint attached), the ledger (checkpoint
      slot -> TreeOwner), tree page ownership (adopted pages). It validates everything first
      and raises before mutating: ValueError for malformed input (page count, alignment,
      depth, hash, pages that are free or already elsewhere in the tree, a checkpoint-less
      insert that would create a leaf), OwnershipError when the checkpoint slot is not
      request-owned, or has a pending writer and would be taken (check
      ``ledger.may_move`` first and count a skipped donation instead). It never frees:
      see ``InsertResult`` for who owns each page afterwards.
    - ``lock``/``unlock``: lock counts and evictable/protected sizes. Raise ValueError for
      a node not in the tree, a tombstone, or an unlock without a lock.
    - ``evict_kv``/``evict_checkpoints``/``flush``/``alloc_pages``/``alloc_slot_evicting``:
      free unlocked pages to ``page_allocator`` and unlocked checkpoint slots to the ledger.
      Locked nodes are never evicted; locked checkpoints never freed. Lock the matched node
      before evicting if you still need to read its checkpoint (COW source).
    ``on_event`` (optional) receives ``CheckpointInserted`` / ``CheckpointEvicted`` (tagged
    with ``tier``). ``on_drop`` (optional) is called with a node whose checkpoint eviction is
    about to free (the path and its slot are still intact): the host tier demotes it there.
    It must have finished reading the slot when it returns (the slot is freed next, and
    ``ledger.free`` raises while a reader is registered); ``flush`` never calls it.
    """

    def __init__(
        self,
        page_size: int,
        page_allocator: IdAllocator,
        ledger: SlotLedger,
        on_event: Callable[[CacheEvent], None] | None = None,
        on_drop: Callable[[TreeNode], None] | None = None,
        tier: str = "device",
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.page_allocator = page_allocator
        self.ledger = ledger
        self._on_event = on_event
        self._on_drop = on_drop
        self.tier = tier
        self.root = TreeNode(ROOT_NODE_ID, None, (), [], ROOT_PREFIX_HASH)
        self._next_node_id = ROOT_NODE_ID + 1
        self._clock = 0
        self._nodes: dict[int, TreeNode] = {}  # every live non-root node (the full LRU's members)
        self._tree_pages: set[int] = set()
        self._leaves = LeafHeap()
        self._checkpoints = CheckpointLru()
        self._evictable_pages = self._protected_pages = 0
        self._evictable_checkpoints = self._protected_checkpoints = 0

    # ---- sizes -------------------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        """Non-root nodes."""
        return len(self._nodes)

    @property
    def num_cached_pages(self) -> int:
        return len(self._tree_pages)

    @property
    def num_checkpoints(self) -> int:
        return len(self._checkpoints)

    @property
    def num_evictable_pages(self) -> int:
        return self._evictable_pages

    @property
    def num_protected_pages(self) -> int:
        return self._protected_pages

    @property
    def num_evictable_checkpoints(self) -> int:
        return self._evictable_checkpoints

    @property
    def num_protected_checkpoints(self) -> int:
        return self._protected_checkpoints

    def owns_page(self, page_id: int) -> bool:
        """Whether a KV page belongs to the tree (the caller must then not free it)."""
        return page_id in self._tree_pages

    def iter_nodes(self) -> Iterator[TreeNode]:
        """Every non-root node, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def path_page_ids(self, node: TreeNode) -> list[int]:
        """The tree's KV pages for [0, node.depth)."""
        pages: list[list[int]] = []
        while not node.is_root:
            pages.append(node.page_ids)
            node = node.parent  # type: ignore[assignment]
        return [p for chunk in reversed(pages) for p in chunk]

    def path_tokens(self, node: TreeNode) -> tuple[int, ...]:
        """The tokens [0, node.depth) of the node's path."""
        keys: list[tuple[int, ...]] = []
        while not node.is_root:
            keys.append(node.key)
            node = node.parent  # type: ignore[assignment]
        return tuple(t for key in reversed(keys) for t in key)

    # ---- lookup ------------------------------------------------------------------------
    def match(self, token_ids: Sequence[int]) -> MatchResult:
        """The deepest checkpoint on the path of ``token_ids``; refreshes its LRU stamps."""
        result = self.peek(token_ids)
        if not result.node.is_root:
            self._touch(result.node, mamba=True)
        return result

    def peek(self, token_ids: Sequence[int]) -> MatchResult:
        """``match`` without touching the LRU orders (read-only)."""
        walk = find_path(self.root, self._aligned(token_ids), self.page_size)
        best = -1
        for i, node in enumerate(walk.path):
            if node.checkpoint is not None:
                best = i
        page_ids = [p for node in walk.path[: best + 1] for p in node.page_ids]
        node = walk.path[best] if best >= 0 else self.root
        return MatchResult(node, node.depth, page_ids, node.checkpoint, walk.covered)

    # ---- insert ------------------------------------------------------------------------
    def insert(
        self, token_ids: Sequence[int], page_ids: Sequence[int], checkpoint: Checkpoint | None = None
    ) -> InsertResult:
        """Cache ``page_ids`` (one per whole page of ``token_ids``) and, optionally, the
        checkpoint for the state after all of ``token_ids`` (``checkpoint.depth ==
        len(token_ids)``). See the class docstring for what it raises; ``InsertResult``
        says who owns each page afterwards."""
        toks = self._aligned(token_ids)
        plan = plan_insert(self, toks, page_ids, checkpoint, len(token_ids))
        walk, covered = plan.walk, plan.walk.covered
        num_covered_pages = covered // self.page_size
        duplicates = [p for p, t in zip(page_ids[:num_covered_pages], plan.tree_page_ids) if p != t]
        path = list(walk.path)
        if walk.child is not None:
            assert plan.split_hash is not None
            path.append(self._split(walk.child, walk.partial, plan.split_hash))
        node = path[-1] if path else self.root
        num_new = 0
        if covered < len(toks):
            assert plan.leaf_hash is not None
            node = self._add_leaf(node, toks[covered:], list(page_ids[num_covered_pages:]), plan.leaf_hash)
            num_new = len(node.page_ids)
        inserted = duplicate = False
        if checkpoint is not None:
            duplicate = node.checkpoint is not None
            if not duplicate:
                self._attach(node, checkpoint, toks)
                inserted = True
        if not node.is_root:
            self._touch(node, mamba=checkpoint is not None)
        canonical = plan.tree_page_ids + list(page_ids[num_covered_pages:])
        return InsertResult(node, canonical, num_new, duplicates, inserted, duplicate)

    # ---- locks -------------------------------------------------------------------------
    def lock(self, node: TreeNode) -> None:
        """Protect ``node``'s checkpoint and the KV of its whole path from eviction."""
        self._check_member(node)
        if node.is_tombstone:
            raise ValueError(f"cannot lock tombstone {node}: lock a node with a checkpoint or the root")
        if node.mamba_lock == 0 and node.checkpoint is not None:
            self._evictable_checkpoints -= 1
            self._protected_checkpoints += 1
        node.mamba_lock += 1
        n: TreeNode | None = node
        while n is not None:
            if n.full_lock == 0:
                self._evictable_pages -= len(n.page_ids)
                self._protected_pages += len(n.page_ids)
            n.full_lock += 1
            n = n.parent

    def unlock(self, node: TreeNode) -> None:
        self._check_member(node)
        if node.mamba_lock == 0:
            raise ValueError(f"unlock of {node}, which holds no lock")
        node.mamba_lock -= 1
        if node.mamba_lock == 0 and node.checkpoint is not None:
            self._evictable_checkpoints += 1
            self._protected_checkpoints -= 1
        n: TreeNode | None = node
        while n is not None:
            n.full_lock -= 1
            if n.full_lock == 0:
                self._evictable_pages += len(n.page_ids)
                self._protected_pages -= len(n.page_ids)
            n = n.parent

    # ---- eviction ----------------------------------------------------------------------
    def evict_kv(self, num_pages: int) -> EvictResult:
        """Free at least ``num_pages`` KV pages if possible, least recently used unlocked
        leaves first (with their checkpoints and the tombstone ancestors they expose)."""
        freed = NOTHING_EVICTED
        while freed.num_pages < num_pages:
            leaf = self._leaves.pop_unlocked()
            if leaf is None:
                break
            freed = freed.plus(self._delete_leaf(leaf))
        self._leaves.restore()
        return freed

    def evict_checkpoints(self, num_checkpoints: int) -> EvictResult:
        """Free up to ``num_checkpoints`` checkpoint slots, least recently used unlocked
        first: an inner node becomes a tombstone (KV kept), a leaf is deleted."""
        freed = NOTHING_EVICTED
        while freed.num_checkpoints < num_checkpoints:
            node = self._checkpoints.oldest_unlocked()
            if node is None:
                break
            if node.is_leaf:
                freed = freed.plus(self._delete_leaf(node))
            else:
                self._drop_checkpoint(node)
                freed = freed.plus(EvictResult(0, 1))
        return freed

    def flush(self) -> EvictResult:
        """Drop everything unlocked (nothing is demoted); with nothing locked the tree ends empty."""
        on_drop, self._on_drop = self._on_drop, None
        try:
            freed = self.evict_checkpoints(self.num_evictable_checkpoints)
            # Every unlocked subtree ends in unlocked checkpoint leaves, so nothing is left here.
            freed = freed.plus(self.evict_kv(self.num_evictable_pages))
        finally:
            self._on_drop = on_drop
        self._leaves.maybe_compact(self._current_leaves(), self.num_nodes)
        return freed

    def alloc_pages(self, num_pages: int) -> list[int] | None:
        """``num_pages`` KV pages, evicting unlocked KV if needed; None if still short."""
        short = num_pages - self.page_allocator.num_free
        if short > 0:
            self.evict_kv(short)
        return self.page_allocator.alloc(num_pages)

    def alloc_slot_evicting(self, owner: Owner) -> int | None:
        """A Mamba slot for a mandatory use (the live slot), evicting checkpoints if needed.

        Optional checkpoint slots use ``ledger.alloc``, which never evicts.
        """
        slot = self.ledger.alloc(owner)
        while slot is None and self.evict_checkpoints(1).num_checkpoints > 0:
            slot = self.ledger.alloc(owner)
        return slot

    def check_invariants(self) -> list[Violation]:
        return check_cache(self)

    # ---- internals ---------------------------------------------------------------------
    def _aligned(self, token_ids: Sequence[int]) -> tuple[int, ...]:
        return tuple(token_ids[: len(token_ids) - len(token_ids) % self.page_size])

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _new_node(self, parent: TreeNode, key: tuple[int, ...], page_ids: list[int], digest: bytes) -> TreeNode:
        node = TreeNode(self._next_node_id, parent, key, page_ids, digest)
        self._next_node_id += 1
        self._nodes[node.node_id] = node
        parent.children[key[: self.page_size]] = node
        return node

    def _split(self, child: TreeNode, num_tokens: int, digest: bytes) -> TreeNode:
        """Cut ``child``'s edge after ``num_tokens``; the new upper node is a tombstone and
        ``child`` keeps its id, checkpoint and locks (a state cannot be split)."""
        parent, num_pages = child.parent, num_tokens // self.page_size
        assert parent is not None and 0 < num_tokens < len(child.key)
        mid = self._new_node(parent, child.key[:num_tokens], child.page_ids[:num_pages], digest)
        mid.full_lock, mid.full_stamp = child.full_lock, child.full_stamp
        child.key, child.page_ids, child.parent = child.key[num_tokens:], child.page_ids[num_pages:], mid
        mid.children[child.key[: self.page_size]] = child
        return mid  # same pages under the same lock state: sizes unchanged

    def _add_leaf(self, parent: TreeNode, key: tuple[int, ...], page_ids: list[int], digest: bytes) -> TreeNode:
        leaf = self._new_node(parent, key, page_ids, digest)
        self._tree_pages.update(page_ids)
        self._evictable_pages += len(page_ids)
        return leaf

    def _attach(self, node: TreeNode, checkpoint: Checkpoint, toks: tuple[int, ...]) -> None:
        moved = self.ledger.transfer(checkpoint.slot, TreeOwner(node.node_id))
        assert moved, f"slot {checkpoint.slot} refused after validation"
        assert node.mamba_lock == 0, node  # only nodes with checkpoints can be locked
        node.checkpoint = checkpoint
        self._checkpoints.add(node)
        self._evictable_checkpoints += 1
        if self._on_event is not None:
            self._on_event(CheckpointInserted(node.depth, node.prefix_hash, toks[: node.depth], self.tier))

    def _touch(self, node: TreeNode, mamba: bool) -> None:
        """Stamp root..node as just used in the full LRU (and the node in the mamba LRU)."""
        now = self._tick()
        n = node
        while not n.is_root:
            n.full_stamp = now
            n = n.parent  # type: ignore[assignment]
        if node.is_leaf:
            self._leaves.push(node)
            self._leaves.maybe_compact(self._current_leaves(), self.num_nodes)
        if mamba and node.checkpoint is not None:
            node.mamba_stamp = now
            self._checkpoints.touch(node)

    def _current_leaves(self) -> Iterator[TreeNode]:
        return (n for n in self._nodes.values() if n.is_leaf)

    def _check_member(self, node: TreeNode) -> None:
        if not (node is self.root or (node.alive and self._nodes.get(node.node_id) is node)):
            raise ValueError(f"{node} is not a node of this tree")

    def _drop_checkpoint(self, node: TreeNode) -> None:
        checkpoint = node.checkpoint
        assert checkpoint is not None and node.mamba_lock == 0, node
        if self._on_drop is not None:
            self._on_drop(node)
        self.ledger.free(checkpoint.slot)
        node.checkpoint = None
        self._checkpoints.remove(node)
        self._evictable_checkpoints -= 1
        if self._on_event is not None:
            self._on_event(CheckpointEvicted(node.depth, node.prefix_hash, self.path_tokens(node), self.tier))

    def _delete_leaf(self, leaf: TreeNode) -> EvictResult:
        """Delete an unlocked leaf, then each ancestor that becomes a tombstone leaf (I6)."""
        pages = checkpoints = 0
        node = leaf
        while True:
            assert node.is_leaf and node.full_lock == 0 and not node.is_root, node
            if node.checkpoint is not None:
                self._drop_checkpoint(node)
                checkpoints += 1
            pages += len(node.page_ids)
            parent = self._remove_node(node)
            if parent.is_root or not parent.is_leaf:
                break
            if parent.checkpoint is not None:
                self._leaves.push(parent)  # a new KV-eviction candidate
                break
            node = parent
        return EvictResult(pages, checkpoints)

    def _remove_node(self, node: TreeNode) -> TreeNode:
        parent = node.parent
        assert parent is not None
        self.page_allocator.free(node.page_ids)
        self._tree_pages.difference_update(node.page_ids)
        self._evictable_pages -= len(node.page_ids)
        del parent.children[node.key[: self.page_size]]
        del self._nodes[node.node_id]
        node.alive = False
        return parent

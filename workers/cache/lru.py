"""The two eviction orders of the hybrid radix tree.

- ``LeafHeap`` (full LRU): KV eviction takes the least recently used unlocked *leaf*. A
  min-heap of ``(full_stamp, node_id, node)`` with lazy deletion: an entry is current iff
  the node is alive, still a leaf, and its stamp is unchanged. The tree pushes a node
  whenever it becomes a leaf or a leaf's stamp changes; stale entries are skipped on pop
  and the heap is rebuilt when they outnumber the live nodes.
- ``CheckpointLru`` (mamba LRU): exactly the non-root nodes holding a checkpoint, oldest
  first; checkpoint eviction takes the oldest with no lock on the node itself.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable, Iterator

from workers.cache.node import TreeNode

_Entry = tuple[int, int, TreeNode]


class LeafHeap:
    def __init__(self) -> None:
        self._heap: list[_Entry] = []
        self._aside: list[TreeNode] = []  # locked leaves popped during one eviction

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, node: TreeNode) -> None:
        assert not node.is_root and node.is_leaf, node
        heapq.heappush(self._heap, (node.full_stamp, node.node_id, node))

    def pop_unlocked(self) -> TreeNode | None:
        """The oldest current unlocked leaf, removed from the heap; None when there is none.

        Locked leaves met on the way are held aside until ``restore`` (call it when the
        eviction ends), so one eviction pass does not rescan them.
        """
        while self._heap:
            stamp, _, node = heapq.heappop(self._heap)
            if not node.alive or not node.is_leaf or stamp != node.full_stamp:
                continue
            if node.full_lock > 0:
                self._aside.append(node)
                continue
            return node
        return None

    def restore(self) -> None:
        seen: set[int] = set()
        for node in self._aside:
            if node.alive and node.is_leaf and node.node_id not in seen:
                seen.add(node.node_id)
                self.push(node)
        self._aside.clear()

    def maybe_compact(self, leaves: Iterable[TreeNode], num_nodes: int) -> None:
        """Rebuild from the current leaves when stale entries dominate (amortised O(1))."""
        if len(self._heap) > 2 * num_nodes + 64:
            self._heap = [(n.full_stamp, n.node_id, n) for n in leaves]
            heapq.heapify(self._heap)


class CheckpointLru:
    def __init__(self) -> None:
        self._order: OrderedDict[int, TreeNode] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, node: TreeNode) -> bool:
        return node.node_id in self._order

    def __iter__(self) -> Iterator[TreeNode]:
        """Oldest first."""
        return iter(self._order.values())

    def add(self, node: TreeNode) -> None:
        assert node.node_id not in self._order, node
        self._order[node.node_id] = node

    def touch(self, node: TreeNode) -> None:
        self._order.move_to_end(node.node_id)

    def remove(self, node: TreeNode) -> None:
        del self._order[node.node_id]

    def oldest_unlocked(self) -> TreeNode | None:
        # Locked nodes are the running requests' matched nodes: few, so the skip is short.
        for node in self._order.values():
            if node.mamba_lock == 0:
                return node
        return None

"""Token-level index of the Mamba checkpoints each replica holds (pure Python, no Ray).

The router actor keeps one ``PrefixIndex`` for a deployment. Replicas feed it their
checkpoint insert/evict events; the router asks it, per request, how deep a usable
checkpoint each replica has for the prompt.

A radix tree over token ids, shared by all replicas: a node at depth ``d`` stands for the
token path [0, d) and ``owners`` are the replicas holding a checkpoint of exactly that
path. For a hybrid model only such a node is reusable: KV pages deeper than the deepest
checkpoint are useless without the recurrent state, so the index stores checkpoints and
nothing else.

Contract:
- ``insert`` / ``evict`` mutate the tree; evicting something unknown is a no-op (events
  can race a ``forget``). Nodes without owners and with at most one child are removed or
  merged, so the tree holds only branch points and checkpoints.
- ``match(tokens, max_depth)`` -> replica -> depth of its deepest checkpoint whose path
  is a prefix of ``tokens`` and that is at most ``max_depth`` deep. Read only.
- ``forget(replica)`` drops every checkpoint of a replica (it died or flushed its cache).
- Per replica at most ``max_checkpoints_per_replica`` entries; the oldest inserted goes
  first when that is exceeded (a guard against lost evict events, not a cache policy).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from workers.cache.records import CheckpointEvicted, CheckpointInserted


class _Node:
    __slots__ = ("edge", "children", "parent", "owners", "depth")

    def __init__(self, edge: tuple[int, ...], parent: _Node | None, depth: int) -> None:
        self.edge = edge  # tokens from the parent's depth to this depth
        self.children: dict[int, _Node] = {}  # keyed by the first token of the child's edge
        self.parent = parent
        self.owners: set[str] = set()
        self.depth = depth


class IndexSummary(NamedTuple):
    num_nodes: int
    checkpoints: dict[str, int]  # replica -> number of checkpoints held


class PrefixIndex:
    def __init__(self, max_checkpoints_per_replica: int = 1_000_000) -> None:
        self._root = _Node((), None, 0)
        self._nodes: dict[str, dict[_Node, None]] = {}  # replica -> its nodes, oldest first
        self._num_nodes = 1
        self._max_per_replica = max_checkpoints_per_replica

    # -- updates ------------------------------------------------------------------------
    def add_replica(self, replica: str) -> None:
        self._nodes.setdefault(replica, {})

    def insert(self, replica: str, token_ids: Sequence[int]) -> None:
        if not token_ids:
            return
        node = self._find_or_create(tuple(token_ids))
        mine = self._nodes.setdefault(replica, {})
        if replica in node.owners:
            mine.pop(node)  # refresh its age
        node.owners.add(replica)
        mine[node] = None
        while len(mine) > self._max_per_replica:
            self._drop(replica, next(iter(mine)))

    def evict(self, replica: str, token_ids: Sequence[int]) -> None:
        node = self._find_exact(tuple(token_ids))
        if node is not None and replica in node.owners:
            self._drop(replica, node)

    def apply(self, replica: str, events: Iterable[object]) -> int:
        """Apply engine cache events in order; returns how many were understood."""
        num = 0
        for event in events:
            if isinstance(event, CheckpointInserted):
                self.insert(replica, event.token_ids)
            elif isinstance(event, CheckpointEvicted):
                self.evict(replica, event.token_ids)
            else:
                continue
            num += 1
        return num

    def forget(self, replica: str) -> None:
        for node in list(self._nodes.pop(replica, {})):
            node.owners.discard(replica)
            self._prune(node)

    def clear(self, replica: str) -> None:
        """Forget a replica's checkpoints but keep it known (it flushed its cache)."""
        self.forget(replica)
        self._nodes[replica] = {}

    # -- queries ------------------------------------------------------------------------
    def match(
        self, token_ids: Sequence[int], max_depth: int | None = None, replicas: Iterable[str] | None = None
    ) -> dict[str, int]:
        """Replica -> deepest usable checkpoint depth (replicas asked for default to 0)."""
        limit = len(token_ids) if max_depth is None else min(max_depth, len(token_ids))
        best: dict[str, int] = dict.fromkeys(replicas, 0) if replicas is not None else {}
        wanted = set(best) if replicas is not None else None
        node, depth = self._root, 0
        while depth < limit:
            child = node.children.get(token_ids[depth])
            if child is None or child.depth > limit:
                break
            if tuple(token_ids[depth : child.depth]) != child.edge:
                break
            node, depth = child, child.depth
            for owner in node.owners:
                if wanted is None or owner in wanted:
                    best[owner] = depth
        return best

    def replicas(self) -> list[str]:
        return sorted(self._nodes)

    def num_checkpoints(self, replica: str) -> int:
        return len(self._nodes.get(replica, ()))

    def summary(self) -> IndexSummary:
        return IndexSummary(self._num_nodes, {r: len(n) for r, n in self._nodes.items()})

    # -- tree mechanics ------------------------------------------------------------------
    def _find_exact(self, tokens: tuple[int, ...]) -> _Node | None:
        node, depth = self._root, 0
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None or tokens[depth : child.depth] != child.edge:
                return None
            node, depth = child, child.depth
        return node if node is not self._root else None

    def _find_or_create(self, tokens: tuple[int, ...]) -> _Node:
        node, depth = self._root, 0
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None:
                leaf = _Node(tokens[depth:], node, len(tokens))
                node.children[tokens[depth]] = leaf
                self._num_nodes += 1
                return leaf
            common = _common_len(child.edge, tokens[depth:])
            if common < len(child.edge):
                child = self._split(child, common)
            node, depth = child, child.depth
        return node

    def _split(self, node: _Node, at: int) -> _Node:
        """Insert a node ``at`` tokens into ``node``'s edge; returns the new upper node."""
        parent = node.parent
        assert parent is not None and 0 < at < len(node.edge)
        upper = _Node(node.edge[:at], parent, parent.depth + at)
        parent.children[upper.edge[0]] = upper
        node.edge = node.edge[at:]
        node.parent = upper
        upper.children[node.edge[0]] = node
        self._num_nodes += 1
        return upper

    def _drop(self, replica: str, node: _Node) -> None:
        node.owners.discard(replica)
        self._nodes[replica].pop(node, None)
        self._prune(node)

    def _prune(self, node: _Node) -> None:
        """Remove ownerless leaves and merge ownerless single-child nodes, upwards."""
        while node is not self._root and not node.owners:
            parent = node.parent
            assert parent is not None
            if not node.children:
                del parent.children[node.edge[0]]
                self._num_nodes -= 1
                node = parent
                continue
            if len(node.children) == 1:
                (child,) = node.children.values()
                child.edge = node.edge + child.edge
                child.parent = parent
                parent.children[child.edge[0]] = child
                self._num_nodes -= 1
            return


def _common_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i

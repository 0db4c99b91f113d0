"""One node of the hybrid radix tree: an edge of whole token pages, its KV pages, and at
most one Mamba checkpoint for the state after exactly the node's depth."""

from __future__ import annotations

from workers.cache.records import Checkpoint

ROOT_NODE_ID = 0


class TreeNode:
    """Fields (read them freely; only ``RadixCache`` writes them):

    - ``key``: the edge's tokens, a non-empty multiple of page_size (empty for the root);
      ``page_ids[i]`` holds tokens ``key[i*page_size : (i+1)*page_size]``.
    - ``depth``: tokens from the root to the end of this edge; ``prefix_hash`` = H(depth).
    - ``checkpoint``: None for the root and for tombstones (KV kept, state evicted/split).
    - ``children``: keyed by the first page of the child's key.
    - ``mamba_lock``: locks taken on this node itself; ``full_lock``: locks on this node or
      any descendant (== mamba_lock + sum of the children's full_lock).
    - ``full_stamp`` / ``mamba_stamp``: logical clock of the last use, for the two LRUs.
    - ``node_id``: unique for the cache's lifetime (ids are never reused), so a
      ``TreeOwner(node_id)`` in the ledger cannot name a different, later node.
    """

    __slots__ = (
        "node_id",
        "parent",
        "key",
        "page_ids",
        "depth",
        "prefix_hash",
        "checkpoint",
        "children",
        "full_lock",
        "mamba_lock",
        "full_stamp",
        "mamba_stamp",
        "alive",
    )

    def __init__(
        self, node_id: int, parent: TreeNode | None, key: tuple[int, ...], page_ids: list[int], prefix_hash: bytes
    ) -> None:
        self.node_id: int = node_id
        self.parent: TreeNode | None = parent
        self.key: tuple[int, ...] = key
        self.page_ids: list[int] = page_ids
        self.depth: int = (parent.depth if parent is not None else 0) + len(key)
        self.prefix_hash: bytes = prefix_hash
        self.checkpoint: Checkpoint | None = None
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.full_lock: int = 0
        self.mamba_lock: int = 0
        self.full_stamp: int = 0
        self.mamba_stamp: int = 0
        self.alive: bool = True

    @property
    def is_root(self) -> bool:
        return self.node_id == ROOT_NODE_ID

    @property
    def is_leaf(self) -> bool:
        return not self.children

    @property
    def is_tombstone(self) -> bool:
        """A non-root node with KV but no checkpoint: walked through by match, never returned."""
        return not self.is_root and self.checkpoint is None

    def __repr__(self) -> str:
        ckpt = "-" if self.checkpoint is None else f"slot {self.checkpoint.slot}"
        return (
            f"TreeNode(id={self.node_id}, depth={self.depth}, pages={len(self.page_ids)}, "
            f"ckpt={ckpt}, locks={self.full_lock}/{self.mamba_lock})"
        )

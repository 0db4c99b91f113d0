"""Small immutable records the cache hands out: checkpoints, results, events, violations."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Union

from workers.cache.prefix_hash import prefix_hash

if TYPE_CHECKING:
    from workers.cache.node import TreeNode


@dataclass(frozen=True)
class Checkpoint:
    """A Mamba slot holding H(depth): the recurrent state after exactly tokens [0, depth).

    ``prefix_hash`` names that token path (see ``prefix_hash.py``); ``batch_id`` is the
    batch whose forward wrote the state. I1: only a node at depth ``depth`` whose path
    hashes to ``prefix_hash`` may hold it.
    """

    slot: int
    depth: int
    prefix_hash: bytes
    batch_id: int

    @classmethod
    def for_tokens(cls, slot: int, token_ids: Sequence[int], page_size: int, batch_id: int) -> Checkpoint:
        """The checkpoint for the state after all of ``token_ids`` (whole pages only)."""
        return cls(slot, len(token_ids), prefix_hash(token_ids, page_size), batch_id)


class Violation(NamedTuple):
    """One broken invariant: ``invariant`` is its id (``"I1"`` .. ``"I10"``)."""

    invariant: str
    message: str


class MatchResult(NamedTuple):
    """What a lookup found.

    ``node`` is the deepest node on the token path that holds a checkpoint (the root when
    there is none); ``depth`` is its depth (0 = no hit) and ``page_ids`` the tree's KV pages
    for [0, depth). ``kv_depth`` >= ``depth`` is how far the KV path matched (page
    aligned); the engine places a branch-point checkpoint there.
    """

    node: TreeNode
    depth: int
    page_ids: list[int]
    checkpoint: Checkpoint | None
    kv_depth: int


class InsertResult(NamedTuple):
    """What an insert did with the caller's pages and checkpoint.

    Every caller page ``page_ids_in[i]`` ends up exactly one of:
    - equal to the tree's page at that position (it already was the tree's; nothing moved),
    - adopted: it is now owned by the tree (``num_new_pages`` of these),
    - a duplicate: the tree already had a different page there; it is listed in
      ``duplicate_page_ids`` and STILL OWNED BY THE CALLER, who frees it once no in-flight
      batch reads it.
    ``page_ids`` are the tree's pages for [0, depth): the request's page table should
    switch to them. ``checkpoint_inserted``: the slot now belongs to the tree.
    ``duplicate_checkpoint``: the node already held one; the caller's slot was not taken.
    """

    node: TreeNode
    page_ids: list[int]
    num_new_pages: int
    duplicate_page_ids: list[int]
    checkpoint_inserted: bool
    duplicate_checkpoint: bool


class EvictResult(NamedTuple):
    """What an eviction freed: KV pages and checkpoint slots returned to their free lists."""

    num_pages: int
    num_checkpoints: int

    def plus(self, other: EvictResult) -> EvictResult:
        # Not __add__: NamedTuple + concatenates tuples.
        return EvictResult(self.num_pages + other.num_pages, self.num_checkpoints + other.num_checkpoints)


NOTHING_EVICTED = EvictResult(0, 0)


@dataclass(frozen=True)
class CheckpointInserted:
    """The tree now holds a checkpoint for ``token_ids`` (length ``depth``)."""

    depth: int
    prefix_hash: bytes
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class CheckpointEvicted:
    """The tree dropped its checkpoint for ``token_ids`` (tombstoned or deleted)."""

    depth: int
    prefix_hash: bytes
    token_ids: tuple[int, ...]


CacheEvent = Union[CheckpointInserted, CheckpointEvicted]

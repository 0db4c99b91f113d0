"""What lookups and inserts return: records that name tree nodes."""

from __future__ import annotations

from typing import NamedTuple

from workers.cache.node import TreeNode
from workers.cache.records import Checkpoint


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

"""Read-only analysis of a token path against the tree: the walk ``match`` and ``insert``
share, and the validation an insert passes before it mutates anything."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

from workers.cache.allocators import IdAllocator
from workers.cache.ledger import OwnershipError, RequestOwner, SlotLedger
from workers.cache.node import TreeNode
from workers.cache.prefix_hash import ROOT_PREFIX_HASH, extend_prefix_hash
from workers.cache.records import Checkpoint


class TreeStore(Protocol):
    """What an insert's validation reads of the tree (``RadixCache`` is one)."""

    page_size: int
    root: TreeNode
    page_allocator: IdAllocator
    ledger: SlotLedger

    def owns_page(self, page_id: int) -> bool: ...


class Walk(NamedTuple):
    path: list[TreeNode]  # fully matched non-root nodes, root side first
    pos: int  # tokens covered by ``path`` (its last node's depth, or 0)
    child: TreeNode | None  # the node whose edge matched only in part, if any
    partial: int  # tokens of ``child``'s edge matched: 0 < partial < len(child.key), else 0

    @property
    def covered(self) -> int:
        """Tokens of the query that the tree's KV path covers (page aligned)."""
        return self.pos + self.partial


class InsertPlan(NamedTuple):
    walk: Walk
    tree_page_ids: list[int]  # the tree's pages over the covered prefix [0, walk.covered)
    split_hash: bytes | None  # H(walk.covered) when the walk stops inside an edge
    leaf_hash: bytes | None  # H(len) when the insert adds a new leaf


def find_path(root: TreeNode, toks: tuple[int, ...], page_size: int) -> Walk:
    """Follow ``toks`` (whole pages) down from ``root`` as far as the edges agree."""
    node, pos = root, 0
    path: list[TreeNode] = []
    while pos < len(toks):
        child = node.children.get(toks[pos : pos + page_size])
        if child is None:
            break
        n = _common_len(child.key, toks, pos, page_size)
        if n < len(child.key):
            return Walk(path, pos, child, n)
        path.append(child)
        pos += n
        node = child
    return Walk(path, pos, None, 0)


def _common_len(key: tuple[int, ...], toks: tuple[int, ...], pos: int, page_size: int) -> int:
    """Tokens of ``key`` matching ``toks[pos:]``, rounded down to whole pages."""
    m = min(len(key), len(toks) - pos)
    if key[:m] == toks[pos : pos + m]:
        return m
    i = 0
    while key[i] == toks[pos + i]:
        i += 1
    return i - i % page_size


def plan_insert(
    cache: TreeStore, toks: tuple[int, ...], page_ids: Sequence[int], checkpoint: Checkpoint | None, num_tokens: int
) -> InsertPlan:
    """Validate an insert and precompute what it needs, without mutating anything.

    Raises as documented on ``RadixCache``; ``num_tokens`` is the caller's length before
    the trailing partial page was dropped (a checkpoint must cover exactly that many).
    """
    ps = cache.page_size
    if len(page_ids) != len(toks) // ps:
        raise ValueError(
            f"insert of {num_tokens} tokens ({len(toks) // ps} whole pages of {ps}) got {len(page_ids)} page ids"
        )
    w = find_path(cache.root, toks, ps)
    tree_page_ids = [p for node in w.path for p in node.page_ids]
    base_hash = w.path[-1].prefix_hash if w.path else ROOT_PREFIX_HASH
    split_hash = None
    if w.child is not None:
        tree_page_ids += w.child.page_ids[: w.partial // ps]
        split_hash = base_hash = extend_prefix_hash(base_hash, w.child.key[: w.partial], ps)
    leaf_hash = extend_prefix_hash(base_hash, toks[w.covered :], ps) if w.covered < len(toks) else None
    _validate_pages(cache, page_ids, tree_page_ids)
    if checkpoint is None:
        if w.covered < len(toks):
            raise ValueError(
                f"insert without a checkpoint would end in a new leaf at depth {len(toks)} "
                f"(tree covers {w.covered} tokens); leaves must hold checkpoints (I6)"
            )
    else:
        existing = w.path[-1].checkpoint if w.path and w.child is None else None
        end_hash = leaf_hash if leaf_hash is not None else base_hash
        _validate_checkpoint(
            cache, checkpoint, num_tokens, len(toks), end_hash, taken=existing is None or w.covered < len(toks)
        )
    return InsertPlan(w, tree_page_ids, split_hash, leaf_hash)


def _validate_pages(cache: TreeStore, page_ids: Sequence[int], tree_page_ids: list[int]) -> None:
    if len(set(page_ids)) != len(page_ids):
        raise ValueError(f"insert page ids repeat: {list(page_ids)}")
    allocator = cache.page_allocator
    for i, page in enumerate(page_ids):
        if i < len(tree_page_ids) and page == tree_page_ids[i]:
            continue  # already the tree's page at this position
        if cache.owns_page(page):
            raise ValueError(f"page {page} at position {i} is already the tree's elsewhere")
        if not 0 < page < allocator.size or allocator.is_free(page):
            raise ValueError(f"page {page} at position {i} is not an allocated KV page")


def _validate_checkpoint(
    cache: TreeStore, checkpoint: Checkpoint, num_tokens: int, aligned_len: int, end_hash: bytes, taken: bool
) -> None:
    if checkpoint.depth != num_tokens or num_tokens != aligned_len or num_tokens == 0:
        raise ValueError(
            f"checkpoint depth {checkpoint.depth} must equal the insert length "
            f"{num_tokens}, a non-zero multiple of page_size {cache.page_size}"
        )
    if checkpoint.prefix_hash != end_hash:
        raise ValueError(
            f"I1: checkpoint in slot {checkpoint.slot} (depth {checkpoint.depth}) "
            f"carries a prefix hash that does not match the inserted tokens"
        )
    owner = cache.ledger.owner_of(checkpoint.slot)
    if not isinstance(owner, RequestOwner):
        raise OwnershipError(f"checkpoint slot {checkpoint.slot} is owned by {owner}, not a request")
    if taken and not cache.ledger.may_move(checkpoint.slot):
        raise OwnershipError(
            f"checkpoint slot {checkpoint.slot} has pending writers "
            f"{sorted(cache.ledger.writers_of(checkpoint.slot))}; check may_move first"
        )

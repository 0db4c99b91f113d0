"""Chained prefix hashes over token pages: H(d) names the token path [0, d).

H(0) is a fixed root digest; H(d + page_size) = blake2b(H(d) || page tokens as int64). A
tree node at depth d therefore computes its hash from its parent's hash and its own edge
pages only, and a checkpoint carries H(depth) so that I1 (a node at depth d holds H(d) or
nothing) is checkable without trusting anyone's labels. The chain is defined per page,
so hashes are only comparable between caches with the same page size.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

DIGEST_SIZE = 16
ROOT_PREFIX_HASH: bytes = hashlib.blake2b(b"hybridserve/prefix-hash/v1", digest_size=DIGEST_SIZE).digest()


def extend_prefix_hash(parent_hash: bytes, token_ids: Sequence[int], page_size: int) -> bytes:
    """H(d + len(token_ids)) from H(d), one chain link per page; len must be a page multiple."""
    if page_size < 1 or len(token_ids) % page_size:
        raise ValueError(f"need whole pages: {len(token_ids)} tokens with page_size {page_size}")
    digest = parent_hash
    for start in range(0, len(token_ids), page_size):
        link = hashlib.blake2b(digest, digest_size=DIGEST_SIZE)
        link.update(array("q", token_ids[start : start + page_size]).tobytes())
        digest = link.digest()
    return digest


def prefix_hash(token_ids: Sequence[int], page_size: int) -> bytes:
    """H(len(token_ids)); ``token_ids`` must be whole pages (the tree never stores partial ones)."""
    return extend_prefix_hash(ROOT_PREFIX_HASH, token_ids, page_size)


def prefix_hash_chain(token_ids: Sequence[int], page_size: int) -> list[bytes]:
    """[H(page_size), H(2 page_size), ...] over the whole pages of ``token_ids`` (a trailing
    partial page is ignored): the keys a checkpoint store is looked up with."""
    chain, digest = [], ROOT_PREFIX_HASH
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        digest = extend_prefix_hash(digest, token_ids[start : start + page_size], page_size)
        chain.append(digest)
    return chain

"""Prefix cache bookkeeping for hybrid Mamba/attention models (pure Python, no tensors).

- ``SlotLedger``: owner and pending writers of every Mamba slot (``ledger.py``).
- ``RadixCache``: the hybrid radix tree of KV pages and Mamba checkpoints (``radix.py``).
- ``prefix_hash``: the chained page hash that labels checkpoints (``prefix_hash.py``).
"""

from __future__ import annotations

from workers.cache.ledger import (
    Owner,
    OwnershipError,
    RequestOwner,
    SlotContent,
    SlotCounts,
    SlotLedger,
    SlotRole,
    TreeOwner,
)
from workers.cache.node import TreeNode
from workers.cache.prefix_hash import ROOT_PREFIX_HASH, extend_prefix_hash, prefix_hash
from workers.cache.radix import RadixCache
from workers.cache.records import CacheEvent, Checkpoint, CheckpointEvicted, CheckpointInserted, EvictResult, Violation
from workers.cache.results import InsertResult, MatchResult

__all__ = [
    "CacheEvent",
    "Checkpoint",
    "CheckpointEvicted",
    "CheckpointInserted",
    "EvictResult",
    "InsertResult",
    "MatchResult",
    "Owner",
    "OwnershipError",
    "RadixCache",
    "ROOT_PREFIX_HASH",
    "RequestOwner",
    "SlotContent",
    "SlotCounts",
    "SlotLedger",
    "SlotRole",
    "TreeNode",
    "TreeOwner",
    "Violation",
    "extend_prefix_hash",
    "prefix_hash",
]

"""The cluster-wide checkpoint store's index, as a plain class (no Ray; tested directly).

Entries are keyed by the prefix-hash chain (``workers/cache/prefix_hash.py``): a checkpoint
at depth d is stored under H(d), and a lookup sends the chain H(page), H(2 page), ... of
a prompt and gets the deepest key present. An entry holds an opaque reference to the
payload (a Ray ``ObjectRef`` owned by the store's actor, or the payload itself in-process),
its size, depth and token path (for the router index), and who committed it.

Budget: ``budget_bytes`` over all entries; a commit that would exceed it evicts least
recently used entries (lookups that hit refresh an entry) until it fits; an entry larger
than the whole budget is refused. Dropping an entry drops the store's reference: with
Ray, the object is freed once no fetch holds it. ``drop`` is also how a fetcher reports an
object that was lost (its node died): the entry goes, and the prompt is recomputed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple


@dataclass(frozen=True)
class StoreEntry:
    key: bytes
    depth: int
    token_ids: tuple[int, ...]
    nbytes: int
    ref: Any
    owner: str  # the replica that committed it


class StoreHit(NamedTuple):
    key: bytes
    depth: int
    nbytes: int
    ref: Any


class CommitResult(NamedTuple):
    outcome: str  # committed | duplicate | too_big
    evicted: list[StoreEntry]


class CheckpointStore:
    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"cache.cluster_store_bytes must be > 0 for a store, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[bytes, StoreEntry] = OrderedDict()  # LRU first
        self.num_bytes = 0
        self.num_evictions = 0

    @property
    def num_objects(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def commit(self, entry: StoreEntry) -> CommitResult:
        if entry.key in self._entries:
            self._entries.move_to_end(entry.key)
            return CommitResult("duplicate", [])
        if entry.nbytes > self.budget_bytes:
            return CommitResult("too_big", [])
        evicted = []
        while self.num_bytes + entry.nbytes > self.budget_bytes:
            _, old = self._entries.popitem(last=False)
            self.num_bytes -= old.nbytes
            self.num_evictions += 1
            evicted.append(old)
        self._entries[entry.key] = entry
        self.num_bytes += entry.nbytes
        return CommitResult("committed", evicted)

    def lookup(self, chain: Sequence[bytes], min_depth: int = 0) -> StoreHit | None:
        """The deepest entry whose key is in ``chain`` (root side first) and deeper than
        ``min_depth``; refreshes it."""
        for key in reversed(chain):
            entry = self._entries.get(key)
            if entry is not None:
                if entry.depth <= min_depth:
                    return None
                self._entries.move_to_end(key)
                return StoreHit(key, entry.depth, entry.nbytes, entry.ref)
        return None

    def missing(self, keys: Sequence[bytes]) -> list[bytes]:
        return [k for k in keys if k not in self._entries]

    def drop(self, key: bytes) -> StoreEntry | None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.num_bytes -= entry.nbytes
        return entry

    def clear(self) -> list[StoreEntry]:
        out = list(self._entries.values())
        self._entries.clear()
        self.num_bytes = 0
        return out

    def entries(self) -> list[StoreEntry]:
        return list(self._entries.values())

    def stats(self) -> dict[str, float]:
        """Gauges and counters in ``workers.stats`` names (STORE_GAUGES, STORE_COUNTERS)."""
        return {
            "hybridserve_store_objects": self.num_objects,
            "hybridserve_store_bytes": self.num_bytes,
            "hybridserve_store_evictions_total": self.num_evictions,
        }

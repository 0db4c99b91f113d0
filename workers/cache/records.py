"""Small immutable records the cache hands out: checkpoints, evictions, events, violations.

Nothing here refers to tree nodes (results that do live in ``results.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Union

from workers.cache.prefix_hash import prefix_hash


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


class EvictResult(NamedTuple):
    """What an eviction freed: KV pages and checkpoint slots returned to their free lists."""

    num_pages: int
    num_checkpoints: int

    def plus(self, other: EvictResult) -> EvictResult:
        # Not __add__: NamedTuple + concatenates tuples.
        return EvictResult(self.num_pages + other.num_pages, self.num_checkpoints + other.num_checkpoints)


NOTHING_EVICTED = EvictResult(0, 0)


TIERS = ("device", "host", "store")  # where a checkpoint lives (events and metrics say which)


@dataclass(frozen=True)
class CheckpointInserted:
    """The ``tier``'s tree now holds a checkpoint for ``token_ids`` (length ``depth``)."""

    depth: int
    prefix_hash: bytes
    token_ids: tuple[int, ...]
    tier: str = "device"


@dataclass(frozen=True)
class CheckpointEvicted:
    """The ``tier``'s tree dropped its checkpoint for ``token_ids`` (tombstoned or deleted)."""

    depth: int
    prefix_hash: bytes
    token_ids: tuple[int, ...]
    tier: str = "device"


CacheEvent = Union[CheckpointInserted, CheckpointEvicted]

"""The router actor: a thin ``ray.remote`` wrapper over the app's tiered prefix index.

Three ``PrefixIndex``es, one per tier (events say which, ``CheckpointInserted.tier``):
what each replica holds on its device, what it holds in its host tier, and what the
cluster store holds (one owner, ``store``: any replica can fetch it). Replicas call
``apply`` with batches of their checkpoint events (an empty batch is a heartbeat; the
store's events come through the replica that committed or found them lost); routers call
``match`` per request and ``forget`` when Serve tells them a replica is gone. A replica
that has not sent anything for ``forget_after_s`` is dropped too (covers replicas that
died while no router was watching); the store tier is never expired (the store outlives
replicas). Methods run one at a time.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import ray

from cluster.routing.prefix_index import PrefixIndex

STORE_OWNER = "store"


class MatchReport(NamedTuple):
    depths: dict[str, int]  # replica -> deepest usable checkpoint depth on its device
    sizes: dict[str, int]  # replica -> checkpoints indexed (device)
    host_depths: dict[str, int] = {}  # replica -> ... in its host tier
    store_depth: int = 0  # the cluster store's deepest usable checkpoint


class RouterIndexState:
    """The actor's state as a plain class (tested without Ray)."""

    def __init__(self, forget_after_s: float = 30.0, clock: Any = time.monotonic) -> None:
        self.index = PrefixIndex()
        self.host_index = PrefixIndex()
        self.store_index = PrefixIndex()
        self.forget_after_s = forget_after_s
        self._clock = clock
        self._last_seen: dict[str, float] = {}
        self.num_events = 0

    def apply(self, replica_id: str, events: Sequence[object]) -> int:
        self._last_seen[replica_id] = self._clock()
        self.index.add_replica(replica_id)
        by_tier: dict[str, list[object]] = {"device": [], "host": [], "store": []}
        for event in events:
            by_tier.get(getattr(event, "tier", "device"), by_tier["device"]).append(event)
        n = self.index.apply(replica_id, by_tier["device"])
        n += self.host_index.apply(replica_id, by_tier["host"])
        n += self.store_index.apply(STORE_OWNER, by_tier["store"])
        self.num_events += n
        return n

    def clear(self, replica_id: str) -> None:
        self._last_seen[replica_id] = self._clock()
        self.index.clear(replica_id)
        self.host_index.clear(replica_id)

    def clear_store(self) -> None:
        self.store_index.clear(STORE_OWNER)

    def forget(self, replica_ids: Sequence[str]) -> None:
        for rid in replica_ids:
            self._last_seen.pop(rid, None)
            self.index.forget(rid)
            self.host_index.forget(rid)

    def match(self, token_ids: Sequence[int], replica_ids: Sequence[str], max_depth: int) -> MatchReport:
        self.expire()
        depths = self.index.match(token_ids, max_depth, replica_ids)
        sizes = {rid: self.index.num_checkpoints(rid) for rid in replica_ids}
        host = self.host_index.match(token_ids, max_depth, replica_ids)
        store = self.store_index.match(token_ids, max_depth, [STORE_OWNER])[STORE_OWNER]
        return MatchReport(depths, sizes, host, store)

    def replicas(self) -> list[str]:
        self.expire()
        return sorted(self._last_seen)

    def expire(self) -> list[str]:
        now = self._clock()
        dead = [rid for rid, seen in self._last_seen.items() if now - seen > self.forget_after_s]
        self.forget(dead)
        return dead

    def summary(self) -> dict[str, Any]:
        s = self.index.summary()
        return {
            "num_nodes": s.num_nodes,
            "checkpoints": s.checkpoints,
            "num_events": self.num_events,
            "replicas": self.replicas(),
            "host_checkpoints": self.host_index.summary().checkpoints,
            "store_checkpoints": self.store_index.num_checkpoints(STORE_OWNER),
        }


@ray.remote(num_cpus=0)
class RouterIndexActor:
    def __init__(self, forget_after_s: float = 30.0) -> None:
        self._state = RouterIndexState(forget_after_s)

    def apply(self, replica_id: str, events: list[object]) -> int:
        return self._state.apply(replica_id, events)

    def clear(self, replica_id: str) -> None:
        self._state.clear(replica_id)

    def clear_store(self) -> None:
        self._state.clear_store()

    def forget(self, replica_ids: list[str]) -> None:
        self._state.forget(replica_ids)

    def match(self, token_ids: list[int], replica_ids: list[str], max_depth: int) -> MatchReport:
        return self._state.match(token_ids, replica_ids, max_depth)

    def replicas(self) -> list[str]:
        return self._state.replicas()

    def summary(self) -> dict[str, Any]:
        return self._state.summary()

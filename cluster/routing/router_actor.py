"""The router actor: a thin ``ray.remote`` wrapper over one ``PrefixIndex`` per app.

Replicas call ``apply`` with batches of their checkpoint events (an empty batch is a
heartbeat); routers call ``match`` per request and ``forget`` when Serve tells them a
replica is gone. A replica that has not sent anything for ``forget_after_s`` is dropped
too (covers replicas that died while no router was watching). Methods run one at a time.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import ray

from cluster.routing.prefix_index import PrefixIndex


class MatchReport(NamedTuple):
    depths: dict[str, int]                # replica -> deepest usable checkpoint depth
    sizes: dict[str, int]                 # replica -> checkpoints indexed


class RouterIndexState:
    """The actor's state as a plain class (tested without Ray)."""

    def __init__(self, forget_after_s: float = 30.0, clock: Any = time.monotonic) -> None:
        self.index = PrefixIndex()
        self.forget_after_s = forget_after_s
        self._clock = clock
        self._last_seen: dict[str, float] = {}
        self.num_events = 0

    def apply(self, replica_id: str, events: Sequence[object]) -> int:
        self._last_seen[replica_id] = self._clock()
        self.index.add_replica(replica_id)
        n = self.index.apply(replica_id, events)
        self.num_events += n
        return n

    def clear(self, replica_id: str) -> None:
        self._last_seen[replica_id] = self._clock()
        self.index.clear(replica_id)

    def forget(self, replica_ids: Sequence[str]) -> None:
        for rid in replica_ids:
            self._last_seen.pop(rid, None)
            self.index.forget(rid)

    def match(self, token_ids: Sequence[int], replica_ids: Sequence[str], max_depth: int) -> MatchReport:
        self.expire()
        depths = self.index.match(token_ids, max_depth, replica_ids)
        sizes = {rid: self.index.num_checkpoints(rid) for rid in replica_ids}
        return MatchReport(depths, sizes)

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
        return {"num_nodes": s.num_nodes, "checkpoints": s.checkpoints, "num_events": self.num_events,
                "replicas": self.replicas()}


@ray.remote(num_cpus=0)
class RouterIndexActor:
    def __init__(self, forget_after_s: float = 30.0) -> None:
        self._state = RouterIndexState(forget_after_s)

    def apply(self, replica_id: str, events: list[object]) -> int:
        return self._state.apply(replica_id, events)

    def clear(self, replica_id: str) -> None:
        self._state.clear(replica_id)

    def forget(self, replica_ids: list[str]) -> None:
        self._state.forget(replica_ids)

    def match(self, token_ids: list[int], replica_ids: list[str], max_depth: int) -> MatchReport:
        return self._state.match(token_ids, replica_ids, max_depth)

    def replicas(self) -> list[str]:
        return self._state.replicas()

    def summary(self) -> dict[str, Any]:
        return self._state.summary()

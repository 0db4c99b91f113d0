"""The cluster store on Ray: a named, detached actor over ``CheckpointStore`` (Ray edge).

The actor outlives every replica (detached, named after the app, like the router index
and metrics actors; ``cluster/actors.py`` places all three on the head node when it can).
It holds an ``ObjectRef`` per entry, and it creates every one itself: a replica sends the
payload as the argument of ``commit`` and the actor ``ray.put``s it, so the actor owns
the object and its bytes live in the object store of the actor's node. A replica that dies
-- or its whole node -- loses nothing it committed (Ray ties an object's life to its
owner's, and since Ray 2.56 ``ray.put`` cannot name another owner). Should an object
still become unreadable (the store's node died and the actor was restarted elsewhere, say),
a fetch raises, the fetcher drops the entry (``drop``) and recomputes. Every second the
actor pushes its gauges (objects, bytes) and evictions to the metrics actor as the series
``replica="store"``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

import ray

from cluster.store.checkpoint_store import CheckpointStore, CommitResult, StoreEntry, StoreHit
from cluster.store.client import StoreObjectLost
from workers.tiers.payload import CheckpointPayload

logger = logging.getLogger(__name__)


@ray.remote(num_cpus=0)
class CheckpointStoreActor:
    def __init__(self, budget_bytes: int, model: str = "", metrics: Any = None, push_interval_s: float = 1.0) -> None:
        self._store = CheckpointStore(budget_bytes)
        self._lock = threading.Lock()
        self._model, self._metrics = model, metrics
        if metrics is not None:
            threading.Thread(target=self._push_forever, args=(push_interval_s,), daemon=True).start()

    def lookup(self, chain: list[bytes], min_depth: int) -> StoreHit | None:
        with self._lock:
            return self._store.lookup(chain, min_depth)

    def missing(self, keys: list[bytes]) -> list[bytes]:
        with self._lock:
            return self._store.missing(keys)

    def commit(self, payload: CheckpointPayload, owner: str) -> CommitResult:
        """Own a copy of ``payload`` in the object store and index it under its prefix hash."""
        with self._lock:
            if payload.prefix_hash in self._store:
                return self._store.commit(StoreEntry(payload.prefix_hash, payload.depth, (), 0, None, owner))
        ref = ray.put(payload)  # owned by this actor, stored on its node
        with self._lock:
            result = self._store.commit(
                StoreEntry(payload.prefix_hash, payload.depth, payload.token_ids, payload.nbytes, ref, owner)
            )
        return CommitResult(
            result.outcome, [StoreEntry(e.key, e.depth, e.token_ids, e.nbytes, None, e.owner) for e in result.evicted]
        )

    def drop(self, key: bytes) -> bool:
        with self._lock:
            return self._store.drop(key) is not None

    def clear(self) -> int:
        with self._lock:
            return len(self._store.clear())

    def summary(self) -> dict[str, Any]:
        with self._lock:
            entries = self._store.entries()
            return {
                **self._store.stats(),
                "budget_bytes": self._store.budget_bytes,
                "node_id": ray.get_runtime_context().get_node_id(),
                "owners": sorted({e.owner for e in entries}),
                "entries": [(e.key, e.depth, e.owner) for e in entries],
            }

    def _push_forever(self, interval_s: float) -> None:
        while True:
            time.sleep(interval_s)
            with self._lock:
                snapshot = self._store.stats()
            try:
                self._metrics.push_replica.remote(self._model, "store", snapshot, {})
            except Exception:  # noqa: BLE001 - metrics must never break the store
                logger.debug("store metrics push failed", exc_info=True)


class RayStoreBackend:
    """``StoreBackend`` over the store actor and Ray's object store."""

    def __init__(self, actor: Any, timeout_s: float = 10.0) -> None:
        self.actor = actor
        self.timeout_s = timeout_s

    async def lookup(self, chain: list[bytes], min_depth: int) -> StoreHit | None:
        return await self.actor.lookup.remote(chain, min_depth)

    async def get(self, ref: Any) -> Any:
        try:
            return await asyncio.wait_for(ref, self.timeout_s)
        except (ray.exceptions.RayError, asyncio.TimeoutError) as exc:
            raise StoreObjectLost(f"store object unreadable: {type(exc).__name__}") from exc

    async def missing(self, keys: list[bytes]) -> list[bytes]:
        return await self.actor.missing.remote(keys)

    async def commit(self, payload: CheckpointPayload, owner: str) -> CommitResult:
        return await self.actor.commit.remote(payload, owner)

    async def drop(self, key: bytes) -> None:
        await self.actor.drop.remote(key)

    async def clear(self) -> None:
        await self.actor.clear.remote()

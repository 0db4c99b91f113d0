"""A replica's side of the cluster store: fetch before admission, commit after demotion.

``StoreClient`` is Ray-free; it talks to a ``StoreBackend`` (``actor.RayStoreBackend``:
the named store actor and Ray's object store; ``LocalStoreBackend``: a ``CheckpointStore``
in this process, for tests and the in-process benchmarks) and to its engine through the
``EngineLoop`` (every engine call on the engine thread).

Fetch (``prefetch``, before a request is queued): the engine's local depth (device or
host) against the deepest store entry on the prompt's prefix-hash chain. When the store is
deeper, ``workers/tiers/cost.FetchCost`` weighs the entry's bytes (at the measured fetch
bandwidth) against prefill of the missing tokens (at the engine's measured forward
throughput); a fetch is validated and placed in the host tier by the engine
(``import_checkpoint``), from where admission promotes it -- so ``usage.cached_tokens``
says whether the fetch happened. A lost entry is dropped and the next deepest one on the
chain is tried (``MAX_LOOKUPS`` in all). Outcomes are counted in
``hybridserve_store_fetches_total{outcome}``: fetched, recomputed (the cost model chose
prefill), present (already local), lost (the object's node died: the entry is dropped),
invalid (it failed validation), host_full (no room in the host tier even after its own
eviction), error (anything else; the request just runs).

Commit (``commit_pending``, from the replica's publisher): checkpoints the engine demoted
to its host tier since the last call, exported with the KV of their path, minus those
the store already has. Returns the store-tier events for the router index.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from cluster.store.checkpoint_store import CheckpointStore, CommitResult, StoreEntry, StoreHit
from configs.serving import ReplicaConfig
from workers.cache.prefix_hash import prefix_hash_chain
from workers.cache.records import CheckpointEvicted, CheckpointInserted
from workers.tiers.cost import FetchCost, Throughput
from workers.tiers.payload import CheckpointPayload

if TYPE_CHECKING:  # the engine's module loads torch; the type is enough here
    from workers.engine import Engine

logger = logging.getLogger(__name__)
MAX_LOOKUPS = 4


class StoreObjectLost(RuntimeError):
    """The payload of a store entry cannot be read any more (its node died)."""


class StoreBackend(Protocol):
    async def lookup(self, chain: list[bytes], min_depth: int) -> StoreHit | None: ...
    async def get(self, ref: Any) -> Any: ...
    async def missing(self, keys: list[bytes]) -> list[bytes]: ...
    async def commit(self, payload: CheckpointPayload, owner: str) -> CommitResult: ...
    async def drop(self, key: bytes) -> None: ...
    async def clear(self) -> None: ...


class EngineRunner(Protocol):
    async def run(self, fn: Any) -> Any: ...


_REPLICA = ReplicaConfig()


@dataclass(frozen=True)
class FetchSettings:
    """Priors of the measured throughputs, and the fetch's own limits: a view of the
    config's ``replica.store_*`` and ``replica.prefill_tokens_per_s`` (``from_config``).
    ``measure=False`` keeps the throughputs at these values (a modelled deployment: the
    in-process benchmark, whose CPU timings say nothing about the network or the prefill
    it models, and whose fetch decisions must not depend on the machine's load)."""

    bandwidth_bytes_per_s: float = _REPLICA.store_bandwidth_bytes_per_s
    latency_s: float = _REPLICA.store_latency_s
    prefill_tokens_per_s: float = _REPLICA.prefill_tokens_per_s
    margin: float = 0.1  # a fetch must beat recomputing by this fraction
    timeout_s: float = _REPLICA.store_fetch_timeout_s
    measure: bool = True

    @classmethod
    def from_config(cls, replica: ReplicaConfig) -> FetchSettings:
        return cls(
            replica.store_bandwidth_bytes_per_s,
            replica.store_latency_s,
            replica.prefill_tokens_per_s,
            timeout_s=replica.store_fetch_timeout_s,
        )


class LocalStoreBackend:
    """A ``CheckpointStore`` in this process (payloads themselves as references)."""

    def __init__(self, store: CheckpointStore) -> None:
        self.store = store

    async def lookup(self, chain: list[bytes], min_depth: int) -> StoreHit | None:
        return self.store.lookup(chain, min_depth)

    async def get(self, ref: Any) -> Any:
        if ref is None:
            raise StoreObjectLost("payload gone")
        return ref

    async def missing(self, keys: list[bytes]) -> list[bytes]:
        return self.store.missing(keys)

    async def commit(self, payload: CheckpointPayload, owner: str) -> CommitResult:
        return self.store.commit(
            StoreEntry(payload.prefix_hash, payload.depth, payload.token_ids, payload.nbytes, payload, owner)
        )

    async def drop(self, key: bytes) -> None:
        self.store.drop(key)

    async def clear(self) -> None:
        self.store.clear()


def store_events(result: CommitResult, payload: CheckpointPayload) -> list[Any]:
    out: list[Any] = [CheckpointEvicted(e.depth, e.key, e.token_ids, "store") for e in result.evicted]
    if result.outcome == "committed":
        out.append(CheckpointInserted(payload.depth, payload.prefix_hash, payload.token_ids, "store"))
    return out


class StoreClient:
    def __init__(
        self, backend: StoreBackend, page_size: int, replica_id: str, settings: FetchSettings = FetchSettings()
    ) -> None:
        self.backend, self.page_size, self.replica_id = backend, page_size, replica_id
        self.settings = settings
        self.bandwidth = Throughput(settings.bandwidth_bytes_per_s)
        self.prefill = Throughput(settings.prefill_tokens_per_s)
        self._forward: tuple[float, float] | None = None  # (tokens, seconds) last seen

    # -- fetch ------------------------------------------------------------------------------
    async def prefetch(self, loop: EngineRunner, token_ids: Sequence[int]) -> str:
        """Fetch the store's checkpoint for a prompt when that beats recomputing it; returns
        the outcome (``none`` when the store has nothing deeper: not counted)."""
        tokens = list(token_ids)
        local, forward = await loop.run(lambda e: (e.local_depth(tokens), _forward_totals(e)))
        self._observe_forward(forward)
        chain = prefix_hash_chain(tokens[: len(tokens) - 1], self.page_size)
        outcomes: list[str] = []
        try:
            # A lost entry is dropped and the next deepest tried (a few times at most).
            while len(outcomes) < MAX_LOOKUPS and (not outcomes or outcomes[-1] == "lost"):
                hit = await self.backend.lookup(chain, local)
                if hit is None:
                    break
                outcomes.append(await self._fetch(loop, hit, local))
        except Exception:  # noqa: BLE001 - the store is an optimisation: the request still runs
            logger.warning("checkpoint store fetch failed", exc_info=True)
            outcomes.append("error")
        if outcomes:
            await loop.run(lambda e: [e.stats.inc("hybridserve_store_fetches_total", label=o) for o in outcomes])
        return outcomes[-1] if outcomes else "none"

    async def _fetch(self, loop: EngineRunner, hit: StoreHit, local: int) -> str:
        cost = FetchCost(
            hit.nbytes,
            hit.depth - local,
            self.bandwidth.value,
            self.prefill.value,
            self.settings.latency_s,
            self.settings.margin,
        )
        if not cost.should_fetch:
            return "recomputed"
        start = time.monotonic()
        try:
            payload = await self.backend.get(hit.ref)
        except StoreObjectLost:
            await self.backend.drop(hit.key)
            return "lost"
        if self.settings.measure:
            self.bandwidth.observe(hit.nbytes, time.monotonic() - start)
        placed = await loop.run(lambda e: _import(e, payload, hit))
        return {"imported": "fetched", "present": "present", "host_full": "host_full"}.get(placed, "invalid")

    def _observe_forward(self, totals: tuple[float, float]) -> None:
        if self._forward is not None and self.settings.measure:
            self.prefill.observe(totals[0] - self._forward[0], totals[1] - self._forward[1])
        self._forward = totals

    # -- commit -----------------------------------------------------------------------------
    async def commit_pending(self, loop: EngineRunner) -> list[Any]:
        """Put what the engine demoted since the last call into the store; the store-tier
        events (inserted, evicted) for the router index."""
        payloads = await loop.run(lambda e: e.export_store_commits())
        if not payloads:
            return []
        missing = set(await self.backend.missing([p.prefix_hash for p in payloads]))
        events: list[Any] = []
        outcomes: list[tuple[str, int]] = []
        for p in payloads:
            if p.prefix_hash not in missing:
                outcomes.append(("duplicate", 0))
                continue
            missing.discard(p.prefix_hash)
            try:
                result = await self.backend.commit(p, self.replica_id)
            except Exception:  # noqa: BLE001 - a lost commit costs a recompute later, nothing else
                logger.warning("checkpoint store commit failed", exc_info=True)
                outcomes.append(("error", 0))
                continue
            outcomes.append(
                (
                    result.outcome if result.outcome != "too_big" else "error",
                    p.nbytes if result.outcome == "committed" else 0,
                )
            )
            events += store_events(result, p)
        await loop.run(lambda e: _count_commits(e, outcomes))
        return events

    async def clear(self) -> None:
        await self.backend.clear()


def _forward_totals(engine: Engine) -> tuple[float, float]:
    s = engine.stats
    return float(s.counters.get("hybridserve_forward_tokens_total", 0)), float(
        s.totals["hybridserve_step_duration_seconds"][1]
    )


def _import(engine: Engine, payload: CheckpointPayload, hit: StoreHit) -> str:
    placed = engine.import_checkpoint(payload, expected_hash=hit.key)
    if placed == "imported":
        engine.stats.inc("hybridserve_tier_bytes_total", hit.nbytes, label="store_get")
    return placed


def _count_commits(engine: Engine, outcomes: list[tuple[str, int]]) -> None:
    for outcome, nbytes in outcomes:
        engine.stats.inc("hybridserve_store_commits_total", label=outcome)
        if nbytes:
            engine.stats.inc("hybridserve_tier_bytes_total", nbytes, label="store_put")

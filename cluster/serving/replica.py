"""``EngineReplica``: the Serve deployment owning one engine (Ray edge over ``ReplicaCore``).

Decorated by the app builder (``cluster/app.py``), not here. The async constructor builds
the engine on its own thread (``replica_core.build_engine``: the TP seam), then starts
one publisher task that, every ``replica.events_interval_s``, sends the engine's new checkpoint
events to the router actor, and every ``stats_interval_s`` sends stats to the metrics
actor and a heartbeat to the router actor.

With ``cache.cluster_store_bytes`` the replica also talks to the app's checkpoint store
(``cluster/store``): prompts are offered to its ``StoreClient`` before they are queued
(fetch when cheaper than recomputing), the publisher commits what the engine demoted to
its host tier, and the store-tier events go to the router index with the others.

Methods: ``generate`` (streaming; cancelling the call aborts the request in the engine),
``model_info``, ``flush_cache``, ``stats``, ``check_health`` (Serve calls it), and in a
disaggregated app ``take_handoff`` (prefill replicas; ``cluster/pd``). Calls with
``target_replica`` are routed to that replica by ``HybridPrefixRouter``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray import serve

from cluster.actors import get_index_actor, get_metrics_actor, get_store_actor
from cluster.pd.ray_edge import PREFILL_DEPLOYMENT, RayHandoffSource
from cluster.serving.messages import GenerateRequest, ModelInfo
from cluster.serving.replica_core import PDSide, ReplicaCore, StreamItem, StreamPacing
from cluster.store.actor import RayStoreBackend
from cluster.store.client import FetchSettings, StoreClient
from configs.schema import HybridServeConfig

logger = logging.getLogger(__name__)


def freeze_startup_objects() -> int:
    """Move every object alive now (the engine, its weights' wrappers, compiled graphs,
    tokenizer) to the collector's permanent generation; returns how many are there.

    A replica process lives for its one engine, and after compiling it holds ~750k Python
    objects: a full (generation-2) collection walks them all, ~0.5 s on this CPU, a stall
    of every stream. Frozen, they are never walked (vLLM does the same after capturing its
    graphs). Only for the replica's own process: an in-process ``LLM`` (tests, benches)
    does not freeze, since cyclic garbage of a frozen engine dropped later is never freed."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class EngineReplica:
    async def __init__(self, config: dict[str, Any], pd_role: str = "") -> None:
        """``pd_role``: ``prefill`` or ``decode`` in a disaggregated app (``cluster/pd``)."""
        self._config = HybridServeConfig.model_validate(config)
        self._opts = self._config.replica
        self._model_name = self._config.served_model_name()
        ctx = serve.get_replica_context()
        self._replica_id = ctx.replica_id.to_full_id_str()
        rank = getattr(ctx, "rank", None)
        self._label = str(rank.rank) if rank is not None else ctx.replica_tag
        if pd_role:  # two deployments: their ranks would share labels
            self._label = f"{pd_role}-{self._label}"
        self._index = get_index_actor(ctx.app_name, self._opts.forget_after_s)
        self._metrics = get_metrics_actor(ctx.app_name, self._config.server.host, self._config.metrics.port)
        self._store = self._store_client(ctx.app_name)
        self._core = await ReplicaCore.create(
            self._config,
            StreamPacing.from_config(self._opts),
            fetcher=self._store,
            pd=self._pd_side(ctx.app_name, pd_role),
        )
        frozen = freeze_startup_objects()
        self._lock = asyncio.Lock()  # orders event pushes against flush + clear
        self._index.apply.remote(self._replica_id, [])
        self._publisher = asyncio.get_running_loop().create_task(self._publish_forever())
        logger.info(
            "replica %s (rank %s) ready: max_model_len=%d, %d start-up objects frozen",
            self._replica_id,
            self._label,
            self._core.loop.engine.max_model_len,
            frozen,
        )

    def _store_client(self, app_name: str) -> StoreClient | None:
        budget = self._config.cache.cluster_store_bytes
        if not budget:
            return None
        actor = get_store_actor(app_name, budget, self._model_name, self._metrics)
        settings = FetchSettings.from_config(self._opts)
        return StoreClient(
            RayStoreBackend(actor, settings.timeout_s), self._config.cache.page_size, self._replica_id, settings
        )

    def _pd_side(self, app_name: str, role: str) -> PDSide:
        source = None
        if role == "decode":
            source = RayHandoffSource(serve.get_deployment_handle(PREFILL_DEPLOYMENT, app_name))
        return PDSide(self._config.pd.transfer_timeout_s, source, replica_id=self._replica_id)

    async def generate(self, req: GenerateRequest) -> AsyncIterator[StreamItem]:
        async for item in self._core.generate(req):
            yield item

    def take_handoff(self, key: str, target_replica: str | None = None) -> Any:
        """A prefill replica's stashed hand-off, once (a decode replica pulls it)."""
        return self._core.take_handoff(key)

    def model_info(self) -> ModelInfo:
        return self._core.model_info()

    async def flush_cache(self, target_replica: str | None = None) -> dict[str, Any]:
        async with self._lock:
            flushed = await self._core.flush_cache()
            self._index.clear.remote(self._replica_id)
            if self._store is not None:  # later prompts start cold everywhere
                await self._store.clear()
                self._index.clear_store.remote()
        return {"replica_id": self._replica_id, "replica_label": self._label, "flushed": flushed}

    async def stats(self, target_replica: str | None = None) -> dict[str, Any]:
        stats = await self._core.stats(self._replica_id, self._label)
        return dataclasses.asdict(dataclasses.replace(stats, node_id=ray.get_runtime_context().get_node_id()))

    async def check_health(self) -> None:
        self._core.check_health()
        if self._publisher.done() and not self._publisher.cancelled():
            raise RuntimeError(f"publisher stopped: {self._publisher.exception()!r}")

    async def _publish_forever(self) -> None:
        loop = asyncio.get_running_loop()
        next_stats = loop.time()
        while True:
            await asyncio.sleep(self._opts.events_interval_s)
            try:
                await self._publish_events()
                if loop.time() >= next_stats:
                    next_stats = loop.time() + self._opts.stats_interval_s
                    await self._publish_stats()
            except Exception:  # noqa: BLE001 - publishing must not kill the replica
                logger.warning("publishing replica state failed", exc_info=True)

    async def _publish_events(self) -> None:
        async with self._lock:
            events = await self._core.loop.run(lambda engine: engine.drain_cache_events())
            if self._store is not None:
                events += await self._store.commit_pending(self._core.loop)
            if events:
                self._index.apply.remote(self._replica_id, events)

    async def _publish_stats(self) -> None:
        snapshot, observations = await self._core.loop.run(lambda e: (e.stats.snapshot(), e.stats.drain_observations()))
        self._metrics.push_replica.remote(self._model_name, self._label, snapshot, observations)
        self._index.apply.remote(self._replica_id, [])  # heartbeat

    async def __del__(self) -> None:
        """Serve's graceful shutdown: stop publishing, leave the index, stop the engine."""
        publisher = getattr(self, "_publisher", None)
        if publisher is None:
            return  # the constructor failed part way
        publisher.cancel()
        try:
            self._index.forget.remote([self._replica_id])
        except Exception:  # noqa: BLE001 - shutting down
            pass
        await self._core.shutdown()

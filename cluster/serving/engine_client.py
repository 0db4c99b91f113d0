"""How the HTTP layer reaches replicas: the ``EngineClient`` protocol and a local client.

The OpenAI server only needs this protocol; the Ray ingress implements it with a
DeploymentHandle (``cluster/api/ingress.py``), tests and tools with ``LocalEngineClient``
over a ``ReplicaCore`` in the same process (no Ray).

A ``GenerateStream`` is an async iterator of replica stream items (see ``messages``)
with ``cancel()``, which must make the replica abort the request's unfinished choices.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any, Protocol

from cluster.observability.metrics_registry import MetricsRegistry, prometheus_registry, render_text
from cluster.serving.messages import GenerateRequest, ModelInfo
from cluster.serving.replica_core import ReplicaCore, StreamItem


class GenerateStream(Protocol):
    def __aiter__(self) -> AsyncIterator[StreamItem]: ...
    async def __anext__(self) -> StreamItem: ...
    def cancel(self) -> None: ...


class EngineClient(Protocol):
    async def model_info(self) -> ModelInfo: ...
    def generate(self, req: GenerateRequest) -> GenerateStream: ...
    async def flush_cache(self) -> list[dict[str, Any]]: ...
    async def replica_stats(self) -> list[dict[str, Any]]: ...
    async def health(self) -> None: ...
    async def metrics_text(self) -> str: ...  # the hybridserve_* Prometheus text


class _LocalStream:
    def __init__(self, gen: AsyncIterator[StreamItem]) -> None:
        self._gen = gen

    def __aiter__(self) -> _LocalStream:
        return self

    async def __anext__(self) -> StreamItem:
        return await self._gen.__anext__()

    def cancel(self) -> None:
        aclose = getattr(self._gen, "aclose", None)
        if aclose is None:
            return
        fut = asyncio.ensure_future(aclose())
        fut.add_done_callback(lambda f: f.exception())  # a running generator: its task cleans up


class LocalEngineClient:
    """One in-process replica (no Ray): for tests and single-process tools. Its metrics
    are this replica's, in a registry of its own (labels ``model``, ``replica="local"``)."""

    def __init__(self, core: ReplicaCore, model_name: str = "local") -> None:
        self.core = core
        self.model_name = model_name
        self._registry = MetricsRegistry()
        self._prom = prometheus_registry(self._registry)

    async def model_info(self) -> ModelInfo:
        return self.core.model_info()

    def generate(self, req: GenerateRequest) -> GenerateStream:
        return _LocalStream(self.core.generate(req))

    async def flush_cache(self) -> list[dict[str, Any]]:
        return [{"replica_id": "local", "flushed": await self.core.flush_cache()}]

    async def replica_stats(self) -> list[dict[str, Any]]:
        return [dataclasses.asdict(await self.core.stats("local", "local"))]

    async def health(self) -> None:
        self.core.check_health()

    async def metrics_text(self) -> str:
        snapshot, observations = await self.core.loop.run(lambda e: (e.stats.snapshot(), e.stats.drain_observations()))
        self._registry.update_replica(self.model_name, "local", snapshot, observations)
        return render_text(self._prom)

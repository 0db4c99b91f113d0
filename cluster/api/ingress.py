"""``OpenAIIngress``: the FastAPI app of ``http_api`` served through Ray Serve (Ray edge).

The ingress owns the tokenizer (tokens at the edge, DESIGN §1) and a handle to the
engine deployment; ``ServeEngineClient`` adapts that handle to ``EngineClient``. The
ASGI app is built per replica after the constructor (``__serve_build_asgi_app__``), so
the routes close over this replica's ``OpenAIServer`` instead of module globals; it is
wrapped in ``AdmissionLimit`` (``cluster/api/admission.py``): at most
``ingress.max_in_flight`` concurrent requests per ingress replica, the rest answered 503 +
``Retry-After`` at once.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from cluster.actors import get_index_actor, get_metrics_actor
from cluster.api.admission import AdmissionLimit
from cluster.api.http_api import make_api
from cluster.api.openai_server import OpenAIServer, ServerSettings
from cluster.api.resumable import ResumeSettings, StreamCounters
from cluster.observability.metrics_registry import PD_REQUESTS
from cluster.pd.client import PDEngineClient
from cluster.pd.ray_edge import DECODE_DEPLOYMENT, PREFILL_DEPLOYMENT, DecodeDepths, in_deployment
from cluster.serving.engine_client import GenerateStream
from cluster.serving.messages import GenerateRequest, ModelInfo
from configs.schema import HybridServeConfig


class ServeEngineClient:
    """``EngineClient`` over the engine deployment's handle."""

    def __init__(
        self,
        handle: DeploymentHandle,
        app_name: str,
        forget_after_s: float,
        metrics_host: str,
        metrics_port: int,
        deployment: str = "",
    ) -> None:
        self._handle = handle
        self._deployment = deployment  # a PD app's prefill or decode deployment: its replicas only
        # by value: stream items travel on the replicas' gRPC channel, not as Ray objects,
        # which costs this hop less CPU per item (BENCHMARKS.md, the HTTP path)
        self._stream = handle.options(stream=True, _by_reference=False)
        self._index = get_index_actor(app_name, forget_after_s)
        self._metrics = get_metrics_actor(app_name, metrics_host, metrics_port)

    async def model_info(self) -> ModelInfo:
        return await self._handle.model_info.remote()

    def generate(self, req: GenerateRequest) -> GenerateStream:
        return self._stream.generate.remote(req)  # type: ignore[return-value]

    async def _each_replica(self, method: str) -> list[dict[str, Any]]:
        """Call ``method`` once on every live replica (targeted through the router).

        Sequential: sibling handle calls of one HTTP request share Serve's internal
        request id, which the router uses to match decisions to calls (see
        ``OpenAIServer._open_streams``).
        """
        ids = await self._index.replicas.remote()
        if self._deployment:
            ids = [r for r in ids if in_deployment(r, self._deployment)]
        call = getattr(self._handle, method)
        if not ids:
            return [await call.remote()]
        unique: dict[str, dict[str, Any]] = {}
        for rid in ids:
            result = await call.remote(target_replica=rid)
            unique[result["replica_id"]] = result
        return list(unique.values())

    async def flush_cache(self) -> list[dict[str, Any]]:
        return await self._each_replica("flush_cache")

    async def replica_stats(self) -> list[dict[str, Any]]:
        return await self._each_replica("stats")

    async def metrics_text(self) -> str:
        """What the metrics actor serves on ``metrics.port`` (its ``render``)."""
        return await self._metrics.render.remote()

    def push_count(self, model: str, name: str, label: str | None) -> None:
        """One stream-resume event to the metrics actor (fire and forget)."""
        self._metrics.push_ingress.remote(model, name, label)

    async def health(self) -> None:
        """Raises unless a replica answers; a replica too busy to queue one more call is
        alive (``BackPressureError`` is overload, not failure: ``/health`` stays 200)."""
        try:
            await self._handle.model_info.remote()
        except BackPressureError:
            pass


def replica_died(exc: BaseException) -> bool:
    """Whether a handle call failed because its replica's actor is gone (then a retry can
    reach another); overload (``BackPressureError``) and everything else is answered as is."""
    return isinstance(exc, (RayActorError, ActorUnavailableError))


@serve.ingress()
class OpenAIIngress:
    async def __init__(
        self, engine: DeploymentHandle, config: dict[str, Any], prefill: DeploymentHandle | None = None
    ) -> None:
        """``engine``: the engine deployment (a PD app's decode deployment, ``prefill`` its
        prefill deployment: ``cluster/pd``)."""
        from workers.loader import load_tokenizer

        cfg = HybridServeConfig.model_validate(config)
        tokenizer = await asyncio.to_thread(load_tokenizer, cfg.model_dir())  # data only, no checkpoint code
        app_name = serve.get_replica_context().app_name
        where = (app_name, cfg.replica.forget_after_s, cfg.server.host, cfg.metrics.port)
        engines = ServeEngineClient(engine, *where, deployment=DECODE_DEPLOYMENT if prefill else "")
        model = cfg.served_model_name()
        counters = StreamCounters(lambda name, label: engines.push_count(model, name, label))
        client: Any = engines
        if prefill is not None:
            client = PDEngineClient(
                ServeEngineClient(prefill, *where, deployment=PREFILL_DEPLOYMENT),
                engines,
                DecodeDepths(get_index_actor(app_name, cfg.replica.forget_after_s)),
                cfg.pd.max_local_prefill_tokens,
                lambda route: counters.inc(PD_REQUESTS, route),
            )
        resume = ResumeSettings.from_config(cfg.ingress, replica_died)
        self._server = OpenAIServer(client, tokenizer, ServerSettings.from_config(cfg), resume, counters)
        self._max_in_flight, self._retry_after_s = cfg.ingress.max_in_flight, cfg.ingress.retry_after_s

    def __serve_build_asgi_app__(self) -> Any:
        api = make_api(self._server, echo_request_id=False)  # Serve's proxy echoes x-request-id
        self._admission = AdmissionLimit(api, self._max_in_flight, self._retry_after_s)
        return self._admission

    async def begin_drain(self) -> int:
        """Handle method (``hybridserve serve`` on SIGTERM): refuse new HTTP requests with
        503 from now on; returns how many are still in flight."""
        return self._admission.begin_drain()

    async def num_in_flight(self) -> int:
        return self._admission.in_flight

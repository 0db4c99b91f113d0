"""The metrics actor: a ``MetricsRegistry`` served by ``prometheus_client`` (Ray edge).

Replicas push ``(model, replica, snapshot, observations)`` every stats interval; routers
push decision deltas; ingresses push stream-resume events one at a time. The actor serves
``/metrics`` on ``host:port`` from a ``prometheus_client`` HTTP thread; ``render`` returns
the same text for tests.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import ray
from prometheus_client import start_http_server

from cluster.observability.metrics_registry import MetricsRegistry, prometheus_registry, render_text

logger = logging.getLogger(__name__)


@ray.remote(num_cpus=0)
class MetricsActor:
    def __init__(self, host: str, port: int, stale_after_s: float = 300.0) -> None:
        self._registry = MetricsRegistry()
        self._stale_after_s = stale_after_s
        self._prom = prometheus_registry(self._registry)
        self._server, _ = start_http_server(port, addr=host, registry=self._prom)
        self.address = f"http://{host}:{self._server.server_port}/metrics"
        logger.info("metrics at %s", self.address)

    def url(self) -> str:
        return self.address

    def push_replica(
        self, model: str, replica: str, snapshot: Mapping[str, object], observations: Mapping[str, Sequence[float]]
    ) -> None:
        self._registry.update_replica(model, replica, snapshot, observations)
        self._registry.expire(self._stale_after_s)

    def push_router(self, model: str, deltas: Mapping[str, int]) -> None:
        self._registry.add_router_decisions(model, deltas)

    def push_ingress(self, model: str, name: str, label: str | None = None) -> None:
        self._registry.add_ingress_count(model, name, label)

    def forget_replica(self, model: str, replica: str) -> None:
        self._registry.forget_replica(model, replica)

    def render(self) -> str:
        return render_text(self._prom)

    def __ray_shutdown__(self) -> None:
        self._server.shutdown()

"""The suite's local serving cluster (Ray edge): one Ray + Serve, apps deployed and deleted
one at a time, each behind its own route prefix, with the request router chosen per app.

Routers: ``hybrid_prefix`` and ``round_robin`` are ours (``router.policy``);
``ray_prefix`` is Ray Serve's own ``PrefixCacheAffinityRouter`` (imported from
``ray.llm._internal...``; the public alias needs vLLM installed) with its defaults, set as
the ``request_router_config`` of the same ``EngineReplica`` deployment. It reads the
prompt from the ``prompt`` attribute of the first call argument -- our
``GenerateRequest.prompt``, the text the ingress received -- so it needs text prompts
(for token-id prompts that text is empty and it divides by zero).

Per-replica counters come from the app's ``/metrics`` (the metrics actor), which works
whatever the router; ``/debug/replicas`` needs our router's ``target_replica``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from cluster.net import free_port
from cluster.serve_env import apply_serve_env
from configs.schema import load_config

ROUTERS = ("hybrid_prefix", "round_robin", "ray_prefix")
RAY_NUM_CPUS = 16  # logical; replicas ask for 1 each on a 2-core machine


@dataclass(frozen=True)
class App:
    name: str
    base_url: str  # http://127.0.0.1:PORT/NAME
    metrics_url: str
    deploy_s: float


class LocalCluster:
    """``with LocalCluster() as c: app = c.deploy(...); ...; c.delete(app)``."""

    def __init__(self) -> None:
        self.port = 0

    def __enter__(self) -> LocalCluster:
        import ray
        from ray import serve

        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        apply_serve_env()
        ray.init(num_cpus=RAY_NUM_CPUS, include_dashboard=False, log_to_driver=False, configure_logging=False)
        self.port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": self.port})
        return self

    def __exit__(self, *exc: object) -> None:
        import ray
        from ray import serve

        try:
            serve.shutdown()
        finally:
            ray.shutdown()

    def deploy(
        self,
        name: str,
        engine: dict[str, Any],
        router: str = "hybrid_prefix",
        replica: dict[str, Any] | None = None,
        router_options: dict[str, Any] | None = None,
    ) -> App:
        from ray import serve

        from cluster.app import AppArgs, build_app_from_config

        if router not in ROUTERS:
            raise ValueError(f"router must be one of {ROUTERS}, got {router!r}")
        metrics_port = free_port()
        policy = "hybrid_prefix" if router == "ray_prefix" else router
        config = load_config(overrides={**engine, "metrics": {"port": metrics_port}, "router": {"policy": policy}})
        args = AppArgs.model_validate({"model_name": name, "replica": replica or {}, "router": router_options or {}})
        app = build_app_from_config(config, args, ray_prefix_router() if router == "ray_prefix" else None)
        start = time.perf_counter()
        serve.run(app, name=name, route_prefix=f"/{name}")
        return App(
            name,
            f"http://127.0.0.1:{self.port}/{name}",
            f"http://127.0.0.1:{metrics_port}/metrics",
            time.perf_counter() - start,
        )

    def delete(self, app: App) -> None:
        from ray import serve

        from cluster.actors import kill_app_actors

        serve.delete(app.name)
        kill_app_actors(app.name)


def ray_prefix_router() -> Any:
    """Ray Serve LLM's ``PrefixCacheAffinityRouter`` with its defaults, for the engine replicas."""
    from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import PrefixCacheAffinityRouter
    from ray.serve.config import RequestRouterConfig

    return RequestRouterConfig(request_router_class=PrefixCacheAffinityRouter)


def replica_counters(
    metrics_url: str,
    names: tuple[str, ...] = (
        "hybridserve_requests_total",
        "hybridserve_prompt_tokens_total",
        "hybridserve_prefix_hit_tokens_total",
        "hybridserve_prefix_query_tokens_total",
    ),
) -> dict[str, dict[str, float]]:
    """replica label -> counter name -> value (labelled counters summed over their label)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(metrics_url, timeout=10.0, trust_env=False).text
    out: dict[str, dict[str, float]] = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            if sample.name in names and "replica" in sample.labels:
                per = out.setdefault(sample.labels["replica"], {})
                per[sample.name] = per.get(sample.name, 0.0) + sample.value
    return out


def counter_deltas(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]], name: str
) -> dict[str, float]:
    return {r: after[r].get(name, 0.0) - before.get(r, {}).get(name, 0.0) for r in after}


def wait_for_counters(
    metrics_url: str, name: str, total: float, timeout_s: float = 20.0
) -> dict[str, dict[str, float]]:
    """Poll /metrics until ``name`` summed over replicas reaches ``total`` (pushes lag)."""
    deadline = time.monotonic() + timeout_s
    while True:
        counters = replica_counters(metrics_url)
        if sum(c.get(name, 0.0) for c in counters.values()) >= total or time.monotonic() > deadline:
            return counters
        time.sleep(0.3)

"""The Serve application builder (``serve run`` / ``serve deploy`` import path).

``build_app(args)`` is what ``deploy/serve.yaml`` names (``cluster.app:build_app``); its
``args`` are ``AppArgs``: a hybridserve YAML path plus overrides of the one config
(``configs/schema.py``): ``set`` by dotted name as on the CLI, and the ``router``,
``replica``, ``ingress`` and ``pd`` sections and ``model_name`` (``server.served_model_name``)
written out for readability. ``build_app_from_config`` is the same for callers holding a
config object (the CLI, tests).

The app: ``OpenAIIngress`` (route prefix of the app) -> ``EngineReplica`` x
``parallel.num_replicas``, routed by ``HybridPrefixRouter`` with ``router.policy``. With
``pd.prefill_replicas`` and ``pd.decode_replicas`` (``cluster/pd``): two deployments of
``EngineReplica``, ``PDPrefill`` and ``PDDecode``, behind the one ingress. Every
deployment gets the whole config and reads its own section.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.deployment import Application

from cluster.api.ingress import OpenAIIngress
from cluster.pd.ray_edge import DECODE_DEPLOYMENT, PREFILL_DEPLOYMENT
from cluster.routing.router import HybridPrefixRouter
from cluster.serving.replica import EngineReplica
from cluster.serving.replica_core import check_supported
from configs.base import Frozen
from configs.schema import HybridServeConfig, combine_overrides, load_config, with_overrides

_ROOT = Path(__file__).resolve().parent.parent


class AppArgs(Frozen):
    """The builder's ``args``; every key but ``config`` is an override of the config."""

    config: str | None = None  # YAML file (relative: to cwd, else the repo root)
    set: dict[str, Any] = Field(default_factory=dict)  # overrides, dotted or nested keys
    model_name: str | None = None  # server.served_model_name
    router: dict[str, Any] = Field(default_factory=dict)  # the config's router section
    replica: dict[str, Any] = Field(default_factory=dict)
    ingress: dict[str, Any] = Field(default_factory=dict)
    pd: dict[str, Any] = Field(default_factory=dict)  # prefill/decode disaggregation (deploy/serve-pd.yaml)

    def overrides(self) -> dict[str, Any]:
        """One override tree; a key given two values (a section and ``set``) is refused."""
        sections = {"router": self.router, "replica": self.replica, "ingress": self.ingress, "pd": self.pd}
        if self.model_name:
            sections["server"] = {"served_model_name": self.model_name}
        return combine_overrides({"args": sections, "args.set": self.set})


def resolve_path(path: str) -> Path:
    p = Path(path)
    return p if p.is_absolute() or p.exists() else _ROOT / p


def replica_placement(config: HybridServeConfig) -> dict[str, Any]:
    """Deployment options placing one replica: for TP > 1, a placement group of one bundle
    per rank (the replica is rank 0 in bundle 0; ``cluster/serving/tp.py`` starts the others)."""
    replica = config.replica
    if config.parallel.tensor_parallel_size == 1:
        extra = {"resources": dict(replica.resources)} if replica.resources else {}
        return {"ray_actor_options": {"num_cpus": replica.num_cpus, **extra}}
    from cluster.serving.tp import tp_bundles, uses_gpu

    actor = {"num_cpus": replica.num_cpus, **({"num_gpus": 1} if uses_gpu(config) else {})}
    return {
        "ray_actor_options": actor,
        "placement_group_bundles": tp_bundles(config, replica.num_cpus),
        "placement_group_strategy": "STRICT_PACK",
    }


def build_app(args: dict[str, Any] | None = None) -> Application:
    """``import_path: cluster.app:build_app``; raises ValueError for bad args or config."""
    parsed = AppArgs.model_validate(args or {})
    config = load_config(resolve_path(parsed.config) if parsed.config else None, parsed.overrides())
    return build_app_from_config(config)


def build_app_from_config(
    config: HybridServeConfig, args: AppArgs | None = None, request_router_config: RequestRouterConfig | None = None
) -> Application:
    """``args``: overrides applied to ``config`` first (its ``config`` path is not read).
    ``request_router_config``: route the engine replicas with another Serve request router
    (e.g. Ray's ``PrefixCacheAffinityRouter``, for comparisons) instead of ours."""
    if args is not None:
        config = with_overrides(config, args.overrides())
    check_supported(config)
    dumped = config.model_dump(mode="json")
    if not config.pd.enabled:
        num = config.parallel.num_replicas
        engine = _engine_deployment(config, dumped, "EngineReplica", num, request_router_config)
        return _ingress(config).bind(engine.bind(dumped), dumped)
    pd = config.pd
    prefill = _engine_deployment(config, dumped, PREFILL_DEPLOYMENT, pd.prefill_replicas, request_router_config)
    decode = _engine_deployment(config, dumped, DECODE_DEPLOYMENT, pd.decode_replicas, request_router_config)
    return _ingress(config).bind(decode.bind(dumped, "decode"), dumped, prefill.bind(dumped, "prefill"))


def _engine_deployment(
    config: HybridServeConfig,
    dumped: dict[str, Any],
    name: str,
    num_replicas: int,
    request_router_config: RequestRouterConfig | None,
) -> Any:
    replica = config.replica
    return serve.deployment(EngineReplica, name=name).options(
        num_replicas=num_replicas,
        max_ongoing_requests=replica.max_ongoing_requests,
        max_queued_requests=replica.max_queued_requests,
        health_check_period_s=replica.health_check_period_s,
        health_check_timeout_s=replica.health_check_timeout_s,
        graceful_shutdown_wait_loop_s=replica.graceful_shutdown_wait_loop_s,
        graceful_shutdown_timeout_s=replica.graceful_shutdown_timeout_s,
        request_router_config=request_router_config
        or RequestRouterConfig(request_router_class=HybridPrefixRouter, request_router_kwargs={"config": dumped}),
        **replica_placement(config),
    )


def _ingress(config: HybridServeConfig) -> Any:
    opts = config.ingress
    ingress = serve.deployment(OpenAIIngress, name="OpenAIIngress").options(
        num_replicas=opts.num_replicas,
        max_ongoing_requests=opts.max_ongoing_requests,
        max_queued_requests=opts.max_queued_requests,
        graceful_shutdown_wait_loop_s=opts.graceful_shutdown_wait_loop_s,
        graceful_shutdown_timeout_s=opts.graceful_shutdown_timeout_s,
        ray_actor_options={
            "num_cpus": opts.num_cpus,
            **({"resources": dict(opts.resources)} if opts.resources else {}),
        },
    )
    return ingress

"""The Serve application builder (``serve run`` / ``serve deploy`` import path).

``build_app(args)`` is what ``deploy/serve.yaml`` names (``cluster.app:build_app``); its
``args`` are ``AppArgs``: the hybridserve config (a YAML path plus dotted overrides, as
on the CLI) and the serving knobs that are not engine config (router tunables, replica
resources and publish intervals, ingress size). ``build_app_from_config`` is the same
for callers holding a config object (the CLI, tests).

The app: ``OpenAIIngress`` (route prefix of the app) -> ``EngineReplica`` x
``parallel.num_replicas``, routed by ``HybridPrefixRouter`` with ``router.policy``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.deployment import Application

from cluster.api.ingress import OpenAIIngress, default_model_name
from cluster.routing.router import HybridPrefixRouter
from cluster.serving.replica import EngineReplica, ReplicaOptions
from cluster.serving.replica_core import check_supported
from configs.schema import HybridServeConfig, load_config

_ROOT = Path(__file__).resolve().parent.parent


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RouterOptions(_Strict):
    """``HybridPrefixRouter`` tunables (see ``routing_policy``)."""

    load_penalty_tokens: float = Field(16.0, ge=0)       # the floor of the learnt penalty (routing_policy)
    load_penalty_auto: bool = True                       # off: the penalty is load_penalty_tokens
    imbalance_abs: int = Field(8, ge=0)
    imbalance_rel: float = Field(1.5, ge=1.0)
    min_match_tokens: int = Field(16, ge=1)
    host_hit_value: float = Field(0.9, ge=0, le=1)       # routing_policy.expected_saved
    store_hit_value: float = Field(0.5, ge=0, le=1)
    store_min_gain_tokens: int = Field(0, ge=0)          # the fetch cost model's break-even
    replica_capacity: int = Field(0, ge=0)               # 0: the engine's scheduler.max_running_requests
    index_timeout_s: float = Field(0.5, gt=0)
    push_interval_s: float = Field(1.0, gt=0)


class IngressOptions(_Strict):
    """The ingress deployment: size, Serve's limits, admission, graceful shutdown.

    ``max_in_flight`` (per ingress replica, ``cluster/api/admission.py``) must stay below
    ``max_ongoing_requests`` so that excess requests reach the ingress and get an OpenAI
    503 instead of queuing in the Serve proxy (whose own 503, past
    ``max_queued_requests``, is plain text).
    """

    num_replicas: int = Field(1, ge=1)
    num_cpus: float = Field(0.0, ge=0)
    resources: dict[str, float] = Field(default_factory=dict)   # custom Ray resources (pinning)
    max_ongoing_requests: int = Field(1000, ge=1)
    max_queued_requests: int = Field(256, ge=-1)       # -1: unbounded (Serve's default)
    max_in_flight: int = Field(512, ge=1)
    retry_after_s: int = Field(1, ge=0)
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1)  # larger request bodies get a 413
    graceful_shutdown_wait_loop_s: float = Field(2.0, gt=0)
    graceful_shutdown_timeout_s: float = Field(20.0, ge=0)

    @model_validator(mode="after")
    def _admission_below_serve_limit(self) -> IngressOptions:
        if self.max_in_flight >= self.max_ongoing_requests:
            raise ValueError(f"ingress.max_in_flight ({self.max_in_flight}) must be below "
                             f"ingress.max_ongoing_requests ({self.max_ongoing_requests})")
        return self


class AppArgs(_Strict):
    config: str | None = None             # YAML file (relative: to cwd, else the repo root)
    set: dict[str, Any] = Field(default_factory=dict)  # overrides, dotted or nested keys
    model_name: str | None = None         # the served model id; default: the model dir's name
    router: RouterOptions = RouterOptions()
    replica: ReplicaOptions = ReplicaOptions()
    ingress: IngressOptions = IngressOptions()


def resolve_path(path: str) -> Path:
    p = Path(path)
    return p if p.is_absolute() or p.exists() else _ROOT / p


def replica_placement(config: HybridServeConfig, replica: ReplicaOptions) -> dict[str, Any]:
    """Deployment options placing one replica: for TP > 1, a placement group of one bundle
    per rank (the replica is rank 0 in bundle 0; ``cluster/serving/tp.py`` starts the others)."""
    extra = {"resources": dict(replica.resources)} if replica.resources else {}
    if config.parallel.tensor_parallel_size == 1:
        return {"ray_actor_options": {"num_cpus": replica.num_cpus, **extra}}
    from cluster.serving.tp import tp_bundles, uses_gpu

    if replica.resources:
        raise ValueError(f"replica.resources {replica.resources} needs parallel.tensor_parallel_size=1 "
                         f"(a TP replica is placed by its placement group), got {config.parallel.tensor_parallel_size}")
    actor = {"num_cpus": replica.num_cpus, **({"num_gpus": 1} if uses_gpu(config) else {})}
    return {"ray_actor_options": actor, "placement_group_bundles": tp_bundles(config, replica.num_cpus),
            "placement_group_strategy": "STRICT_PACK"}


def build_app(args: dict[str, Any] | None = None) -> Application:
    """``import_path: cluster.app:build_app``; raises ValueError for bad args or config."""
    parsed = AppArgs.model_validate(args or {})
    config = load_config(resolve_path(parsed.config) if parsed.config else None, parsed.set)
    return build_app_from_config(config, parsed)


def router_kwargs(config: HybridServeConfig, args: AppArgs, model_name: str, forget_after_s: float) -> dict[str, Any]:
    """``HybridPrefixRouter.initialize_state``'s kwargs; ``replica_capacity`` 0 becomes the
    engine's ``scheduler.max_running_requests`` (what ``routing_policy.load_cost`` needs)."""
    return {"policy": config.router.policy, "model_name": model_name, "metrics_host": config.server.host,
            "metrics_port": config.metrics.port, "forget_after_s": forget_after_s,
            **args.router.model_dump(),
            "replica_capacity": args.router.replica_capacity or config.scheduler.max_running_requests}


def build_app_from_config(config: HybridServeConfig, args: AppArgs | None = None,
                          request_router_config: RequestRouterConfig | None = None) -> Application:
    """``request_router_config``: route the engine replicas with another Serve request
    router (e.g. Ray's ``PrefixCacheAffinityRouter``, for comparisons) instead of ours."""
    args = args or AppArgs()
    check_supported(config)
    model_name = args.model_name or default_model_name(config)
    replica = args.replica.model_copy(update={"model_name": model_name})
    kwargs = router_kwargs(config, args, model_name, replica.forget_after_s)
    engine = serve.deployment(EngineReplica, name="EngineReplica").options(
        num_replicas=config.parallel.num_replicas,
        max_ongoing_requests=replica.max_ongoing_requests,
        max_queued_requests=replica.max_queued_requests,
        health_check_period_s=replica.health_check_period_s,
        health_check_timeout_s=replica.health_check_timeout_s,
        graceful_shutdown_wait_loop_s=replica.graceful_shutdown_wait_loop_s,
        graceful_shutdown_timeout_s=replica.graceful_shutdown_timeout_s,
        request_router_config=request_router_config or RequestRouterConfig(
            request_router_class=HybridPrefixRouter, request_router_kwargs=kwargs),
        **replica_placement(config, replica),
    ).bind(config.model_dump(mode="json"), replica.model_dump())
    opts = args.ingress
    ingress = serve.deployment(OpenAIIngress, name="OpenAIIngress").options(
        num_replicas=opts.num_replicas,
        max_ongoing_requests=opts.max_ongoing_requests,
        max_queued_requests=opts.max_queued_requests,
        graceful_shutdown_wait_loop_s=opts.graceful_shutdown_wait_loop_s,
        graceful_shutdown_timeout_s=opts.graceful_shutdown_timeout_s,
        ray_actor_options={"num_cpus": opts.num_cpus, **({"resources": dict(opts.resources)} if opts.resources else {})},
    )
    return ingress.bind(engine, config.model_dump(mode="json"), model_name, replica.forget_after_s,
                        opts.max_in_flight, opts.retry_after_s, opts.max_body_bytes)

"""The Cluster dashboard: how load and cache hits spread over replicas, why the router
chose what it chose, and Ray Serve's own view of the traffic (``ray_serve_*``).

``hybridserve_*`` series are filtered by ``model``; Ray Serve's by ``application`` (the
Serve application name, ``hybridserve`` for ``hybridserve serve``). Serve labels its
replicas by Serve replica id, the engine by rank; both are shown as they are.
"""

from __future__ import annotations

from cluster.observability.dashboards.model import Dashboard, Panel, Row, Target, Variable
from cluster.observability.dashboards.pd import PD
from cluster.observability.dashboards.promql import gauge, quantile, rate, ratio
from cluster.observability.dashboards.tiers import STORE

MODEL = 'model=~"$model"'
APP = 'application=~"$application"'
ENGINE_DEPLOYMENT = f'{APP}, deployment=~"EngineReplica|PDPrefill|PDDecode"'

REPLICAS = Row(
    "Replicas",
    (
        Panel(
            "Load per replica",
            "Requests running plus waiting in each engine (hybridserve rank), and "
            "queries Ray Serve sees in flight at each EngineReplica (Serve replica id).",
            (
                Target(
                    f"{gauge('hybridserve_num_running_requests', MODEL, ('replica',))} + "
                    f"{gauge('hybridserve_num_waiting_requests', MODEL, ('replica',))}",
                    "engine {{replica}}",
                ),
                Target(
                    gauge("ray_serve_replica_processing_queries", ENGINE_DEPLOYMENT, ("replica",)), "serve {{replica}}"
                ),
            ),
            width=8,
        ),
        Panel(
            "Generated tokens per replica",
            "Output tokens per second by replica: the work each one does.",
            (Target(rate("hybridserve_generation_tokens_total", MODEL, ("replica",)), "{{replica}}"),),
            width=8,
        ),
        Panel(
            "Cache-hit share per replica",
            "Share of each replica's prompt tokens served from its prefix "
            "cache (hit tokens / looked-up tokens over the window). A replica far below the others "
            "is receiving prompts whose checkpoints live elsewhere.",
            (
                Target(
                    ratio(
                        rate("hybridserve_prefix_hit_tokens_total", MODEL, ("replica",)),
                        rate("hybridserve_prefix_query_tokens_total", MODEL, ("replica",)),
                    ),
                    "{{replica}}",
                ),
            ),
            unit="percentunit",
            max=1.0,
            width=8,
        ),
    ),
)

ROUTING = Row(
    "Routing",
    (
        Panel(
            "Router decisions by reason",
            "Routing decisions per second: prefix (sent to the replica "
            "holding the deepest usable checkpoint), cold (no checkpoint anywhere), imbalanced (load "
            "gate overrode the cache), fallback (the index failed; power of two). Fallbacks are an alarm.",
            (Target(rate("hybridserve_router_decisions_total", MODEL, ("reason",)), "{{reason}}"),),
            unit="ops",
        ),
        Panel(
            "Router decision share",
            "Each reason's share of all decisions over the window.",
            (
                Target(
                    ratio(
                        rate("hybridserve_router_decisions_total", MODEL, ("reason",)),
                        f"scalar({rate('hybridserve_router_decisions_total', MODEL)})",
                    ),
                    "{{reason}}",
                ),
            ),
            unit="percentunit",
            max=1.0,
        ),
    ),
)

SERVE = Row(
    "Ray Serve",
    (
        Panel(
            "Serve request rate",
            "HTTP requests per second through the Serve proxy, by application and status code.",
            (
                Target(
                    rate("ray_serve_num_http_requests_total", APP, ("application", "status_code")),
                    "{{application}} {{status_code}}",
                ),
            ),
            unit="reqps",
            width=8,
        ),
        Panel(
            "Serve error rate",
            "HTTP responses with a 4xx or 5xx status per second, by application and "
            "code. 5xx is an alarm; 4xx are client mistakes (bad key, unknown model).",
            (
                Target(
                    rate("ray_serve_num_http_error_requests_total", APP, ("application", "error_code")),
                    "{{application}} {{error_code}}",
                ),
            ),
            unit="reqps",
            width=8,
        ),
        Panel(
            "Serve HTTP latency",
            "Proxy-measured request latency percentiles (streaming requests: until the last chunk).",
            tuple(
                Target(quantile(q, "ray_serve_http_request_latency_ms", APP), f"p{round(q * 100)}")
                for q in (0.5, 0.9, 0.99)
            ),
            unit="ms",
            width=8,
        ),
        Panel(
            "Deployment request rate per replica",
            "Requests per second handled by each Serve replica, by deployment (OpenAIIngress, EngineReplica).",
            (
                Target(
                    rate("ray_serve_deployment_request_counter_total", APP, ("deployment", "replica")),
                    "{{deployment}} {{replica}}",
                ),
            ),
            unit="reqps",
        ),
        Panel(
            "Deployment processing latency",
            "p50 and p99 of the time a replica spends on one call, by deployment.",
            tuple(
                Target(
                    quantile(q, "ray_serve_deployment_processing_latency_ms", APP, ("deployment",)),
                    f"{{{{deployment}}}} p{round(q * 100)}",
                )
                for q in (0.5, 0.99)
            ),
            unit="ms",
        ),
    ),
)

CLUSTER = Dashboard(
    uid="hybridserve-cluster",
    title="hybridserve / Cluster",
    description="Replicas, routing, the cluster checkpoint store and Ray Serve traffic of a hybridserve cluster.",
    rows=(REPLICAS, ROUTING, PD, STORE, SERVE),
    variables=(
        Variable("model", "Model", "label_values(hybridserve_num_running_requests, model)"),
        Variable("application", "Serve application", "label_values(ray_serve_num_http_requests_total, application)"),
    ),
)

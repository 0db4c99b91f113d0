"""The process environment Ray Serve reads at start-up, set before ``ray.init`` (one place).

``RAY_SERVE_PROXY_USE_GRPC=1``: the Serve proxy passes HTTP requests and their streamed
responses to the ingress replicas over Serve's gRPC channel (by value) instead of as Ray
objects, as the ingress's handle to the engine replicas does (``_by_reference=False``,
``cluster/api/ingress.py``); it costs the proxy and the ingress a third less CPU per
stream item (``python -m cluster.bench.http_hops``, BENCHMARKS.md). Ray reads it in the
proxy's own process when that starts, so it must be in the environment of whoever starts
Ray (``ray.init`` here, ``ray start`` on a cluster: ``deploy/rayservice.yaml`` sets it).
"""
from __future__ import annotations

import os

SERVE_ENV = {"RAY_SERVE_PROXY_USE_GRPC": "1"}


def apply_serve_env() -> None:
    """Set each variable this process's environment does not set already (a user's value wins)."""
    for name, value in SERVE_ENV.items():
        os.environ.setdefault(name, value)

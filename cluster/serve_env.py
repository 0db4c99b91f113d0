"""The process environment Ray Serve reads at start-up, set before ``ray.init`` (one place).

``RAY_SERVE_PROXY_USE_GRPC=1``: the Serve proxy passes HTTP requests and their streamed
responses to the ingress replicas over Serve's gRPC channel (by value) instead of as Ray
objects, as the ingress's handle to the engine replicas does (``_by_reference=False``,
``cluster/api/ingress.py``); it costs the proxy and the ingress less CPU per stream item
(``python -m tests.lab.http_hops``, BENCHMARKS.md).

``RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0`` and ``RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0``
(two of Serve's "throughput optimized" settings): the deployments' code and the handles'
request routers run on the replica's own event loop instead of a thread and a loop of their
own, so a request and every stream item cross one thread less in the proxy, the ingress and
the engine replica. Neither deployment blocks its loop: the engine steps on its own thread
(``serving/engine_loop.py``), the ingress only parses, tokenizes and renders.

Ray reads these in each process when Serve is imported, so they must be in the environment
of whoever starts Ray (``ray.init`` here, ``ray start`` on a cluster:
``deploy/rayservice.yaml`` sets them).
"""

from __future__ import annotations

import os

SERVE_ENV = {
    "RAY_SERVE_PROXY_USE_GRPC": "1",
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
}


def apply_serve_env() -> None:
    """Set each variable this process's environment does not set already (a user's value wins)."""
    for name, value in SERVE_ENV.items():
        os.environ.setdefault(name, value)

"""``hybridserve serve``: a local Ray cluster running the app until Ctrl-C (Ray edge)."""
from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType

from configs.schema import HybridServeConfig


def endpoint_urls(config: HybridServeConfig, route_prefix: str = "/") -> tuple[str, str]:
    host = config.server.host
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    base = f"http://{shown}:{config.server.port}{route_prefix.rstrip('/')}"
    return f"{base}/v1", f"http://{shown}:{config.metrics.port}/metrics"


def serve_forever(config: HybridServeConfig, num_cpus: int | None = None,
                  app_name: str = "hybridserve",
                  sidecar: Callable[[], contextlib.AbstractContextManager[object]] | None = None) -> int:
    """``sidecar`` (e.g. a local Prometheus) is entered once the app runs, left before it stops."""
    import ray
    from ray import serve

    from cluster.actors import kill_app_actors
    from cluster.app import build_app_from_config

    app = build_app_from_config(config)       # config errors surface before Ray starts
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = signal.signal(signal.SIGTERM, on_signal)
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False)
    try:
        serve.start(http_options={"host": config.server.host, "port": config.server.port})
        serve.run(app, name=app_name, route_prefix="/")
        api, metrics = endpoint_urls(config)
        print(f"hybridserve: serving {config.model} as OpenAI API at {api}", flush=True)
        print(f"hybridserve: metrics at {metrics}", flush=True)
        with sidecar() if sidecar else contextlib.nullcontext():
            print("hybridserve: Ctrl-C to stop", flush=True)
            while not stop.wait(0.5):
                pass
    except KeyboardInterrupt:
        pass
    finally:
        print("hybridserve: stopping", file=sys.stderr, flush=True)
        try:
            serve.shutdown()
            kill_app_actors(app_name)
        finally:
            ray.shutdown()
            signal.signal(signal.SIGTERM, previous)
    return 0

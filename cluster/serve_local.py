"""``hybridserve serve``: a local Ray cluster running the app until SIGINT or SIGTERM (Ray edge).

Shutdown, on the first SIGINT (Ctrl-C) or SIGTERM: the ingress starts draining (new
requests get 503 + ``Retry-After`` with an OpenAI error object, in-flight ones run to
completion), the command waits until none is in flight or ``grace_s`` has passed, then
stops Serve and Ray and exits 0. A second signal skips the rest of the wait. After the
exit the port is closed: clients get connection refused.

The handlers are installed after ``ray.init``, which replaces the SIGTERM handler with
its own (``sys.exit`` from wherever the main thread is, which aborted the process).
``ray.init`` runs with SIGTERM blocked, so the GCS and raylet it starts inherit a blocked
SIGTERM (as Ray itself blocks SIGINT for them): a SIGTERM sent to the whole process group
(``kill -- -PGID``, systemd, ``timeout``) reaches only this process, which drains and
then stops them (``ray.shutdown`` escalates to SIGKILL after 1 s).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from configs.schema import HybridServeConfig

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def endpoint_urls(config: HybridServeConfig, route_prefix: str = "/") -> tuple[str, str]:
    host = config.server.host
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    base = f"http://{shown}:{config.server.port}{route_prefix.rstrip('/')}"
    return f"{base}/v1", f"http://{shown}:{config.metrics.port}/metrics"


class StopSignals:
    """SIGINT/SIGTERM handlers: the first sets ``stop``, a second also sets ``force``."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.force = threading.Event()
        self._previous: dict[int, Any] = {}

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        (self.force if self.stop.is_set() else self.stop).set()

    def install(self) -> None:
        self._previous = {sig: signal.signal(sig, self) for sig in SIGNALS}

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def drain(app_name: str, grace_s: float, force: threading.Event) -> int:
    """Make the app's ingress refuse new requests, then wait for the in-flight ones (at
    most ``grace_s``, less if ``force`` is set). Returns the requests still in flight."""
    from ray import serve

    try:
        handle = serve.get_app_handle(app_name)
        left = handle.begin_drain.remote().result(timeout_s=10)
        deadline = time.monotonic() + grace_s
        while left > 0 and time.monotonic() < deadline and not force.is_set():
            time.sleep(0.1)
            left = handle.num_in_flight.remote().result(timeout_s=10)
    except Exception as exc:  # noqa: BLE001 - shutting down regardless
        print(f"hybridserve: drain failed: {exc!r}", file=sys.stderr, flush=True)
        return -1
    return left


def serve_forever(
    config: HybridServeConfig,
    num_cpus: int | None = None,
    app_name: str = "hybridserve",
    sidecar: Callable[[], contextlib.AbstractContextManager[object]] | None = None,
) -> int:
    """``sidecar`` (e.g. a local Prometheus) is entered once the app runs, left before it stops."""
    import ray
    from ray import serve

    from cluster.actors import kill_app_actors
    from cluster.app import build_app_from_config
    from cluster.serve_env import apply_serve_env

    app = build_app_from_config(config)  # config errors surface before Ray starts
    signals = StopSignals()
    try:
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        try:
            apply_serve_env()
            ray.init(address="local", num_cpus=num_cpus, include_dashboard=False)
            signals.install()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)  # a pending SIGTERM lands now
        serve.start(http_options={"host": config.server.host, "port": config.server.port})
        serve.run(app, name=app_name, route_prefix="/")
        api, metrics = endpoint_urls(config)
        print(f"hybridserve: serving {config.model} as OpenAI API at {api}", flush=True)
        print(f"hybridserve: metrics at {metrics}", flush=True)
        with sidecar() if sidecar else contextlib.nullcontext():
            print("hybridserve: Ctrl-C to stop", flush=True)
            while not signals.stop.wait(0.5):
                pass
            print("hybridserve: draining", file=sys.stderr, flush=True)
            left = drain(app_name, config.ingress.graceful_shutdown_timeout_s, signals.force)
            print(f"hybridserve: drained ({left} requests left)", file=sys.stderr, flush=True)
    except KeyboardInterrupt:  # before the handlers were installed
        pass
    finally:
        print("hybridserve: stopping", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        try:
            if ray.is_initialized():
                serve.shutdown()
                kill_app_actors(app_name)
        finally:
            t1 = time.monotonic()
            ray.shutdown()
            signals.restore()
            print(
                f"hybridserve: stopped (Serve {t1 - t0:.1f} s, Ray {time.monotonic() - t1:.1f} s)",
                file=sys.stderr,
                flush=True,
            )
    return 0

"""Apps on the session's one local Ray cluster + Serve (``serve_session``, tests/conftest.py,
HTTP on 127.0.0.1, a free port; shared with tests/observability).

Apps are deployed per test module under their own name and route prefix (so several can
coexist) with small CPU-only engines, and deleted when the module ends.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.conftest import ServeSession, free_port  # noqa: F401 - free_port is re-exported

SMALL_ENGINE = {
    "device": "cpu",
    "dtype": "float32",
    "cache": {"page_size": 4, "max_kv_tokens": 2048, "max_mamba_slots": 32},
    "scheduler": {"max_running_requests": 8, "max_batch_tokens": 512, "chunked_prefill_size": 128},
}
FAST_PUBLISH = {"num_cpus": 1, "stats_interval_s": 0.2, "events_interval_s": 0.02}


@dataclass(frozen=True)
class DeployedApp:
    name: str
    base_url: str  # http://127.0.0.1:PORT/PREFIX (no trailing slash)
    metrics_url: str
    api_key: str | None

    @property
    def openai_base(self) -> str:
        return f"{self.base_url}/v1"


def deploy(
    session: ServeSession,
    name: str,
    model_dir: str,
    overrides: dict[str, Any] | None = None,
    args: dict[str, Any] | None = None,
) -> DeployedApp:
    from ray import serve

    from cluster.app import AppArgs, build_app_from_config
    from configs.schema import load_config

    metrics_port = free_port()
    config = load_config(
        overrides={**SMALL_ENGINE, "model": model_dir, "metrics": {"port": metrics_port}, **(overrides or {})}
    )
    app_args = AppArgs.model_validate({"replica": FAST_PUBLISH, "router": {"min_match_tokens": 4}, **(args or {})})
    serve.run(build_app_from_config(config, app_args), name=name, route_prefix=f"/{name}")
    return DeployedApp(
        name,
        f"http://127.0.0.1:{session.http_port}/{name}",
        f"http://127.0.0.1:{metrics_port}/metrics",
        config.server.api_key,
    )


@pytest.fixture(scope="module")
def deployed(serve_session) -> Iterator[Callable[..., DeployedApp]]:
    """``deployed(name, model_dir, overrides=..., args=...)``; apps die with the module."""
    from ray import serve

    names: list[str] = []

    def make(name: str, model_dir: str, **kwargs: Any) -> DeployedApp:
        names.append(name)
        return deploy(serve_session, name, model_dir, **kwargs)

    yield make
    for name in names:
        serve.delete(name)


def wait_until(predicate: Callable[[], Any], timeout_s: float = 30.0, interval_s: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s}s")
        time.sleep(interval_s)


def index_actor(app_name: str):
    import ray

    from cluster.actors import NAMESPACE, index_actor_name

    return ray.get_actor(index_actor_name(app_name), namespace=NAMESPACE)

"""Shared fixtures: tiny random HF checkpoints, built once per test session, and the
session's one local Ray cluster + Serve (used by tests/e2e and tests/observability; a
session fixture must live here to be shared by both: one ``ray.init`` per process)."""
from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from cluster.net import free_port

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_qwen_dir(tmp_path_factory):
    from workers.models.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint("qwen3_next", tmp_path_factory.mktemp("qwen3_next"), seed=0, mtp=True)


@pytest.fixture(scope="session")
def tiny_granite_dir(tmp_path_factory):
    from workers.models.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint("granitemoehybrid", tmp_path_factory.mktemp("granite"), seed=0)


@pytest.fixture(scope="session", params=["qwen3_next", "granitemoehybrid"])
def tiny_model_dir(request, tiny_qwen_dir, tiny_granite_dir):
    return tiny_qwen_dir if request.param == "qwen3_next" else tiny_granite_dir


RAY_NUM_CPUS = 16                          # logical: replicas ask for 1 each, the machine has 2


@dataclass(frozen=True)
class ServeSession:
    http_port: int
    gcs_address: str


@pytest.fixture(scope="session")
def serve_session() -> Iterator[ServeSession]:
    import ray
    from ray import serve

    ray.init(num_cpus=RAY_NUM_CPUS, include_dashboard=False,
             log_to_driver=bool(os.environ.get("HYBRIDSERVE_TEST_RAY_LOGS")))
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield ServeSession(port, ray.get_runtime_context().gcs_address)
    serve.shutdown()
    ray.shutdown()


def pytest_configure(config):
    # Two shared cores: OpenMP spin-waits make tiny ops erratic when threads > 1.
    import torch

    torch.set_num_threads(1)

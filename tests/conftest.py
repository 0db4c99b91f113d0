"""Shared fixtures: tiny random HF checkpoints, built once per test session, and the
session's one local Ray cluster + Serve (used by tests/e2e and tests/observability; a
session fixture must live here to be shared by both: one ``ray.init`` per process).

The registry-driven suite: every test that takes ``tiny_model_dir`` (or ``tiny_model``) runs
once per family of ``tools.tiny_registry.TINY_FAMILIES``, and every test that takes
``tiny_mtp_model_dir`` once per family with MTP weights, so a registered family is tested
with no new test. Checkpoints are built lazily, once per session and family (seed 0, with
``mtp.*`` tensors where the family has them)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from cluster.net import free_port
from configs.schema import COMPILE_DEFAULT_ENV
from tools.tiny_registry import TINY_FAMILIES, TinyFamily

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Engines of a config that does not set compile.enabled run eager in the tests (and in the
# ``hybridserve serve`` processes and Ray workers they start, which inherit this): a cold
# compile costs minutes on two cores. Tests of compiled steps set compile.enabled.
os.environ.setdefault(COMPILE_DEFAULT_ENV, "0")

FAMILIES = sorted(TINY_FAMILIES)
MTP_FAMILIES = sorted(name for name, f in TINY_FAMILIES.items() if f.has_mtp)
# One family per kind of recurrent state and per engine path it takes: GDN with MTP
# (qwen3_next; qwen3_5, the layout people serve), Mamba2 / SSD (granitemoehybrid; nemotron_h,
# with MTP), Mamba1 (jamba), KDA + MLA (kimi_linear), lightning attention (minimax), short
# convolutions (lfm2), RG-LRU (recurrent_gemma), CCA (zaya), several conv windows beside
# KV (inkling), the indexer's paged rows and indexed attention (qwen4_exp). A test marked
# ``core_families`` runs the other families only in
# ``make test-slow`` (every family still loads and matches transformers in ``make test``).
CORE_FAMILIES = frozenset(
    {
        "qwen3_next",
        "qwen3_5",
        "granitemoehybrid",
        "nemotron_h",
        "jamba",
        "kimi_linear",
        "minimax",
        "lfm2",
        "recurrent_gemma",
        "zaya",
        "inkling",
        "qwen4_exp",
    }
)
assert CORE_FAMILIES <= set(FAMILIES), CORE_FAMILIES - set(FAMILIES)


@dataclass(frozen=True)
class TinyModel:
    family: TinyFamily
    path: Path


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Callable[[str], Path]:
    """``name -> checkpoint dir`` of the registered tiny family, built on first use."""
    from tools.tiny import make_tiny_checkpoint

    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            family = TINY_FAMILIES[name]
            built[name] = make_tiny_checkpoint(name, tmp_path_factory.mktemp(name), seed=0, mtp=family.has_mtp)
        return built[name]

    return get


@pytest.fixture(scope="session", params=FAMILIES)
def tiny_model(request, tiny_checkpoint) -> TinyModel:
    return TinyModel(TINY_FAMILIES[request.param], tiny_checkpoint(request.param))


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model) -> Path:
    return tiny_model.path


@pytest.fixture(scope="session", params=MTP_FAMILIES)
def tiny_mtp_model_dir(request, tiny_checkpoint) -> Path:
    return tiny_checkpoint(request.param)


@pytest.fixture(scope="session")
def tiny_qwen_dir(tiny_checkpoint) -> Path:
    return tiny_checkpoint("qwen3_next")


@pytest.fixture(scope="session")
def tiny_granite_dir(tiny_checkpoint) -> Path:
    return tiny_checkpoint("granitemoehybrid")


@pytest.fixture(scope="session")
def compile_cache_dir(tmp_path_factory) -> Path:
    """One persistent compile cache (``compile.cache_dir``) for every compiled engine of the
    session: a graph compiled by one test module is a cache hit for the next."""
    return tmp_path_factory.mktemp("compile_cache")


@pytest.fixture(scope="session")
def scripted_hermes_dir(tmp_path_factory):
    """Greedy output is a known text: reasoning + hermes tool calls (tests/cluster/api/scripted_model.py)."""
    from tests.cluster.api.scripted_model import make_scripted_checkpoint

    return make_scripted_checkpoint("hermes", tmp_path_factory.mktemp("scripted_hermes"))


@pytest.fixture(scope="session")
def scripted_xml_dir(tmp_path_factory):
    from tests.cluster.api.scripted_model import make_scripted_checkpoint

    return make_scripted_checkpoint("xml", tmp_path_factory.mktemp("scripted_xml"))


RAY_NUM_CPUS = 16  # logical: replicas ask for 1 each, the machine has 2


@dataclass(frozen=True)
class ServeSession:
    http_port: int
    gcs_address: str


@pytest.fixture(scope="session")
def serve_session() -> Iterator[ServeSession]:
    import ray
    from ray import serve

    from cluster.serve_env import apply_serve_env

    apply_serve_env()  # the production transport (gRPC proxy -> ingress)
    ray.init(
        num_cpus=RAY_NUM_CPUS, include_dashboard=False, log_to_driver=bool(os.environ.get("HYBRIDSERVE_TEST_RAY_LOGS"))
    )
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield ServeSession(port, ray.get_runtime_context().gcs_address)
    serve.shutdown()
    ray.shutdown()


# Families whose layers and states another family has (``TinyFamily.light``; a multimodal
# wrapper, with a ``text_config_key``, runs its text family's code): in ``make test`` they
# check only their equality with transformers (model and engine), the rest is ``slow``.
LIGHT_FAMILIES = frozenset(name for name, f in TINY_FAMILIES.items() if f.light or f.text_config_key)
LIGHT_FAST_MODULES = ("tests.workers.models.test_vs_transformers", "tests.workers.engine.test_vs_transformers")


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.core_families(all_families_for={"strategy": "x"}, families=...)``: the
    test's items of a family outside ``families`` (default ``CORE_FAMILIES``) become ``slow``,
    except those whose parameters match ``all_families_for`` (those run for every family).
    A light family's items outside ``LIGHT_FAST_MODULES`` are ``slow`` too."""
    for item in items:
        mark = item.get_closest_marker("core_families")
        params = getattr(getattr(item, "callspec", None), "params", {})
        family = params.get("tiny_model")
        if family in LIGHT_FAMILIES and item.module.__name__ not in LIGHT_FAST_MODULES:
            item.add_marker(pytest.mark.slow)
            continue
        if mark is None or family is None or family in mark.kwargs.get("families", CORE_FAMILIES):
            continue
        keep = mark.kwargs.get("all_families_for")
        if keep and all(params.get(k) == v for k, v in keep.items()):
            continue
        item.add_marker(pytest.mark.slow)


def pytest_configure(config):
    # Two shared cores: OpenMP spin-waits make tiny ops erratic when threads > 1.
    import torch

    torch.set_num_threads(1)

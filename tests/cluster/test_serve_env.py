"""The Serve environment (``cluster.serve_env``): names Ray reads, a user's value wins, and
the Kuberay manifest sets the same values on every Ray node."""

from __future__ import annotations

from pathlib import Path

import yaml

from cluster.serve_env import SERVE_ENV, apply_serve_env

ROOT = Path(__file__).resolve().parents[2]


def test_every_variable_is_one_serve_reads():
    """A renamed variable would be set and silently ignored."""
    from ray.serve._private import constants

    for name in SERVE_ENV:
        assert hasattr(constants, name), f"Ray Serve {constants.__file__} has no {name}"


def test_apply_sets_what_the_environment_lacks_and_keeps_a_users_value(monkeypatch):
    for name in SERVE_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD", "1")
    apply_serve_env()
    import os

    assert os.environ["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] == "1"
    assert os.environ["RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP"] == "0"
    assert os.environ["RAY_SERVE_PROXY_USE_GRPC"] == "1"


def test_the_kuberay_manifest_sets_the_serve_environment_on_every_node():
    spec = yaml.safe_load((ROOT / "deploy" / "rayservice.yaml").read_text())["spec"]["rayClusterConfig"]
    groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    for group in groups:
        (container,) = group["template"]["spec"]["containers"]
        env = {e["name"]: e["value"] for e in container.get("env", [])}
        assert {k: env.get(k) for k in SERVE_ENV} == SERVE_ENV, container["name"]

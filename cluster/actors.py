"""Names and get-or-create of the app's two named actors (Ray edge).

Both actors are detached, named after the Serve application, in the ``hybridserve``
namespace, and created by whoever needs them first (a replica, a router, the ingress)
with ``get_if_exists``, so creation order does not matter and a restarted consumer finds
the same actor. They are registered with the Serve controller to die on
``serve.shutdown()``; deleting one app leaves its actors until then (they hold no CPU).
"""
from __future__ import annotations

import logging
from typing import Any

import ray

from cluster.observability.metrics_actor import MetricsActor
from cluster.routing.router_actor import RouterIndexActor

logger = logging.getLogger(__name__)
NAMESPACE = "hybridserve"


def index_actor_name(app_name: str) -> str:
    return f"{app_name}.router_index"


def metrics_actor_name(app_name: str) -> str:
    return f"{app_name}.metrics"


def _get_or_create(cls: Any, name: str, *args: Any) -> Any:
    handle = cls.options(name=name, namespace=NAMESPACE, get_if_exists=True, lifetime="detached",
                         num_cpus=0, max_restarts=-1).remote(*args)
    _register_cleanup(handle)
    return handle


def _register_cleanup(handle: Any) -> None:
    try:
        from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        controller._register_shutdown_cleanup_actor.remote(handle)
    except Exception:  # noqa: BLE001 - private Serve API; cleanup is a nicety
        logger.debug("could not register %s for cleanup", handle, exc_info=True)


def get_index_actor(app_name: str, forget_after_s: float = 30.0) -> Any:
    return _get_or_create(RouterIndexActor, index_actor_name(app_name), forget_after_s)


def get_metrics_actor(app_name: str, host: str, port: int) -> Any:
    return _get_or_create(MetricsActor, metrics_actor_name(app_name), host, port)


def kill_app_actors(app_name: str) -> None:
    """Kill both actors of an app if they exist (the CLI does this on exit)."""
    for name in (index_actor_name(app_name), metrics_actor_name(app_name)):
        try:
            ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
        except ValueError:
            pass

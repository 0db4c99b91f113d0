"""Names and get-or-create of the app's named actors (Ray edge): the router index, the
metrics actor and (with ``cache.cluster_store_bytes``) the checkpoint store.

All are detached, named after the Serve application, in the ``hybridserve`` namespace,
and created by whoever needs them first (a replica, a router, the ingress) with
``get_if_exists``, so creation order does not matter and a restarted consumer finds the
same actor. They are pinned to the head node when Ray names one, so that losing a worker
node loses no app state but that node's replicas. The affinity is hard: a soft one can
land the store on the creating replica's worker node (the worker's raylet decides, on a
resource view that may lag), and the cluster does not outlive its head anyway (the GCS
lives there). They are registered with the Serve controller to die on ``serve.shutdown()``;
deleting one app leaves its actors until then (they hold no CPU).
"""

from __future__ import annotations

import logging
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cluster.observability.metrics_actor import MetricsActor
from cluster.routing.router_actor import RouterIndexActor
from cluster.store.actor import CheckpointStoreActor

logger = logging.getLogger(__name__)
NAMESPACE = "hybridserve"


def index_actor_name(app_name: str) -> str:
    return f"{app_name}.router_index"


def metrics_actor_name(app_name: str) -> str:
    return f"{app_name}.metrics"


def store_actor_name(app_name: str) -> str:
    return f"{app_name}.checkpoint_store"


def head_node_strategy() -> Any:
    """The head node (hard affinity: see the module docstring); None when Ray names no head."""
    try:
        for node in ray.nodes():
            if node.get("Alive") and "node:__internal_head__" in node.get("Resources", {}):
                return NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
    except Exception:  # noqa: BLE001 - placement is a preference, never a failure
        logger.debug("could not find the head node", exc_info=True)
    return None


def _get_or_create(cls: Any, name: str, *args: Any) -> Any:
    options: dict[str, Any] = {
        "name": name,
        "namespace": NAMESPACE,
        "get_if_exists": True,
        "lifetime": "detached",
        "num_cpus": 0,
        "max_restarts": -1,
    }
    strategy = head_node_strategy()
    if strategy is not None:
        options["scheduling_strategy"] = strategy
    handle = cls.options(**options).remote(*args)
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


def get_store_actor(app_name: str, budget_bytes: int, model: str = "", metrics: Any = None) -> Any:
    return _get_or_create(CheckpointStoreActor, store_actor_name(app_name), budget_bytes, model, metrics)


def kill_app_actors(app_name: str) -> None:
    """Kill the actors of an app if they exist (the CLI does this on exit)."""
    for name in (index_actor_name(app_name), metrics_actor_name(app_name), store_actor_name(app_name)):
        try:
            ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
        except ValueError:
            pass

"""Tensor parallelism on Ray: ranks 1..N-1 as actors in the replica's placement group.

The app builder gives every ``EngineReplica`` a placement group of one bundle per rank
(``tp_bundles``, STRICT_PACK: the ranks of a group share a node); the replica is rank 0
in bundle 0. ``build_tp_engine`` -- what ``replica_core.build_engine`` returns for
``tensor_parallel_size > 1`` -- hosts the rendezvous store on a free port, starts one
``TPWorkerActor`` per rank r >= 1 in bundle r, waits until all joined (failing at once
when one dies while starting), then builds the ``TPEngine`` (rank 0) in this process.
Called outside a placement group (a driver script), it creates one for ranks 1..N-1 and
removes it on shutdown. Workers are owned by the replica, so they die with it.
"""

from __future__ import annotations

import logging
from typing import Any

import ray
import torch
from ray.util import get_current_placement_group, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from configs.schema import HybridServeConfig
from workers.tp.comm import Rendezvous

logger = logging.getLogger(__name__)
PLACEMENT_TIMEOUT_S = 120.0


def uses_gpu(config: HybridServeConfig) -> bool:
    """One GPU per rank for ``device: cuda``; ``auto`` asks this process (the app builder)."""
    if config.device != "auto":
        return config.device == "cuda"
    return torch.cuda.is_available()


def rank_resources(config: HybridServeConfig) -> dict[str, float]:
    return {"CPU": 1.0, "GPU": 1.0} if uses_gpu(config) else {"CPU": 1.0}


def tp_bundles(config: HybridServeConfig, replica_num_cpus: float) -> list[dict[str, float]]:
    """One bundle per rank; bundle 0 also holds the replica actor's own CPUs."""
    first = {**rank_resources(config)}
    first["CPU"] = max(first["CPU"], replica_num_cpus)
    return [first] + [rank_resources(config) for _ in range(config.parallel.tensor_parallel_size - 1)]


@ray.remote
class TPWorkerActor:
    """A ``TPWorker`` (workers/tp/worker.py) in its own process; ``run`` blocks until Stop."""

    def __init__(self, config: dict[str, Any], rank: int, rendezvous: Rendezvous, num_threads: int) -> None:
        from workers.tp.worker import TPWorker

        self._worker = TPWorker(HybridServeConfig.model_validate(config), rank, rendezvous, num_threads)

    def run(self) -> int:
        return self._worker.run()


class RayWorkers:
    """Handles on ranks 1..N-1 for the engine: health and shutdown."""

    def __init__(self, actors: list[Any], runs: list[Any], owned_group: Any = None) -> None:
        self.actors, self.runs, self.owned_group = actors, runs, owned_group
        self._closed = False

    def check_health(self) -> None:
        if self._closed:
            return
        done, _ = ray.wait(self.runs, num_returns=1, timeout=0)
        if done:
            rank = self.runs.index(done[0]) + 1
            try:
                steps = ray.get(done[0])
            except Exception as exc:  # noqa: BLE001 - reported as the rank's failure
                raise RuntimeError(f"tensor-parallel rank {rank} failed: {exc}") from exc
            raise RuntimeError(f"tensor-parallel rank {rank} stopped after {steps} steps")

    def shutdown(self, timeout_s: float = 10.0) -> None:
        if self._closed:
            return
        self._closed = True
        ray.wait(self.runs, num_returns=len(self.runs), timeout=timeout_s)
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        if self.owned_group is not None:
            remove_placement_group(self.owned_group)


def _placement(config: HybridServeConfig) -> tuple[Any, int, Any]:
    """-> (placement group, bundle index of rank 1, the group if created here)."""
    world = config.parallel.tensor_parallel_size
    current = get_current_placement_group()
    if current is not None and len(current.bundle_specs) >= world:
        return current, 1, None
    owned = placement_group([rank_resources(config) for _ in range(world - 1)], strategy="STRICT_PACK")
    try:
        ray.get(owned.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except BaseException:
        remove_placement_group(owned)
        raise
    return owned, 0, owned


def build_tp_engine(config: HybridServeConfig) -> Any:
    """Rank 0's ``TPEngine`` here, ranks 1..N-1 as actors (see the module docstring)."""
    from workers.engine import resolve_device
    from workers.tp.comm import TPGroup, open_rendezvous, wait_joined
    from workers.tp.engine import TPEngine

    world = config.parallel.tensor_parallel_size
    group, first_bundle, owned = _placement(config)
    store, rendezvous = open_rendezvous(ray.util.get_node_ip_address(), world)
    res = rank_resources(config)
    payload = config.model_dump(mode="json")
    actors = [
        TPWorkerActor.options(
            num_cpus=res["CPU"],
            num_gpus=res.get("GPU", 0.0),
            name=None,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=first_bundle + rank - 1
            ),
        ).remote(payload, rank, rendezvous, torch.get_num_threads())
        for rank in range(1, world)
    ]
    workers = RayWorkers(actors, [a.run.remote() for a in actors], owned)
    try:
        wait_joined(store, rendezvous, workers.check_health)
        tp_group = TPGroup(rendezvous, 0, resolve_device(config.device), store)
        engine = TPEngine(config, tp_group, workers)
    except BaseException:
        workers.shutdown(timeout_s=0)
        raise
    logger.info("tensor-parallel group of %d ready (rendezvous %s:%d)", world, rendezvous.host, rendezvous.port)
    return engine

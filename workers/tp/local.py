"""TP without Ray: ranks 1..N-1 as spawned processes on this machine (offline API, tests).

``build_local_engine(config)`` is what ``LLM`` uses: a plain ``Engine`` for
``tensor_parallel_size == 1``, else a ``TPEngine`` (rank 0, in this process) whose other
ranks are daemon processes running ``TPWorker``. The serving path starts them as Ray
actors in the replica's placement group instead (``cluster/serving/tp.py``).
"""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

import torch

from configs.schema import HybridServeConfig
from workers.engine import Engine, resolve_device
from workers.loader import load_config
from workers.tp.comm import Rendezvous, TPGroup, open_rendezvous, wait_joined
from workers.tp.engine import TPEngine
from workers.tp.shard import validate_tp

KILL_WAIT_S = 2.0  # how long a signalled rank may take to exit


def _worker_main(config: dict[str, Any], rank: int, rendezvous: Rendezvous, num_threads: int) -> None:
    from workers.tp.worker import TPWorker

    TPWorker(HybridServeConfig.model_validate(config), rank, rendezvous, num_threads).run()


class LocalWorkers:
    def __init__(self, procs: list[Any]) -> None:
        self.procs = procs

    def check_health(self) -> None:
        for rank, p in enumerate(self.procs, start=1):
            if not p.is_alive() and p.exitcode != 0:
                raise RuntimeError(f"tensor-parallel rank {rank} exited with code {p.exitcode}")

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Wait up to ``timeout_s`` for each rank to exit, then SIGTERM, then SIGKILL: a
        stopped process, or one whose SIGTERM handler cannot run, outlives SIGTERM, and
        multiprocessing's exit handler would then wait for it without a bound."""
        for p in self.procs:
            p.join(timeout_s)
            for end in (p.terminate, p.kill):
                if p.is_alive():
                    end()
                    p.join(KILL_WAIT_S)


def build_local_engine(config: HybridServeConfig) -> Engine:
    world = config.parallel.tensor_parallel_size
    if world == 1:
        return Engine(config)
    validate_tp(load_config(config.model_dir()), world)  # before any process starts
    store, rendezvous = open_rendezvous("127.0.0.1", world)
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(
            target=_worker_main,
            name=f"hybridserve-tp{rank}",
            daemon=True,
            args=(config.model_dump(mode="json"), rank, rendezvous, torch.get_num_threads()),
        )
        for rank in range(1, world)
    ]
    for p in procs:
        p.start()
    workers = LocalWorkers(procs)
    try:
        wait_joined(store, rendezvous, workers.check_health)
        group = TPGroup(rendezvous, 0, resolve_device(config.device), store)
        return TPEngine(config, group, workers)
    except BaseException:
        workers.shutdown(timeout_s=0.0)
        raise

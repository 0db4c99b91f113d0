"""``TPEngine``: rank 0 of a TP group -- the engine, with a sharded model and pools.

The scheduler, caches and ledger stay single (rank 0 decides; page and slot ids mean
the same on every rank). Against the plain ``Engine`` only three hooks differ: the
loaded model is sharded (``shard_model``), the MTP head too, and the runner is a
``TPModelRunner`` that broadcasts each step; before it, rank 0 sends its ``PoolLayout``
so the other ranks build pools of the same sizes. A launcher (Ray actors in
``cluster/``, spawned processes in ``workers.tp.local``) starts ranks 1..N-1 and passes
a handle with ``check_health()`` and ``shutdown()`` as ``workers``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from configs.schema import HybridServeConfig
from workers.engine import Engine
from workers.loader import LoadedModel
from workers.model_runner import ModelRunner
from workers.state_spec import ATTENTION
from workers.tp.comm import TPGroup
from workers.tp.messages import PoolLayout
from workers.tp.runner import DropRecordingBank, TPModelRunner
from workers.tp.shard import shard_model, shard_module

STOP_GRACE_S = 10.0  # how long ranks 1..N-1 may take to exit after Stop


class WorkerHandles(Protocol):
    def check_health(self) -> None: ...  # raise when a rank has died

    # End the ranks: wait up to ``timeout_s`` for them to exit after ``Stop``, then force.
    def shutdown(self, timeout_s: float = ...) -> None: ...


class TPEngine(Engine):
    supports_tensor_parallel = True

    def __init__(
        self, config: HybridServeConfig, group: TPGroup, workers: WorkerHandles | None = None, tokenizer=None
    ) -> None:
        tp = config.parallel.tensor_parallel_size
        if group.rank != 0 or group.world_size != tp:
            raise ValueError(
                f"TPEngine is rank 0 of tensor_parallel_size={tp}; got rank "
                f"{group.rank} of a group of {group.world_size}"
            )
        self.tp, self.workers = group, workers
        try:
            super().__init__(config, tokenizer)
        except BaseException as exc:
            group.abort(f"rank 0 failed while starting: {exc!r}")  # ranks waiting for the layout fail now
            raise

    def _load_model(self, model_dir: Path) -> LoadedModel:
        loaded = super()._load_model(model_dir)
        shard_model(loaded.model, self.tp)
        return loaded

    def _build_pools(self) -> None:
        super()._build_pools()
        if self.drafter is not None:
            shard_module(self.drafter.mtp, self.tp)

    def _build_runner(self) -> ModelRunner:
        self.tp.broadcast_object(self.pool_layout())
        self.generators = DropRecordingBank(self.config.seed, self.device)
        return TPModelRunner(
            self.model,
            self.pools,
            self.config.cache.page_size,
            self.device,
            self.generators,
            overlap=self.lag > 0,
            scratch_base=self.slot_ledger.num_slots,
            drafter=self.drafter,
            grammar_compiler=self.grammar_compiler,
            max_pages=self.max_pages_per_request(),
            group=self.tp,
            check_consistency=self.config.debug.check_invariants,
        )

    def pool_layout(self) -> PoolLayout:
        kv, mamba = self.pools.kv, self.pools.mamba
        mtp_kv = self.drafter.mtp.kv_index if self.drafter is not None else None
        return PoolLayout(
            kv.num_pages,
            kv.page_size,
            kv.num_layers(ATTENTION),
            mamba.num_slots,
            self.slot_ledger.num_slots,
            self.max_model_len,
            mtp_kv,
            _name(kv.dtype),
        )

    def check_workers(self) -> None:
        """Raise when another rank of the group has died, or the group has failed (it
        never steps again): the replica's health check."""
        if self.workers is not None:
            self.workers.check_health()
        if self.tp.closed:
            raise RuntimeError(f"tensor-parallel group closed: {self.tp.closed_reason}")

    def shutdown(self) -> None:
        """Stop ranks 1..N-1 after the launched steps; safe to call twice. Bounded: the
        ``Stop`` by the group's timeout, then the ranks' exit by ``STOP_GRACE_S`` (none
        when the group has failed: they will not exit on their own), then they are killed."""
        try:
            self.runner.shutdown()
        finally:
            if self.workers is not None:
                self.workers.shutdown(0.0 if self.tp.closed else STOP_GRACE_S)
            self.tp.abort("shut down")


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")

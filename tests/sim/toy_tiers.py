"""The host tier over the toy model: a host pool of ``ToyState``s and a ``TierStorage``
that copies them exactly like ``TensorTierStorage`` copies tensors (KV pages carry no
content in the toy; their ids are still checked by the engine's own invariants).

Copy-ins run on the toy runner's forward thread under overlap (launch order, as the real
storage's ``submit``), at once without; copy-outs run on the calling thread. A forced
failure (``corrupt``) writes ``POISON`` -- a state no prefix has -- where the copy would
have gone, so a path that used a failed copy anyway is caught as a corruption.
"""

from __future__ import annotations

from collections.abc import Sequence

from tests.sim.toy import EMPTY, ToyRunner, ToyState
from workers.tiers.storage import DoneJob, FutureJob, TransferJob

POISON = ToyState(0xDEADBEEF, -1)


class ToyTierStorage:
    def __init__(self, runner: ToyRunner, num_host_slots: int) -> None:
        self.runner = runner
        self.host_pool: list[ToyState] = [EMPTY] * num_host_slots

    def copy_out(
        self, slot: int, pages: Sequence[int], host_slot: int, host_pages: Sequence[int], corrupt: bool = False
    ) -> bool:
        self.host_pool[host_slot] = POISON if corrupt else self.runner.pool[slot]
        return not corrupt

    def copy_in(
        self,
        host_slot: int,
        host_pages: Sequence[int],
        slots: Sequence[int],
        pages: Sequence[int],
        corrupt: bool = False,
    ) -> TransferJob:
        pool, host = self.runner.pool, self.host_pool
        targets = list(slots)

        def run() -> bool:
            for s in targets:
                pool[s] = POISON if corrupt else host[host_slot]
            return not corrupt

        executor = self.runner._executor
        return FutureJob(executor.submit(run)) if executor is not None else DoneJob(run())

    def nbytes(self, num_slots: int, num_pages: int) -> int:
        return num_slots + num_pages


def install_toy_tiers(engine, runner: ToyRunner) -> ToyTierStorage | None:
    """Point the engine's host tier (if any) at toy storage over ``runner``'s pool."""
    host = engine.cache.host
    if host is None:
        return None
    storage = ToyTierStorage(runner, host.ledger.num_slots)
    host.storage = storage  # type: ignore[assignment]
    return storage

"""A TP group over real gloo sockets, its ranks as daemon threads of this process.

``run_group(world, fn, timeout_s)`` connects ``world`` ranks through a rendezvous whose
peer bound is ``timeout_s``, calls ``fn(group)`` on each (``group.rank`` tells them
apart) and returns, in rank order, what each returned or raised -- or ``HUNG`` for a
rank still running ``join_s`` after the start. Daemon threads: a rank that hangs (the
bug these tests look for) fails its test instead of holding the pytest process.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from workers.tp.comm import TPGroup, open_rendezvous, wait_joined

HUNG = "still waiting"


def run_group(world: int, fn: Callable[[TPGroup], Any], timeout_s: float = 60.0, join_s: float = 60.0) -> list[Any]:
    store, rendezvous = open_rendezvous("127.0.0.1", world, timeout_s)
    outcomes: list[Any] = [HUNG] * world

    def body(rank: int) -> None:
        try:
            if rank == 0:
                wait_joined(store, rendezvous)
            group = TPGroup(rendezvous, rank, torch.device("cpu"), store if rank == 0 else None)
            outcomes[rank] = fn(group)
        except BaseException as exc:  # noqa: BLE001 - returned to the test
            outcomes[rank] = exc

    threads = [threading.Thread(target=body, args=(r,), daemon=True, name=f"tp-rank{r}") for r in range(world)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + join_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return outcomes


def timed(call: Callable[[], Any], join_s: float = 60.0) -> tuple[Any, float]:
    """(what ``call()`` returned or raised -- ``HUNG`` past ``join_s`` --, its seconds),
    run on a daemon thread."""
    out: list[Any] = [HUNG]

    def body() -> None:
        try:
            out[0] = call()
        except BaseException as exc:  # noqa: BLE001 - returned to the test
            out[0] = exc

    start = time.monotonic()
    thread = threading.Thread(target=body, daemon=True, name="tp-timed")
    thread.start()
    thread.join(join_s)
    return out[0], time.monotonic() - start

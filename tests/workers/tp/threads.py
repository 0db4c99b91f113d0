"""Ranks as threads of one process, joined by an in-memory all-reduce (no sockets).

``run_ranks(world, fn)`` calls ``fn(comm)`` on ``world`` threads, one ``ThreadComm`` each,
and returns their results in rank order. The all-reduce sums the ranks' tensors in rank
order, so every rank gets the same bits, as gloo gives them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch


class _Board:
    def __init__(self, world: int) -> None:
        self.barrier = threading.Barrier(world, timeout=60)
        self.slots: list[torch.Tensor | None] = [None] * world


class ThreadComm:
    def __init__(self, rank: int, world_size: int, board: _Board) -> None:
        self.rank, self.world_size, self._board = rank, world_size, board
        self.num_all_reduces = 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        board = self._board
        board.slots[self.rank] = tensor.clone()
        board.barrier.wait()
        total = torch.stack(board.slots).sum(0)  # type: ignore[arg-type]
        board.barrier.wait()
        tensor.copy_(total)
        self.num_all_reduces += 1
        return tensor


def run_ranks(world: int, fn: Callable[[ThreadComm], Any]) -> list[Any]:
    board = _Board(world)
    results: list[Any] = [None] * world
    errors: list[BaseException] = []

    def body(rank: int) -> None:
        try:
            with torch.inference_mode():
                results[rank] = fn(ThreadComm(rank, world, board))
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)
            board.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results

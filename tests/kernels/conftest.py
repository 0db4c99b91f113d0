"""Shared fixtures for the kernel tests: random varlen batches over a slot pool."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

from kernels.recurrent_batch import RecurrentBatch


@dataclass(frozen=True)
class VarlenCase:
    """One varlen batch: B sequences over a pool of ``num_slots`` slots (slot 0 a dummy).

    Live slots are distinct, random, never 0; snapshot slots are distinct from every live slot
    and from each other.
    """

    lens: list[int]
    cu_seqlens: torch.Tensor  # int32 [B + 1]
    slot_ids: torch.Tensor  # int32 [B]
    has_initial_state: torch.Tensor  # bool [B]
    state_dst_slots: torch.Tensor | None  # int32 [T]
    num_slots: int

    @property
    def num_tokens(self) -> int:
        return sum(self.lens)

    def seqs(self, device: torch.device | str = "cpu", uniform_len: int = 0) -> RecurrentBatch:
        """The batch as the ops take it (on ``device``); ``uniform_len`` as ``RecurrentBatch``'s."""
        dst = self.state_dst_slots
        return RecurrentBatch(
            self.cu_seqlens.to(device),
            self.slot_ids.to(device),
            self.has_initial_state.to(device),
            None if dst is None else dst.to(device),
            uniform_len,
        )

    def bounds(self) -> list[tuple[int, int]]:
        """``(start, end)`` rows of every sequence."""
        cu = self.cu_seqlens.tolist()
        return list(zip(cu[:-1], cu[1:]))


def make_varlen_case(lens: list[int], seed: int, snapshot_prob: float = 0.0, init_prob: float = 0.5) -> VarlenCase:
    gen = torch.Generator().manual_seed(seed)
    num_tokens = sum(lens)
    snap = torch.rand(num_tokens, generator=gen) < snapshot_prob
    num_snaps = int(snap.sum())
    num_slots = 2 + len(lens) + num_snaps  # dummy 0, a spare that must stay untouched
    perm = (torch.randperm(num_slots - 1, generator=gen) + 1).to(torch.int32)
    slot_ids = perm[: len(lens)]
    dst = None
    if snapshot_prob > 0:
        dst = torch.zeros(num_tokens, dtype=torch.int32)
        dst[snap] = perm[len(lens) : len(lens) + num_snaps]
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0)
    has_init = torch.rand(len(lens), generator=gen) < init_prob
    return VarlenCase(list(lens), cu, slot_ids, has_init, dst, num_slots)


@pytest.fixture(scope="session")
def varlen_case() -> Callable[..., VarlenCase]:
    """Factory: ``varlen_case(lens, seed, snapshot_prob=0.0, init_prob=0.5)``."""
    return make_varlen_case


@pytest.fixture(scope="session")
def max_abs_diff() -> Callable[[torch.Tensor, torch.Tensor], float]:
    def diff(a: torch.Tensor, b: torch.Tensor) -> float:
        assert a.shape == b.shape, (a.shape, b.shape)
        return 0.0 if a.numel() == 0 else float((a.float() - b.float()).abs().max())

    return diff


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op thread count set to ``n`` inside the block (tests that a kernel's
    bits do not depend on it)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)

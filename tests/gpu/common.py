"""Helpers shared by the GPU checks (tests/gpu) and the speed table (bench.py)."""
from __future__ import annotations

import torch


def has_flashinfer() -> bool:
    try:
        import flashinfer  # noqa: F401
    except Exception:       # missing, or a broken install: the FlashInfer checks skip
        return False
    return True


def close(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float, what: str) -> None:
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol,
                               msg=lambda m: f"{what}: {m}")


def varlen_meta(lens: list[int], num_live_slots: int, snapshots: dict[int, int] | None = None,
                init_prob: float = 0.7, seed: int = 0, device: str = "cuda"):
    """cu_seqlens, slot_ids, has_initial_state, state_dst_slots (or None), num_slots.

    Live slots are 1..B (shuffled) out of ``num_live_slots + 1``; ``snapshots`` maps a flat
    token index to a snapshot slot, which the caller must keep above the live slots.
    """
    gen = torch.Generator().manual_seed(seed)
    num_seqs = len(lens)
    cu = torch.zeros(num_seqs + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0)
    slots = (torch.randperm(num_live_slots, generator=gen)[:num_seqs] + 1).to(torch.int32)
    has_init = torch.rand(num_seqs, generator=gen) < init_prob
    num_slots = num_live_slots + 1
    dst = None
    if snapshots:
        dst = torch.zeros(int(cu[-1]), dtype=torch.int32)
        for t, slot in snapshots.items():
            dst[t] = slot
        num_slots = max(num_slots, max(snapshots.values()) + 1)
    to = (lambda t: t.to(device)) if device else (lambda t: t)
    return to(cu), to(slots), to(has_init), (to(dst) if dst is not None else None), num_slots


def mixed_lens(num_decode: int, num_verify: int, verify_len: int,
               prefills: list[int]) -> list[int]:
    return [1] * num_decode + [verify_len] * num_verify + prefills


def verify_snapshots(lens: list[int], verify_len: int, first_slot: int) -> dict[int, int]:
    """A snapshot slot after every token of every verify-sized sequence (from ``first_slot``)."""
    out, t, slot = {}, 0, first_slot
    for n in lens:
        if n == verify_len:
            for i in range(n):
                out[t + i] = slot
                slot += 1
        t += n
    return out

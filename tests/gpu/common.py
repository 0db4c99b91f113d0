"""Helpers shared by the device checks (``tests/gpu/device_checks.py`` and its stages) and
the pytest wrappers of ``tests/gpu``: batch builders, comparisons, timing and the markdown
report every stage writes."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple

import torch


def has_flashinfer() -> bool:
    try:
        import flashinfer  # noqa: F401
    except Exception:  # missing, or a broken install: the FlashInfer checks skip
        return False
    return True


def varlen_meta(
    lens: list[int],
    num_live_slots: int,
    snapshots: dict[int, int] | None = None,
    init_prob: float = 0.7,
    seed: int = 0,
    device: str = "cuda",
):
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


def mixed_lens(num_decode: int, num_verify: int, verify_len: int, prefills: list[int]) -> list[int]:
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


class Compared(NamedTuple):
    """One comparison against a reference: max |got - want| and whether assert_close passes."""

    max_err: float
    ok: bool


def compare(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float) -> Compared:
    if got.shape != want.shape:
        return Compared(float("inf"), False)
    got, want = got.float(), want.float()
    err = 0.0 if got.numel() == 0 else float((got - want).abs().max())
    return Compared(err, bool(torch.allclose(got, want, rtol=rtol, atol=atol)))


def worst(*results: Compared) -> Compared:
    return Compared(max(r.max_err for r in results), all(r.ok for r in results))


def cuda_ms(fn: Callable[[], object], iters: int = 5) -> float | None:
    """Mean milliseconds per call on CUDA after one warm-up call; None off CUDA."""
    if not torch.cuda.is_available():
        return None
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


class Deadline:
    """A stage's soft time limit: checks after it are reported as skipped, not run."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def passed(self) -> bool:
        return time.monotonic() > self.end

    def remaining(self) -> float:
        return self.end - time.monotonic()


class Report:
    """A markdown table printed and appended to a file row by row, so a stage stopped at its
    hard time limit keeps the rows it had. ``failures`` counts rows marked not ok."""

    def __init__(self, path: Path | None, title: str, columns: list[str]) -> None:
        self.path, self.columns, self.failures, self._rows = path, columns, 0, 0
        self._emit(f"\n### {title}\n")

    def row(self, *cells: object, ok: bool = True) -> None:
        if len(cells) != len(self.columns):
            raise ValueError(f"{len(cells)} cells for columns {self.columns}")
        if self._rows == 0:
            self._emit("\n| " + " | ".join(self.columns) + " |\n|" + "---|" * len(self.columns) + "\n")
        self._rows += 1
        self.failures += 0 if ok else 1
        self._emit("| " + " | ".join(_cell(c) for c in cells) + " |\n")

    def note(self, text: str) -> None:
        """A paragraph: before the first row it introduces the table, after the last it ends it."""
        self._emit(f"\n{text}\n" + ("\n" if self._rows == 0 else ""))

    def _emit(self, text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(text)


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "ok" if value else "**FAIL**"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value).replace("|", "/").replace("\n", " ")

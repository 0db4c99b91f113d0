"""Where the tiers' bytes move: the ``TierStorage`` protocol and its tensor implementation.

The bookkeeping (``host_tier``, ``promotion``) decides what moves where and holds the
ledger rules; a storage only copies. Two directions, two timing contracts:

- ``copy_out`` (device -> host, a demotion) is synchronous: it returns once the device
  slot and pages have been read, so the caller may free them right after. A demoted
  checkpoint is unlocked and tree-owned: no launched batch writes or reads it (I3, and a
  request's locks outlive its batches), so the copy may run beside the forward. On a GPU
  it runs on the storage's copy stream and waits for that stream only, not for compute.
- ``copy_in`` (host -> device, a promotion) returns a ``TransferJob``: the destinations
  are fresh (free slots and pages have no in-flight readers or writers), and the caller
  registers the job as their pending writer until ``done()``. On a GPU the copies run on
  the copy stream (overlapping compute) and ``done`` polls its event; with ``submit`` they
  run on that executor (the forward thread: launch order); else at once, on the caller's
  thread (the engine's CPU path).

``corrupt=True`` (fault injection, ``debug.fail_transfer_prob``) performs a copy from the
dummy entries instead -- garbage lands in the destinations -- and reports failure, as a
copy that broke half way would.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from workers.device_pools import DevicePools
from workers.forward_thread import StepFuture
from workers.tiers.host_pools import (
    Groups,
    HostPools,
    copy_entries,
    entry_shapes,
    page_rows,
    read_entries,
    write_entries,
)

EntryTensors = dict[str, dict[str, dict[str, torch.Tensor]]]  # "slots"/"kv" -> kind -> name -> tensor


class TransferJob(Protocol):
    def done(self) -> bool: ...

    def result(self) -> bool:
        """Wait for the copy; True when every entry was copied."""
        ...


class TierStorage(Protocol):
    def copy_out(
        self, slot: int, pages: Sequence[int], host_slot: int, host_pages: Sequence[int], corrupt: bool = False
    ) -> bool: ...

    def copy_in(
        self,
        host_slot: int,
        host_pages: Sequence[int],
        slots: Sequence[int],
        pages: Sequence[int],
        corrupt: bool = False,
    ) -> TransferJob: ...

    def read_host(self, host_slot: int, host_pages: Sequence[int]) -> EntryTensors: ...

    def write_host(self, host_slot: int, host_pages: Sequence[int], tensors: EntryTensors, first_page: int) -> None: ...

    def layout(self) -> dict[str, dict[str, dict[str, tuple[tuple[int, ...], str]]]]: ...

    def nbytes(self, num_slots: int, num_pages: int) -> int: ...


class DoneJob:
    def __init__(self, ok: bool) -> None:
        self._ok = ok

    def done(self) -> bool:
        return True

    def result(self) -> bool:
        return self._ok


class FutureJob:
    def __init__(self, future: StepFuture[bool]) -> None:
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def result(self) -> bool:
        return bool(self._future.result())


class EventJob:
    """A copy issued on a CUDA stream: done when its event has completed."""

    def __init__(self, event: torch.cuda.Event, ok: bool) -> None:
        self._event, self._ok = event, ok

    def done(self) -> bool:
        return bool(self._event.query())

    def result(self) -> bool:
        self._event.synchronize()
        return self._ok


class TensorTierStorage:
    """``TierStorage`` over the engine's ``DevicePools`` and a ``HostPools`` mirror."""

    def __init__(
        self,
        device: DevicePools,
        host: HostPools,
        submit: Callable[[Callable[[], bool]], StepFuture[bool]] | None = None,
    ) -> None:
        self.device, self.host = device, host
        self.submit = submit
        self.page_size = host.page_size
        cuda = any(t.is_cuda for t in device.mamba.tensors()) or any(t.is_cuda for t in device.kv.tensors())
        self.stream = torch.cuda.Stream() if cuda else None

    def _copy(
        self,
        src_slots: Groups,
        dst_slots: Groups,
        src_kv: Groups,
        dst_kv: Groups,
        slot_idx: tuple[list[int], list[int]],
        page_idx: tuple[list[int], list[int]],
    ) -> None:
        ps = self.page_size
        copy_entries(src_slots, dst_slots, *slot_idx, non_blocking=self.stream is not None)
        copy_entries(
            src_kv, dst_kv, page_rows(page_idx[0], ps), page_rows(page_idx[1], ps), non_blocking=self.stream is not None
        )

    @torch.inference_mode()
    def copy_out(
        self, slot: int, pages: Sequence[int], host_slot: int, host_pages: Sequence[int], corrupt: bool = False
    ) -> bool:
        src_slot, src_pages = (0, [0] * len(pages)) if corrupt else (slot, list(pages))
        args = (
            self.device.mamba.groups,
            self.host.slots,
            self.device.kv.groups,
            self.host.kv,
            ([src_slot], [host_slot]),
            (src_pages, list(host_pages)),
        )
        if self.stream is None:
            self._copy(*args)
        else:
            with torch.cuda.stream(self.stream):
                self._copy(*args)
            self.stream.synchronize()
        return not corrupt

    def copy_in(
        self,
        host_slot: int,
        host_pages: Sequence[int],
        slots: Sequence[int],
        pages: Sequence[int],
        corrupt: bool = False,
    ) -> TransferJob:
        src_slot, src_pages = (0, [0] * len(host_pages)) if corrupt else (host_slot, list(host_pages))
        args = (
            self.host.slots,
            self.device.mamba.groups,
            self.host.kv,
            self.device.kv.groups,
            ([src_slot] * len(slots), list(slots)),
            (src_pages, list(pages)),
        )

        @torch.inference_mode()
        def run() -> bool:
            self._copy(*args)
            return not corrupt

        if self.stream is not None:
            with torch.cuda.stream(self.stream):
                run()
                event = torch.cuda.Event()
                event.record(self.stream)
            return EventJob(event, not corrupt)
        if self.submit is not None:
            return FutureJob(self.submit(run))
        return DoneJob(run())

    def read_host(self, host_slot: int, host_pages: Sequence[int]) -> EntryTensors:
        return {
            "slots": read_entries(self.host.slots, [host_slot]),
            "kv": read_entries(self.host.kv, page_rows(host_pages, self.page_size)),
        }

    def write_host(self, host_slot: int, host_pages: Sequence[int], tensors: EntryTensors, first_page: int) -> None:
        """Write a payload's state into ``host_slot`` and its pages ``first_page ..`` into
        ``host_pages`` (``tensors`` as ``read_host`` returns them, for the whole path)."""
        write_entries(self.host.slots, [host_slot], tensors["slots"])
        ps = self.page_size
        rows = slice(first_page * ps, (first_page + len(host_pages)) * ps)
        kv = {kind: {name: t[:, rows] for name, t in named.items()} for kind, named in tensors["kv"].items()}
        write_entries(self.host.kv, page_rows(host_pages, ps), kv)

    def layout(self) -> dict[str, dict[str, dict[str, tuple[tuple[int, ...], str]]]]:
        """What a payload must match: per side, kind and tensor, (``[layers, *shape]``, dtype)."""
        return {"slots": entry_shapes(self.host.slots), "kv": entry_shapes(self.host.kv)}

    def nbytes(self, num_slots: int, num_pages: int) -> int:
        return self.host.nbytes(num_slots, num_pages)

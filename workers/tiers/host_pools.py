"""Host-memory storage of the host tier, and the copies between it and the device pools.

``HostPools`` mirrors the engine's ``DevicePools`` tensor for tensor: every kind of paged
state (``[layers, host pages * page_size, *shape]``) and every kind of slot state
(``[layers, host slots, *shape]``), same names, shapes and dtypes, built from the device
pools themselves (so an MTP head's extra KV layer, or a kind no model has yet, is copied
like any other; nothing here names conv, ssm, k or v). Page 0 and slot 0 are dummies, as on
the device. On a GPU the tensors are pinned, so copies can run asynchronously on a copy
stream; on a CPU they are simply a second pool.

The copy functions move whole entries (a slot, or a page's ``page_size`` rows) of every
tensor of every kind; ``read_entries`` / ``write_entries`` turn entries into plain CPU
tensors and back (the cluster store's payload).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from workers.device_pools import DevicePools

Groups = dict[str, dict[str, torch.Tensor]]  # kind -> tensor name -> [layers, entries, ...]


def _mirror(groups: Mapping[str, Mapping[str, torch.Tensor]], num_entries: int, pin: bool) -> Groups:
    return {
        kind: {
            name: torch.zeros((t.shape[0], num_entries, *t.shape[2:]), dtype=t.dtype, pin_memory=pin)
            for name, t in tensors.items()
        }
        for kind, tensors in groups.items()
    }


@dataclass
class HostPools:
    kv: Groups  # paged kinds; entries are flat locations page * page_size + offset
    slots: Groups  # slot kinds; entries are host slots
    num_pages: int  # including the dummy page 0
    num_slots: int  # including the dummy slot 0
    page_size: int

    @classmethod
    def mirror(cls, device: DevicePools, num_pages: int, num_slots: int) -> HostPools:
        """Host pools shaped like ``device`` with ``num_pages`` pages and ``num_slots`` slots."""
        pin = any(t.is_cuda for t in device.mamba.tensors()) or any(t.is_cuda for t in device.kv.tensors())
        page_size = device.kv.page_size
        return cls(
            _mirror(device.kv.groups, num_pages * page_size, pin),
            _mirror(device.mamba.groups, num_slots, pin),
            num_pages,
            num_slots,
            page_size,
        )

    def nbytes(self, num_slots: int, num_pages: int) -> int:
        """Bytes of ``num_slots`` slots and ``num_pages`` pages."""
        per_slot = sum(t[:, 0].numel() * t.element_size() for t in _tensors(self.slots))
        per_row = sum(t[:, 0].numel() * t.element_size() for t in _tensors(self.kv))
        return num_slots * per_slot + num_pages * self.page_size * per_row


def _tensors(groups: Groups) -> Iterator[torch.Tensor]:
    for tensors in groups.values():
        yield from tensors.values()


def page_rows(page_ids: Sequence[int], page_size: int) -> list[int]:
    """Flat KV locations of whole pages, in page order."""
    return [p * page_size + i for p in page_ids for i in range(page_size)]


def copy_entries(
    src: Groups, dst: Groups, src_idx: Sequence[int], dst_idx: Sequence[int], non_blocking: bool = False
) -> None:
    """``dst[kind][name][:, dst_idx[i]] = src[kind][name][:, src_idx[i]]`` for every tensor.

    The two sides may live on different devices (host <-> GPU): the gather runs where the
    source lives, the scatter where the destination does.
    """
    if len(src_idx) != len(dst_idx):
        raise ValueError(f"copy of {len(src_idx)} entries into {len(dst_idx)}")
    if not src_idx:
        return
    for kind, tensors in src.items():
        for name, s in tensors.items():
            d = dst[kind][name]
            si = torch.tensor(list(src_idx), dtype=torch.int64, device=s.device)
            di = torch.tensor(list(dst_idx), dtype=torch.int64, device=d.device)
            gathered = s[:, si]
            # Only host -> device copies may be asynchronous (from pinned staging). A device ->
            # host copy must have landed before the scatter below reads it on the CPU: it is
            # a blocking copy, which waits for the current (copy) stream only.
            h2d = non_blocking and gathered.device.type == "cpu" and d.is_cuda
            if h2d:
                gathered = gathered.pin_memory()
            d[:, di] = gathered.to(d.device, non_blocking=h2d)


def read_entries(groups: Groups, idx: Sequence[int]) -> dict[str, dict[str, torch.Tensor]]:
    """CPU copies ``[layers, len(idx), *shape]`` of the entries ``idx`` of every tensor."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for kind, tensors in groups.items():
        ii = torch.tensor(list(idx), dtype=torch.int64)
        out[kind] = {name: t[:, ii.to(t.device)].to("cpu").clone() for name, t in tensors.items()}
    return out


def write_entries(groups: Groups, idx: Sequence[int], values: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
    """The inverse of ``read_entries`` (``values`` as it returns them)."""
    for kind, tensors in groups.items():
        ii = torch.tensor(list(idx), dtype=torch.int64)
        for name, t in tensors.items():
            t[:, ii.to(t.device)] = values[kind][name].to(t.device, t.dtype)


def entry_shapes(groups: Groups) -> dict[str, dict[str, tuple[tuple[int, ...], str]]]:
    """kind -> tensor -> (shape of one entry with its layers ``[layers, *shape]``, dtype name)."""
    return {
        kind: {name: ((t.shape[0], *t.shape[2:]), str(t.dtype).removeprefix("torch.")) for name, t in tensors.items()}
        for kind, tensors in groups.items()
    }

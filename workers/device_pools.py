"""Device tensors of the two state pools, shaped by the model's ``CacheSpec``.

The engine's bookkeeping (which page / slot belongs to whom) is pure Python and lives
elsewhere; this module only holds the storage. Both pools hold one tensor group per state
kind of the spec (``workers/state_spec.py``), ``[layers of the kind, entries, *shape]``:

- ``KVPool`` (paged kinds, e.g. attention ``k`` / ``v``): entries are flat KV locations
  ``page * page_size + offset``, ``num_pages * page_size`` of them. Page 0 is a dummy write
  target and is never handed to a request. A model without paged state gets no tensors,
  but the pages still exist as ids: the radix tree keys its nodes by them.
- ``MambaPool`` (slot kinds: every recurrent state, e.g. ``conv`` [conv_dim, W-1] = the
  last W-1 conv inputs, oldest first, and ``ssm``): entries are slots. Slot 0 is a dummy.
  ``copy_slot`` / ``zero_slot`` act on every tensor of every kind, so checkpoints and
  speculation scratch copies never need to know which kinds a model has.

A layer reads its tensors with ``pool.layer(ref)`` (``{tensor name: [entries, *shape]}``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from workers.state_spec import ATTENTION, CacheSpec, StateGroup, StateRef

LayerState = dict[str, torch.Tensor]
MAX_GPU_PAIR_COPIES = 4  # copy_slots: more pairs on a GPU take one gather and one scatter
MAX_CPU_PAIR_COPIES = 8  # ... and on a CPU (an op per pair and state tensor otherwise)


def _allocate(
    groups: tuple[StateGroup, ...], num_entries: int, dtype: torch.dtype, device: torch.device
) -> dict[str, dict[str, torch.Tensor]]:
    return {
        g.kind.name: {
            t.name: torch.zeros((g.num_layers, num_entries, *t.shape), dtype=t.torch_dtype(dtype), device=device)
            for t in g.kind.tensors
        }
        for g in groups
    }


class _GroupedPool:
    groups: dict[str, dict[str, torch.Tensor]]

    def layer(self, ref: StateRef) -> LayerState:
        return {name: t[ref.index] for name, t in self.groups[ref.kind].items()}

    def tensors(self) -> Iterator[torch.Tensor]:
        """Every tensor of every kind, ``[layers, entries, *shape]``."""
        for group in self.groups.values():
            yield from group.values()

    def num_layers(self, kind: str) -> int:
        group = self.groups.get(kind)
        return 0 if not group else int(next(iter(group.values())).shape[0])

    def bytes_per_entry(self) -> int:
        return sum(t[:, 0].numel() * t.element_size() for t in self.tensors())


class KVPool(_GroupedPool):
    def __init__(
        self, spec: CacheSpec, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.groups = _allocate(spec.paged_groups, num_pages * page_size, dtype, device)
        self.num_pages = num_pages
        self.page_size = page_size
        self.dtype = dtype

    # The attention kind's tensors, [layers, num_pages * page_size, H_kv, D].
    @property
    def k(self) -> torch.Tensor:
        return self.groups[ATTENTION]["k"]

    @property
    def v(self) -> torch.Tensor:
        return self.groups[ATTENTION]["v"]


class MambaPool(_GroupedPool):
    """The slot pool (every recurrent state kind; named for the Mamba checkpoints it holds)."""

    def __init__(self, spec: CacheSpec, num_slots: int, dtype: torch.dtype, device: torch.device) -> None:
        self.groups = _allocate(spec.slot_groups, num_slots, dtype, device)
        self.num_slots = num_slots
        self.dtype = dtype

    def copy_slot(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy states ``src[i] -> dst[i]`` for every recurrent layer (int64 index tensors)."""
        for t in self.tensors():
            t[:, dst] = t[:, src]

    def copy_slots(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """``copy_slot`` from host lists. A few pairs of which no slot is both read and
        written (or written twice) copy in place, slot by slot, with no gathered temporary
        (cheaper for a verify's commit at a small batch); many pairs (a launch or an op per
        pair and state tensor) take ``copy_slot``'s gather-then-scatter."""
        if len(src) != len(dst):
            raise ValueError(f"copy_slots: {len(src)} sources for {len(dst)} destinations")
        device = next(self.tensors()).device
        most = MAX_GPU_PAIR_COPIES if device.type != "cpu" else MAX_CPU_PAIR_COPIES
        if len(set(src) | set(dst)) < len(src) + len(dst) or len(src) > most:
            self.copy_slot(
                torch.tensor(src, dtype=torch.int64, device=device), torch.tensor(dst, dtype=torch.int64, device=device)
            )
            return
        for t in self.tensors():
            for a, b in zip(src, dst):
                t.select(1, b).copy_(t.select(1, a))

    def zero_slot(self, slots: torch.Tensor) -> None:
        for t in self.tensors():
            t[:, slots] = 0

    def slot_states(self, slot: int) -> tuple[torch.Tensor, ...]:
        """Views of every state tensor of one slot, all layers (for comparisons)."""
        return tuple(t[:, slot] for t in self.tensors())


@dataclass
class DevicePools:
    """What a model's forward receives beside the ForwardBatch."""

    kv: KVPool
    mamba: MambaPool


def build_pools(
    spec: CacheSpec, num_pages: int, page_size: int, num_slots: int, dtype: torch.dtype, device: torch.device
) -> DevicePools:
    """Both pools for ``spec``; tensors whose ``TensorSpec.dtype`` is None take ``dtype``."""
    return DevicePools(KVPool(spec, num_pages, page_size, dtype, device), MambaPool(spec, num_slots, dtype, device))

"""Device tensors of the two state pools, addressed by ids that the engine allocates.

The engine's bookkeeping (which page / slot belongs to whom) is pure Python and lives
elsewhere; this module only holds the storage and its shapes.

- KV pool: per attention layer, ``k[layer]`` / ``v[layer]`` of shape
  ``[num_pages * page_size, H_kv, D]``; flat location = ``page * page_size + offset``.
  Page 0 is a dummy write target and is never handed to a request.
- Mamba pool: per recurrent layer, ``conv[layer]`` of shape ``[S, conv_dim, W - 1]``
  (the last W-1 inputs of the causal conv, oldest first) and ``ssm[layer]`` of shape
  ``[S, *ssm_shape]`` (GDN: ``[H, K, V]``; Mamba2: ``[H, P, N]``). Slot 0 is a dummy.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CacheSpec:
    """What a model needs from the pools; returned by ``model.cache_spec()``."""

    num_attn_layers: int
    num_kv_heads: int
    head_dim: int
    num_mamba_layers: int
    conv_dim: int
    conv_width: int                 # W, the conv kernel size; the state keeps W - 1
    ssm_shape: tuple[int, ...]      # per-slot recurrent state shape of one layer

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_attn_layers * self.num_kv_heads * self.head_dim * elem

    def mamba_bytes_per_slot(self, conv_dtype: torch.dtype, ssm_dtype: torch.dtype) -> int:
        conv = self.conv_dim * (self.conv_width - 1) * torch.empty((), dtype=conv_dtype).element_size()
        ssm = 1
        for n in self.ssm_shape:
            ssm *= n
        ssm *= torch.empty((), dtype=ssm_dtype).element_size()
        return self.num_mamba_layers * (conv + ssm)


class KVPool:
    def __init__(self, spec: CacheSpec, num_pages: int, page_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (spec.num_attn_layers, num_pages * page_size, spec.num_kv_heads, spec.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_pages = num_pages
        self.page_size = page_size


class MambaPool:
    def __init__(self, spec: CacheSpec, num_slots: int, conv_dtype: torch.dtype,
                 ssm_dtype: torch.dtype, device: torch.device) -> None:
        layers = spec.num_mamba_layers
        self.conv = torch.zeros((layers, num_slots, spec.conv_dim, spec.conv_width - 1),
                                dtype=conv_dtype, device=device)
        self.ssm = torch.zeros((layers, num_slots, *spec.ssm_shape), dtype=ssm_dtype, device=device)
        self.num_slots = num_slots

    def copy_slot(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy states ``src[i] -> dst[i]`` for every recurrent layer (int64 index tensors)."""
        self.conv[:, dst] = self.conv[:, src]
        self.ssm[:, dst] = self.ssm[:, src]

    def zero_slot(self, slots: torch.Tensor) -> None:
        self.conv[:, slots] = 0
        self.ssm[:, slots] = 0

    def slot_states(self, slot: int) -> tuple[torch.Tensor, ...]:
        """Views of every state tensor of one slot, all layers (for comparisons)."""
        return (self.conv[:, slot], self.ssm[:, slot])


@dataclass
class DevicePools:
    """What a model's forward receives beside the ForwardBatch."""

    kv: KVPool
    mamba: MambaPool

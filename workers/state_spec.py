"""What a model keeps between steps: the one description that shapes and sizes the pools.

A model's ``cache_spec()`` is a ``CacheSpec``: one ``StateGroup`` per kind of state
(``StateKind``) with the number of layers that keep it. A kind is a named set of tensors
(``TensorSpec``), all per KV *token* (``paged``: held in the KV pool, addressed by flat
location ``page * page_size + offset``) or all per *slot* (held in the slot pool, one copy
per live request, checkpoint or speculation scratch row, copied whole).

The kinds served today (constructors below):

- ``attention`` (paged): ``k`` [H_kv, D_k] and ``v`` [H_kv, D_v] per token; D_k and D_v
  may differ.
- ``mla`` (paged, ``mla_kind``): ``latent`` [1, R + P] per token: MLA's normed latent c [R]
  and its shared rope key [P] (Kimi-Linear, BailingHybrid); every head reads the same row.
- ``gdn`` (slot): ``conv`` [conv_dim, W-1] in the model dtype, ``ssm`` [H_v, D_k, D_v] fp32.
- ``kda`` (slot, ``kda_kind``): ``conv`` [3 H D, W-1] (q, k, v), ``ssm`` [H, D_k, D_v] fp32.
- ``lightning`` (slot, ``lightning_kind``): ``ssm`` [H, D_v, D_k] fp32 (MiniMax's KV,
  transposed); no conv state.
- ``mamba2`` (slot): ``conv`` [conv_dim, W-1], ``ssm`` [H, P, N] (fp32 unless the
  checkpoint asks for another cache dtype).
- ``mamba1`` (slot, ``mamba1_kind``): ``conv`` [d_inner, W-1], ``ssm`` [d_inner, N] fp32
  (the selective scan of Jamba, Mamba, FalconMamba and Zamba, ``kernels.selective_scan``).
- ``short_conv`` (slot, ``short_conv_kind``): ``conv`` [dim, W-1] only, no scan state
  (LFM2 / Lfm3's gated short convolution, ``kernels.conv1d``).
- ``rglru`` (slot, ``rglru_kind``): ``conv`` [lru_width, W-1], ``ssm`` [lru_width] fp32
  (RecurrentGemma's RG-LRU, ``kernels.rglru``: one value per channel, so TP splits it with
  the channels).
- ``conv_windows`` (slot, ``conv_windows_kind``): several named conv windows of one layer,
  each [dim_i, W-1] (the last W-1 inputs of one depthwise causal conv, ``kernels.conv1d``),
  no scan state; beside the layer's paged KV (Inkling: its k and v convs, shaped by the KV
  heads, and the attention- and MLP-output convs over the hidden size), fp32 by default.
- ``cca`` (slot, ``cca_kind``): ZAYA's compressed convolutional attention, beside the layer's
  paged KV: ``conv`` [qk_dim, T0-1] (the last inputs of the depthwise conv over q | k),
  ``mix{i}`` [qk_dim, 1] for i < T1-1 (the grouped conv's partial sums carried to the next
  token) and ``delayed_v`` [v_dim, 1] (the previous token's delayed value projection, before
  its bias; ``replicated``: whole on every TP rank), all in the model dtype and all advanced
  by ``kernels.conv1d``.
- ``indexer`` (paged, ``indexer_kind``): ``keys`` [1, W] per token: the per-token rows an
  indexed attention layer compresses into block keys (``kernels.indexer.pooling``; Qwen4-Exp
  W = D raw keys, GLM-5.3-Flash W = 2 D ``[k | gate]``), shared by every head (``replicated``),
  beside the layer's paged KV or MLA latent.

A new kind of state (lightning attention's [H, V, K] without conv, MLA's latent rows, ...)
is one more constructor beside its kernel: the pools, checkpoint copies, speculation
scratch, TP shards and sizing read only this description, never a model name.

Layers find their tensors with a ``StateRef(kind, index)``: index i of a kind is the i-th
state of that kind in model order (a layer invoked twice, as Zamba2's shared attention,
holds one state per invocation). ``StateSites`` hands the refs out while a model is built
and derives the spec from the modules afterwards, so a TP-sharded model (heads narrowed in
place) describes its own rank's shard.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import NamedTuple, Protocol

import torch

ATTENTION = "attention"
MAMBA1 = "mamba1"
SHORT_CONV = "short_conv"
CCA = "cca"
RGLRU = "rglru"
CONV_WINDOWS = "conv_windows"
INDEXER = "indexer"


@dataclass(frozen=True)
class TensorSpec:
    """One state tensor of one layer: per token (paged kinds) or per slot."""

    name: str
    shape: tuple[int, ...]
    dtype: str | None = None  # a torch dtype name; None = the model's dtype
    replicated: bool = False  # under TP every rank keeps it whole (not split with the heads)

    def torch_dtype(self, default: torch.dtype) -> torch.dtype:
        return default if self.dtype is None else getattr(torch, self.dtype)

    def num_bytes(self, default: torch.dtype) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.torch_dtype(default)).element_size()


@dataclass(frozen=True)
class StateKind:
    name: str
    paged: bool  # True: per KV token in pages; False: per slot
    tensors: tuple[TensorSpec, ...]

    def num_bytes(self, default: torch.dtype) -> int:
        """Bytes of one layer's state per token (paged) or per slot."""
        return sum(t.num_bytes(default) for t in self.tensors)


def attention_kind(num_kv_heads: int, head_dim: int, v_head_dim: int | None = None, name: str = ATTENTION) -> StateKind:
    v_dim = head_dim if v_head_dim is None else v_head_dim
    return StateKind(name, True, (TensorSpec("k", (num_kv_heads, head_dim)), TensorSpec("v", (num_kv_heads, v_dim))))


def conv_ssm_kind(
    name: str, conv_dim: int, conv_width: int, ssm_shape: tuple[int, ...], ssm_dtype: str = "float32"
) -> StateKind:
    """A recurrent kind with a causal-conv window (the last W-1 inputs) and a scan state."""
    return StateKind(
        name, False, (TensorSpec("conv", (conv_dim, conv_width - 1)), TensorSpec("ssm", tuple(ssm_shape), ssm_dtype))
    )


def mamba1_kind(d_inner: int, conv_width: int, state_size: int, ssm_dtype: str = "float32") -> StateKind:
    """Mamba1: the conv window of the x branch and the selective-scan state [d_inner, N]."""
    return conv_ssm_kind(MAMBA1, d_inner, conv_width, (d_inner, state_size), ssm_dtype)


def short_conv_kind(dim: int, conv_width: int) -> StateKind:
    """A gated short convolution keeps only its conv window: the last W-1 inputs [dim, W-1]."""
    return StateKind(SHORT_CONV, False, (TensorSpec("conv", (dim, conv_width - 1)),))


def conv_windows_kind(
    windows: tuple[tuple[str, int], ...],
    conv_width: int,
    name: str = CONV_WINDOWS,
    dtype: str | None = "float32",
    replicated: tuple[str, ...] = (),
) -> StateKind:
    """Several conv windows of one layer: ``(tensor name, channels)`` each, [channels, W-1];
    those named in ``replicated`` are whole on every TP rank (a conv over the hidden size)."""
    if not windows or len({w for w, _ in windows}) != len(windows):
        raise ValueError(f"conv windows need distinct names, got {windows}")
    return StateKind(
        name, False, tuple(TensorSpec(w, (dim, conv_width - 1), dtype, w in replicated) for w, dim in windows)
    )


def cca_kind(qk_dim: int, depthwise_width: int, grouped_width: int, v_dim: int, name: str = CCA) -> StateKind:
    """Compressed convolutional attention (ZAYA): the depthwise conv's window over q | k,
    the grouped conv's carried partial sums and the delayed value (see the module docstring)."""
    if depthwise_width < 2 or grouped_width < 1:
        raise ValueError(f"CCA conv widths must be >= 2 and >= 1, got {depthwise_width} and {grouped_width}")
    mix = tuple(TensorSpec(f"mix{i}", (qk_dim, 1)) for i in range(grouped_width - 1))
    conv = TensorSpec("conv", (qk_dim, depthwise_width - 1))
    return StateKind(name, False, (conv, *mix, TensorSpec("delayed_v", (v_dim, 1), replicated=True)))


def rglru_kind(width: int, conv_width: int) -> StateKind:
    """RG-LRU (RecurrentGemma): the conv window of the x branch and one fp32 value per channel."""
    return conv_ssm_kind(RGLRU, width, conv_width, (width,))


def mla_kind(latent_dim: int, rope_dim: int, name: str = "mla") -> StateKind:
    """MLA's cache: one row [c (latent_dim) | k_rope (rope_dim)] per token, shared by all heads."""
    return StateKind(name, True, (TensorSpec("latent", (1, latent_dim + rope_dim)),))


def indexer_kind(row_width: int, name: str = INDEXER) -> StateKind:
    """An indexed attention layer's per-token indexer rows, whole on every TP rank."""
    return StateKind(name, True, (TensorSpec("keys", (1, row_width), replicated=True),))


def kda_kind(num_heads: int, k_head_dim: int, v_head_dim: int, conv_width: int, name: str = "kda") -> StateKind:
    """Kimi Delta Attention: the conv window of q, k, v (in that order) and the [H, K, V] state."""
    conv_dim = num_heads * (2 * k_head_dim + v_head_dim)
    return conv_ssm_kind(name, conv_dim, conv_width, (num_heads, k_head_dim, v_head_dim))


def lightning_kind(num_heads: int, head_dim: int, name: str = "lightning") -> StateKind:
    """Lightning attention: the decayed sum of k v^T per head, stored transposed [H, V, K]
    (the SSD layout its kernel uses); no conv state."""
    return StateKind(name, False, (TensorSpec("ssm", (num_heads, head_dim, head_dim), "float32"),))


@dataclass(frozen=True)
class StateGroup:
    kind: StateKind
    num_layers: int


@dataclass(frozen=True)
class CacheSpec:
    """Every kind of state a model keeps, with its layer count (see the module docstring)."""

    groups: tuple[StateGroup, ...] = ()

    def group(self, name: str) -> StateGroup | None:
        return next((g for g in self.groups if g.kind.name == name), None)

    def num_layers(self, name: str) -> int:
        g = self.group(name)
        return 0 if g is None else g.num_layers

    @property
    def paged_groups(self) -> tuple[StateGroup, ...]:
        return tuple(g for g in self.groups if g.kind.paged)

    @property
    def slot_groups(self) -> tuple[StateGroup, ...]:
        return tuple(g for g in self.groups if not g.kind.paged)

    @property
    def has_paged_state(self) -> bool:
        return any(g.num_layers for g in self.paged_groups)

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """KV bytes one token costs over every paged layer."""
        return sum(g.num_layers * g.kind.num_bytes(dtype) for g in self.paged_groups)

    def bytes_per_slot(self, dtype: torch.dtype) -> int:
        """Bytes of one slot (a request's live state or one checkpoint) over every layer."""
        return sum(g.num_layers * g.kind.num_bytes(dtype) for g in self.slot_groups)

    def with_layers(self, name: str, num_layers: int) -> CacheSpec:
        """The same spec with ``num_layers`` layers of the existing kind ``name`` (e.g. an
        MTP head's attention layer after the target's)."""
        if self.group(name) is None:
            if num_layers == 0:
                return self
            raise ValueError(
                f"the model keeps no {name!r} state to add {num_layers} layer(s) to; "
                f"its kinds: {[g.kind.name for g in self.groups]}"
            )
        return CacheSpec(tuple(replace(g, num_layers=num_layers) if g.kind.name == name else g for g in self.groups))

    @classmethod
    def from_sites(cls, sites: Iterable[tuple[StateRef, StateKind]]) -> CacheSpec:
        """Group per-layer states by kind; every site of a kind must have the same shapes and
        the indices of a kind must be 0..n-1 (as ``StateSites`` hands them out)."""
        kinds: dict[str, StateKind] = {}
        indices: dict[str, list[int]] = {}
        for ref, kind in sites:
            if ref.kind != kind.name:
                raise ValueError(f"state ref {ref} names kind {ref.kind!r}, its module keeps {kind.name!r}")
            seen = kinds.setdefault(kind.name, kind)
            if seen != kind:
                raise ValueError(f"layers of state kind {kind.name!r} disagree on its shapes: {seen} vs {kind}")
            indices.setdefault(kind.name, []).append(ref.index)
        for name, idx in indices.items():
            if sorted(idx) != list(range(len(idx))):
                raise ValueError(f"state kind {name!r} has indices {sorted(idx)}, expected 0..{len(idx) - 1}")
        return cls(tuple(StateGroup(kind, len(indices[name])) for name, kind in kinds.items()))


class StateRef(NamedTuple):
    """Where one layer's state lives: the ``index``-th state of kind ``kind``."""

    kind: str
    index: int


class HasState(Protocol):
    def state_kind(self) -> StateKind: ...


class StateSites:
    """Hands out ``StateRef``s while a model is built; ``spec()`` reads every site's module
    again, so it follows the modules' current (e.g. TP-narrowed) dims."""

    def __init__(self) -> None:
        self._sites: list[tuple[StateRef, HasState]] = []
        self._counts: dict[str, int] = {}

    def add(self, module: HasState) -> StateRef:
        name = module.state_kind().name
        ref = StateRef(name, self._counts.get(name, 0))
        self._counts[name] = ref.index + 1
        self._sites.append((ref, module))
        return ref

    def spec(self) -> CacheSpec:
        return CacheSpec.from_sites((ref, m.state_kind()) for ref, m in self._sites)


__all__ = [
    "ATTENTION",
    "MAMBA1",
    "SHORT_CONV",
    "RGLRU",
    "CONV_WINDOWS",
    "INDEXER",
    "CCA",
    "CacheSpec",
    "HasState",
    "StateGroup",
    "StateKind",
    "StateRef",
    "StateSites",
    "TensorSpec",
    "attention_kind",
    "cca_kind",
    "conv_ssm_kind",
    "conv_windows_kind",
    "indexer_kind",
    "kda_kind",
    "lightning_kind",
    "mamba1_kind",
    "mla_kind",
    "rglru_kind",
    "short_conv_kind",
]

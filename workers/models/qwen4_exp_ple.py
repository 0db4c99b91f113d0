"""Qwen4-Exp's per-layer n-gram embedding (PLE, a decoder layer's ``ple``).

For token t with ids ``x_t, x_{t-1}, .., x_{t-n+1}`` (an EOS among ``x_{t-1} .. x_{t-s+1}``
turns ``x_{t-s}`` into EOS, as does a position before the sequence), each k-gram (k = 2..n)
hashes to ``h_k = xor_{i<k} x_{t-i} * m_i`` (int64, wrapping), and head j of that order reads
row ``h_k mod p_j + offset_j`` of one shared table (``p_j`` distinct primes from
``ngram_vocab_size_base``): the heads' rows concatenated are the embedding e [E].

``out = g + silu(conv(norm_conv(g)))`` with ``g_s = sigmoid(ssqrt(norm_key(key_proj e)_s .
norm_query(h)_s / sqrt(H))) * value_proj(e)`` per stream s, ``ssqrt(x) = sign(x) sqrt(|x|)``
(|x| floored at 1e-6) and ``conv`` depthwise over hc * H channels, K taps dilated by n.

State (slot windows, ``kernels.conv1d`` advances both, so chunks, decode, verify and
snapshots need nothing of their own): ``ple_ids`` holds the previous n-1 ids as ``id - eos``
in fp32 (exact for ids below 2^24; an empty window reads as all EOS), read back through a
conv with one-hot taps; ``ple_conv`` holds the conv's last ``(K-1) n`` inputs, the dilated
taps placed in a dense window with zeros between.

Checkpoint: ``ple_embedding.ngram_embedding.shard_{i}.weight`` for i < ``split_ngram_parts``
(``torch.chunk`` of the table along rows, as transformers saves it); the hash multipliers and
the primes / offsets are the checkpoint's buffers, loaded as saved.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels import dense
from kernels.conv1d import causal_conv1d
from workers.models.layers import LayerContext, linear, param
from workers.models.qwen4_exp_layers import GroupRMSNorm
from workers.models.weights import WeightTarget, whole
from workers.state_spec import StateKind, StateRef, conv_windows_kind

PLE_IDS, PLE_CONV = "ple_ids", "ple_conv"


@dataclass(frozen=True)
class PleDims:
    hidden_size: int
    streams: int  # hc_count
    embed_dim: int  # ple_embed_dim
    ngram_size: int  # n: 2..n-grams over the n-1 previous tokens; the conv's dilation
    heads_per_ngram: int
    vocab_base: int  # ngram_vocab_size_base
    vocab_multiple: int  # make_ngram_vocab_size_divisible_by
    table_parts: int  # split_ngram_parts
    conv_kernel: int  # ple_conv_kernel_size
    eos: int
    eps: float

    @property
    def num_heads(self) -> int:
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def conv_width(self) -> int:
        """The dense causal window that holds the dilated conv's taps."""
        return (self.conv_kernel - 1) * self.ngram_size + 1


def is_prime(n: int) -> bool:
    return n >= 2 and all(n % f for f in range(2, math.isqrt(n) + 1))


def table_rows(d: PleDims, ple_index: int) -> int:
    """Rows of the ``ple_index``-th PLE layer's table: the sum of its heads' primes (the
    ``num_heads`` primes >= base after the ``ple_index * num_heads`` earlier layers' ones),
    rounded up to ``vocab_multiple``."""
    wanted, primes, n = (ple_index + 1) * d.num_heads, [], d.vocab_base
    while len(primes) < wanted:
        if is_prime(n):
            primes.append(n)
        n += 1
    total = sum(primes[-d.num_heads :])
    return -(-total // d.vocab_multiple) * d.vocab_multiple


class NgramEmbedding(nn.Module):
    """``ple_embedding``: the hashed n-gram rows of each token; keeps the ``ple_ids`` window."""

    def __init__(self, d: PleDims, ple_index: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.dims = d
        self.ngram_embedding = nn.Embedding(table_rows(d, ple_index), d.embed_dim // d.num_heads, dtype=dtype)
        self.layer_multipliers = param(d.ngram_size, dtype=torch.int64)
        self.ngram_heads_vocab_sizes = param(d.num_heads, dtype=torch.int64)
        self.ngram_heads_offsets = param(d.num_heads, dtype=torch.int64)

    def state_kind(self) -> StateKind:
        n = self.dims.ngram_size
        return conv_windows_kind(((PLE_IDS, n - 1),), n, name=PLE_IDS, replicated=(PLE_IDS,))

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        table = self.ngram_embedding.weight.chunk(self.dims.table_parts)
        targets = {f"{prefix}ngram_embedding.shard_{i}.weight": whole(t) for i, t in enumerate(table)}
        for name in ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets"):
            targets[prefix + name] = whole(getattr(self, name))
        return targets

    def shifted_ids(self, ids: torch.Tensor, ctx: LayerContext, ref: StateRef) -> list[torch.Tensor]:
        """ids [T] -> [x_t, x_{t-1}, .., x_{t-n+1}] with the EOS cuts (module docstring)."""
        eos, n = self.dims.eos, self.dims.ngram_size
        # channel c reads x_{t-1-c}: tap n-2-c of n (built on the device: no host copy in a graph)
        taps = F.pad(torch.eye(n - 1, device=ids.device).flip(1), (0, 1))
        rel = (ids - eos).float()[:, None].expand(-1, n - 1).contiguous()
        window = ctx.pools.mamba.layer(ref)[PLE_IDS]
        prev = causal_conv1d(rel, taps, None, window, ctx.batch.recurrent, activation=None).round().long() + eos
        shifted, cut = [ids], torch.zeros_like(ids, dtype=torch.bool)
        for s in range(n - 1):
            shifted.append(torch.where(cut, eos, prev[:, s]))
            cut = cut | (prev[:, s] == eos)
        return shifted

    def forward(self, ids: torch.Tensor, ctx: LayerContext, ref: StateRef) -> torch.Tensor:
        """ids [T] -> e [T, E]."""
        shifted = self.shifted_ids(ids.long(), ctx, ref)
        per_order, rows = self.dims.heads_per_ngram, []
        mixed = shifted[0] * self.layer_multipliers[0]
        for k in range(2, self.dims.ngram_size + 1):
            mixed = torch.bitwise_xor(mixed, shifted[k - 1] * self.layer_multipliers[k - 1])
            heads = slice((k - 2) * per_order, (k - 1) * per_order)
            sizes, offsets = self.ngram_heads_vocab_sizes[heads], self.ngram_heads_offsets[heads]
            rows.append(torch.remainder(mixed[:, None], sizes[None, :]) + offsets[None, :])
        return self.ngram_embedding(torch.cat(rows, dim=-1)).flatten(1)


class PerLayerEmbedding(nn.Module):
    """``ple``: ``forward(streams [T, hc * H], ctx, refs)`` -> what the layer adds to them;
    keeps the ``ple_conv`` window (its ``ple_embedding`` the ``ple_ids`` one)."""

    def __init__(self, d: PleDims, ple_index: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.dims = d
        width = d.hidden_size * d.streams
        self.ple_embedding = NgramEmbedding(d, ple_index, dtype)
        self.key_proj = linear(d.embed_dim, width, False, dtype)
        self.value_proj = linear(d.embed_dim, d.hidden_size, False, dtype)
        self.norm_key = GroupRMSNorm(width, d.hidden_size, d.eps, dtype)
        self.norm_query = GroupRMSNorm(width, d.hidden_size, d.eps, dtype)
        self.norm_conv = GroupRMSNorm(width, d.hidden_size, d.eps, dtype)
        self.conv1d = nn.Module()
        self.conv1d.weight = param(width, 1, d.conv_kernel, dtype=dtype)

    def state_kind(self) -> StateKind:
        d = self.dims
        return conv_windows_kind(
            ((PLE_CONV, d.hidden_size * d.streams),), d.conv_width, name=PLE_CONV, dtype=None, replicated=(PLE_CONV,)
        )

    def dense_taps(self) -> torch.Tensor:
        """[hc * H, (K-1) n + 1]: tap k of the dilated conv at column k * n, zeros between."""
        d, w = self.dims, self.conv1d.weight[:, 0, :]
        taps = w.new_zeros(w.shape[0], d.conv_width)
        taps[:, :: d.ngram_size] = w
        return taps

    def forward(self, streams: torch.Tensor, ctx: LayerContext, refs: tuple[StateRef, StateRef]) -> torch.Tensor:
        d, shape = self.dims, (self.dims.streams, self.dims.hidden_size)
        e = self.ple_embedding(ctx.batch.input_ids, ctx, refs[0])
        key = self.norm_key(self.key_proj(e)).unflatten(-1, shape)
        query = self.norm_query(streams).unflatten(-1, shape)
        gate = (key * query).sum(dim=-1, keepdim=True) / math.sqrt(d.hidden_size)
        gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
        gated = (dense.pointwise(torch.sigmoid, gate) * self.value_proj(e)[:, None, :]).flatten(1)
        window = ctx.pools.mamba.layer(refs[1])[PLE_CONV]
        conv = causal_conv1d(self.norm_conv(gated), self.dense_taps(), None, window, ctx.batch.recurrent)
        return gated + conv

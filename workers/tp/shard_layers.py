"""Sharding one layer in place for rank ``rank`` of ``world``.

Column-parallel projections keep the output rows of this rank's heads (or intermediate
channels); row-parallel projections keep the matching input columns, and their bias
stays on rank 0 only, so the sum over ranks adds it once. Each function narrows the
parameters and the layer's ``dims``; the caller adds the all-reduce after the layer.

Head ranges are contiguous: rank r owns heads ``[r * H / world, (r + 1) * H / world)``.
Every function raises ValueError naming the count that ``world`` does not divide.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from workers.models.gated_deltanet import GatedDeltaNet, SplitGatedDeltaNet
from workers.models.layers import Attention, DenseMLP
from workers.models.mamba1 import Mamba1Mixer
from workers.models.mamba2 import Mamba2Mixer
from workers.models.moe import SparseMoE
from workers.models.short_conv import ShortConv
from workers.tp.comm import Comm


class Part(NamedTuple):
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start

    def scaled(self, n: int, offset: int = 0) -> tuple[int, int]:
        return offset + self.start * n, offset + self.stop * n


def part(count: int, rank: int, world: int, what: str) -> Part:
    if count % world:
        raise ValueError(f"{what}={count} is not divisible by tensor_parallel_size={world}")
    n = count // world
    return Part(rank * n, (rank + 1) * n)


def _take(t: torch.Tensor, dim: int, ranges: list[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([t.narrow(dim, a, b - a) for a, b in ranges], dim=dim).contiguous()


def _set(module: nn.Module, name: str, value: torch.Tensor) -> None:
    setattr(module, name, nn.Parameter(value, requires_grad=False))


def column(linear: nn.Linear, ranges: list[tuple[int, int]]) -> None:
    """Keep the output rows in ``ranges`` (and their bias)."""
    _set(linear, "weight", _take(linear.weight, 0, ranges))
    if linear.bias is not None:
        _set(linear, "bias", _take(linear.bias, 0, ranges))
    linear.out_features = linear.weight.shape[0]


def row(linear: nn.Linear, ranges: list[tuple[int, int]], rank: int) -> None:
    """Keep the input columns in ``ranges``; the bias is added by rank 0 only."""
    _set(linear, "weight", _take(linear.weight, 1, ranges))
    if linear.bias is not None and rank != 0:
        _set(linear, "bias", torch.zeros_like(linear.bias))
    linear.in_features = linear.weight.shape[1]


def shard_attention(attn: Attention, rank: int, world: int) -> None:
    d = attn.dims
    heads = part(d.num_heads, rank, world, "attention heads (num_attention_heads)")
    kv = part(d.num_kv_heads, rank, world, "attention KV heads (num_key_value_heads)")
    q_width = d.head_dim * (2 if d.output_gate else 1)  # per head: [query | gate]
    ranges = ([heads.scaled(q_width)], [kv.scaled(d.head_dim)], [kv.scaled(d.head_dim)])
    for proj, rows in zip((attn.q_proj, attn.k_proj, attn.v_proj), ranges):
        column(proj, rows)
    for adapters, rows in zip(attn.adapters, ranges):  # LoRA adds to q / k / v: same rows
        for up in adapters.parts(0):
            column(up, rows)
    if attn.g_proj is not None:  # one gate row per head
        column(attn.g_proj, [heads])
    row(attn.o_proj, [heads.scaled(d.head_dim)], rank)
    attn.dims = replace(d, num_heads=heads.size, num_kv_heads=kv.size)


def shard_gdn(gdn: GatedDeltaNet, rank: int, world: int) -> None:
    """By key-head groups: a key head and its r value heads stay on one rank."""
    d = gdn.dims
    kh = part(d.num_k_heads, rank, world, "GDN key heads (linear_num_key_heads)")
    r, dk, dv = d.heads_per_group, d.k_head_dim, d.v_head_dim
    vh = Part(kh.start * r, kh.stop * r)
    key_dim = d.num_k_heads * dk
    channels = [kh.scaled(dk), kh.scaled(dk, key_dim), vh.scaled(dv, 2 * key_dim)]  # conv: q, k, v
    if isinstance(gdn, SplitGatedDeltaNet):  # Qwen3.5: flat [q | k | v], z, b, a
        column(gdn.in_proj_qkv, channels)
        column(gdn.in_proj_z, [vh.scaled(dv)])
        column(gdn.in_proj_b, [vh])
        column(gdn.in_proj_a, [vh])
    else:
        column(gdn.in_proj_qkvz, [kh.scaled(2 * dk + 2 * r * dv)])  # [q_g|k_g|v_g|z_g] per group
        column(gdn.in_proj_ba, [kh.scaled(2 * r)])  # [b_g|a_g] per group
    _set(gdn.conv1d, "weight", _take(gdn.conv1d.weight, 0, channels))
    if gdn.conv1d.bias is not None:
        _set(gdn.conv1d, "bias", _take(gdn.conv1d.bias, 0, channels))
    _set(gdn, "dt_bias", _take(gdn.dt_bias, 0, [vh]))
    _set(gdn, "A_log", _take(gdn.A_log, 0, [vh]))
    row(gdn.out_proj, [vh.scaled(dv)], rank)
    gdn.dims = replace(d, num_k_heads=kh.size, num_v_heads=vh.size)


def mamba_groups(num_groups: int, rank: int, world: int) -> tuple[Part, bool]:
    """-> (this rank's B/C groups, whether a norm group spans several ranks).

    Groups shard with the heads when ``world`` divides them; when ``num_groups`` divides
    ``world`` (Granite-4.0-H has one group) each rank's heads fall in one group, which
    that rank keeps (replicated over ``world / num_groups`` ranks).
    """
    if num_groups % world == 0:
        return part(num_groups, rank, world, "mamba_n_groups"), False
    if world % num_groups == 0:
        g = rank // (world // num_groups)
        return Part(g, g + 1), True
    raise ValueError(f"mamba_n_groups={num_groups} and tensor_parallel_size={world}: one must divide the other")


def shard_mamba2(m: Mamba2Mixer, rank: int, world: int, comm: Comm) -> None:
    d = m.dims
    h = part(d.num_heads, rank, world, "Mamba2 heads (mamba_n_heads)")
    g, split_norm = mamba_groups(d.num_groups, rank, world)
    p, n, di, gn = d.head_dim, d.state_size, d.d_inner, d.num_groups * d.state_size
    # xBC channels: x [0, di), B [di, di + gn), C [di + gn, di + 2 gn)
    xbc = [h.scaled(p), g.scaled(n, di), g.scaled(n, di + gn)]
    # in_proj rows: z [0, di), xBC [di, di + conv_dim), dt [di + conv_dim, + H)
    rows = [h.scaled(p)] + [(a + di, b + di) for a, b in xbc] + [h.scaled(1, di + d.conv_dim)]
    column(m.in_proj, rows)
    _set(m.conv1d, "weight", _take(m.conv1d.weight, 0, xbc))
    if m.conv1d.bias is not None:
        _set(m.conv1d, "bias", _take(m.conv1d.bias, 0, xbc))
    for name in ("dt_bias", "A_log", "D"):
        _set(m, name, _take(getattr(m, name), 0, [h]))
    if m.norm is not None:  # (no norm: y * silu(z) is per channel, nothing to share)
        norm_weight = _take(m.norm.weight, 0, [h.scaled(p)])
        if split_norm:
            m.norm = SplitGatedRMSNorm(
                norm_weight, m.norm.eps, di // d.num_groups, m.norm.norm_before_gate, g.start, d.num_groups, comm
            )
        else:
            _set(m.norm, "weight", norm_weight)
    row(m.out_proj, [h.scaled(p)], rank)
    m.dims = replace(d, num_heads=h.size, num_groups=g.size)  # the proj multipliers follow


def shard_mamba1(m: Mamba1Mixer, rank: int, world: int, comm: Comm) -> None:
    """By d_inner channels: x / z rows of ``in_proj``, conv channels, ``dt_proj`` rows, the
    rows of ``A_log`` / ``D``, ``out_proj`` columns. ``x_proj`` reads this rank's channels
    only: its partial ``[dt | B | C]`` is summed over ranks by a hook before the norms."""
    d = m.dims
    h = part(d.d_inner, rank, world, "Mamba1 channels (mamba_expand * hidden_size)")
    column(m.in_proj, [h.scaled(1), h.scaled(1, d.d_inner)])  # [x | z]
    _set(m.conv1d, "weight", _take(m.conv1d.weight, 0, [h]))
    if m.conv1d.bias is not None:
        _set(m.conv1d, "bias", _take(m.conv1d.bias, 0, [h]))
    row(m.x_proj, [h], rank)
    m.x_proj.register_forward_hook(lambda module, args, out: comm.all_reduce(out.contiguous()))
    column(m.dt_proj, [h])
    for name in ("A_log", "D"):
        _set(m, name, _take(getattr(m, name), 0, [h]))
    row(m.out_proj, [h], rank)
    m.dims = replace(d, d_inner=h.size)


def shard_short_conv(m: ShortConv, rank: int, world: int) -> None:
    """By channels: the B / C / x rows of ``in_proj``, conv channels, ``out_proj`` columns."""
    d = m.dims
    c = part(d.channels, rank, world, "short conv channels (hidden_size)")
    column(m.in_proj, [c.scaled(1), c.scaled(1, d.channels), c.scaled(1, 2 * d.channels)])
    _set(m.conv, "weight", _take(m.conv.weight, 0, [c]))
    if m.conv.bias is not None:
        _set(m.conv, "bias", _take(m.conv.bias, 0, [c]))
    row(m.out_proj, [c], rank)
    m.dims = replace(d, channels=c.size)


class SplitGatedRMSNorm(nn.Module):
    """Mamba2's gated RMSNorm when one norm group spans several ranks.

    Every local channel belongs to group ``group``; the sum of squares per token and group
    is summed over ranks (a ``[T, num_groups]`` all-reduce, zeros outside this rank's
    group), then each rank normalises its own channels (fp32, as the reference).
    """

    def __init__(
        self,
        weight: torch.Tensor,
        eps: float,
        group_size: int,
        norm_before_gate: bool,
        group: int,
        num_groups: int,
        comm: Comm,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps, self.group_size, self.norm_before_gate = eps, group_size, norm_before_gate
        self.group, self.num_groups, self.comm = group, num_groups, comm

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        gate = F.silu(z.float())
        v = x.float() if self.norm_before_gate else x.float() * gate
        sums = torch.zeros(v.shape[0], self.num_groups, dtype=torch.float32, device=v.device)
        sums[:, self.group] = v.pow(2).sum(-1)
        sums = self.comm.all_reduce(sums)
        y = v * torch.rsqrt(sums[:, self.group] / self.group_size + self.eps)[:, None]
        y = y * self.weight.float()
        if self.norm_before_gate:
            y = y * gate
        return y.to(x.dtype)


def shard_mlp(mlp: DenseMLP, rank: int, world: int, what: str = "intermediate_size") -> None:
    i = part(mlp.intermediate_size, rank, world, what)
    if mlp.gate_proj is not None:
        column(mlp.gate_proj, [i])
    column(mlp.up_proj, [i])
    if mlp.gate_up_proj_adapter_list is not None:  # LoRA on [gate | up]: same rows
        for index in (0, 1):
            for up in mlp.gate_up_proj_adapter_list.parts(index):
                column(up, [i])
    row(mlp.down_proj, [i], rank)


def shard_moe(moe: SparseMoE, rank: int, world: int) -> None:
    """Every expert's intermediate dim (and the shared expert's); the router is replicated."""
    d = moe.dims
    i = part(d.intermediate_size, rank, world, "MoE expert intermediate size")
    if moe.w_gate is not None:
        _set(moe, "w_gate", _take(moe.w_gate, 1, [i]))
    _set(moe, "w_up", _take(moe.w_up, 1, [i]))
    _set(moe, "w_down", _take(moe.w_down, 2, [i]))
    if moe.shared_expert is not None:
        shard_mlp(moe.shared_expert, rank, world, "shared expert intermediate size")
    moe.dims = replace(d, intermediate_size=i.size, shared_intermediate_size=d.shared_intermediate_size // world)

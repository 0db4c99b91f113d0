"""Griffin's recurrent block (RecurrentGemma's ``temporal_block`` of its recurrent layers).

Per token: ``y = act(linear_y(x))``; ``x = conv_1d(linear_x(x))`` (a depthwise causal conv of
``conv1d_width`` taps with a bias and no activation, ``kernels.conv1d``); the RG-LRU
(``rg_lru``, ``kernels.rglru``) turns x into h with its two gates, each a block-diagonal
projection (``num_attention_heads`` blocks of ``lru_width / heads`` channels:
``x_block @ W_block + b_block``, then a sigmoid), and ``recurrent_param`` (the decay
``a = exp(-8 sigmoid(gate) softplus(recurrent_param))``); the output is
``linear_out(h * y)``. Position 0 resets the recurrence (transformers' document boundary).

State (``StateKind`` ``rglru``): the conv window [lru_width, W-1] in the model dtype and h
[lru_width] fp32. Under TP (``tp_shard``) the gate blocks split: this rank's rows of
``linear_x`` / ``linear_y``, its conv channels, gate blocks and ``recurrent_param``
entries, its columns of ``linear_out`` (whose bias rank 0 keeps); everything between the
projections is per channel or per block, so no other communication is needed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from kernels.rglru import rg_lru, softplus_scale
from workers.models.layers import CausalConv1d, LayerContext, activation, linear, param
from workers.state_spec import StateKind, StateRef, rglru_kind


@dataclass(frozen=True)
class RglruDims:
    hidden_size: int
    width: int  # lru_width (a TP rank's share after sharding)
    num_blocks: int  # the gates' diagonal blocks (num_attention_heads)
    conv_width: int  # conv1d_width
    act: str  # hidden_activation (the y branch)

    @property
    def block_width(self) -> int:
        return self.width // self.num_blocks

    def validate(self) -> None:
        if self.width % self.num_blocks:
            raise ValueError(f"lru_width={self.width} is not a multiple of num_attention_heads={self.num_blocks}")
        if self.conv_width < 1:
            raise ValueError(f"conv1d_width={self.conv_width} must be positive")
        activation(self.act, "hidden_activation")


class Rglru(nn.Module):
    """The RG-LRU's parameters (checkpoint ``rg_lru.*``) and its gate projections."""

    def __init__(self, dims: RglruDims, dtype: torch.dtype) -> None:
        super().__init__()
        h, bw = dims.num_blocks, dims.block_width
        self.recurrent_param = param(dims.width, dtype=dtype)
        self.input_gate_weight = param(h, bw, bw, dtype=dtype)
        self.input_gate_bias = param(h, bw, dtype=dtype)
        self.recurrent_gate_weight = param(h, bw, bw, dtype=dtype)
        self.recurrent_gate_bias = param(h, bw, dtype=dtype)

    def gates(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, C] -> the input- and recurrence-gate logits [T, C] (block by block)."""
        num_tokens, h = x.shape[0], self.input_gate_weight.shape[0]
        blocks = x.reshape(num_tokens, h, -1).transpose(0, 1)  # [H, T, bw]

        def project(w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return torch.baddbmm(b[:, None, :], blocks, w).transpose(0, 1).reshape(num_tokens, -1)

        return (
            project(self.input_gate_weight, self.input_gate_bias),
            project(self.recurrent_gate_weight, self.recurrent_gate_bias),
        )


class RecurrentBlock(nn.Module):
    def __init__(self, dims: RglruDims, dtype: torch.dtype) -> None:
        super().__init__()
        dims.validate()
        self.dims = dims
        self.linear_y = linear(dims.hidden_size, dims.width, True, dtype)
        self.linear_x = linear(dims.hidden_size, dims.width, True, dtype)
        self.linear_out = linear(dims.width, dims.hidden_size, True, dtype)
        self.conv_1d = CausalConv1d(dims.width, dims.conv_width, True, dtype, activation=None)
        self.rg_lru = Rglru(dims, dtype)
        self.act = activation(dims.act, "hidden_activation")

    def state_kind(self) -> StateKind:
        return rglru_kind(self.dims.width, self.dims.conv_width)

    def forward(self, hidden: torch.Tensor, ctx: LayerContext, ref: StateRef) -> torch.Tensor:
        batch, state = ctx.batch, ctx.pools.mamba.layer(ref)
        y = self.act(self.linear_y(hidden))
        x = self.conv_1d(self.linear_x(hidden), state["conv"], batch)
        gx, ga = self.rg_lru.gates(x)
        scale = softplus_scale(self.rg_lru.recurrent_param)
        h = rg_lru(x, gx, ga, scale, batch.positions == 0, state["ssm"], batch.recurrent)
        return self.linear_out(h * y)

    # --- tensor parallelism (``workers/tp/shard.py`` calls these) -------------------------
    def tp_checks(self) -> list[tuple[int, str]]:
        return [(self.dims.num_blocks, "num_attention_heads (RG-LRU gate blocks)")]

    def tp_shard(self, rank: int, world: int, comm: object) -> None:
        from workers.tp.shard_layers import _set, _take, column, part, row

        d = self.dims
        blocks = part(d.num_blocks, rank, world, "RG-LRU gate blocks (num_attention_heads)")
        channels = [blocks.scaled(d.block_width)]
        column(self.linear_x, channels)
        column(self.linear_y, channels)
        _set(self.conv_1d, "weight", _take(self.conv_1d.weight, 0, channels))
        _set(self.conv_1d, "bias", _take(self.conv_1d.bias, 0, channels))
        lru = self.rg_lru
        _set(lru, "recurrent_param", _take(lru.recurrent_param, 0, channels))
        for name in ("input_gate_weight", "input_gate_bias", "recurrent_gate_weight", "recurrent_gate_bias"):
            _set(lru, name, _take(getattr(lru, name), 0, [blocks]))
        row(self.linear_out, channels, rank)
        self.dims = replace(d, width=blocks.size * d.block_width, num_blocks=blocks.size)
